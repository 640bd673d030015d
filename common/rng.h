// Counter-based random numbers: every value is a pure function of
// (seed, stream, index), so results do not depend on how work is split.
#ifndef PSHARD_COMMON_RNG_H_
#define PSHARD_COMMON_RNG_H_

#include <cstdint>

namespace pshard {

/// A strong 64-bit mixing function (the SplitMix64 finalizer).
inline uint64_t Mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// Hash of a (seed, stream, index) triple.
inline uint64_t CounterHash(uint64_t seed, uint64_t stream, uint64_t index) {
  return Mix64(Mix64(Mix64(seed) ^ stream) ^ index);
}

/// Uniform double in [0, 1) for (seed, stream, index).
inline double UniformAt(uint64_t seed, uint64_t stream, uint64_t index) {
  return static_cast<double>(CounterHash(seed, stream, index) >> 11) * 0x1.0p-53;
}

/// Standard normal sample for (seed, stream, index) via Box-Muller.
double NormalAt(uint64_t seed, uint64_t stream, uint64_t index);

}  // namespace pshard

#endif  // PSHARD_COMMON_RNG_H_
