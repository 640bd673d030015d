// How a pshard process's allocator treats the large transient buffers of
// the data path (a unit's fetch buffer, a gradient's reduction buffer, the
// transports' receive buffers: megabytes each, several per unit and step).
#ifndef PSHARD_COMMON_MEMORY_POLICY_H_
#define PSHARD_COMMON_MEMORY_POLICY_H_

namespace pshard {

/// Has glibc's malloc keep freed buffers of up to 32 MiB for reuse instead
/// of unmapping each one, and return the top of the heap to the system only
/// past 256 MiB free. Otherwise every such buffer is a fresh mapping whose
/// pages the kernel faults in and zeroes on first touch: on loopback that
/// cost more than the bytes' own copies (bench/README.md, "Profiles").
/// Call once at the start of main, before any thread starts.
void ReuseFreedMemory();

}  // namespace pshard

#endif  // PSHARD_COMMON_MEMORY_POLICY_H_
