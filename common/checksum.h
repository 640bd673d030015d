// CRC-32C (Castagnoli) of byte ranges, used to verify fetched units.
#ifndef PSHARD_COMMON_CHECKSUM_H_
#define PSHARD_COMMON_CHECKSUM_H_

#include <cstddef>
#include <cstdint>

namespace pshard {

/// Extends `crc` (0 for a fresh checksum) over `size` bytes at `data`.
/// Uses the SSE4.2 instruction where the CPU has it, as three interleaved
/// streams over ranges of 6 KiB or more (bench/README.md gives the GB/s).
/// Thread-safe.
uint32_t Crc32c(const void* data, size_t size, uint32_t crc = 0);

/// The CRC-32C of A followed by B, from Crc32c(A), Crc32c(B) and the length
/// of B: pieces of a range checksummed apart (in any order, on any thread)
/// join into the range's checksum. O(log length_b).
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b);

}  // namespace pshard

#endif  // PSHARD_COMMON_CHECKSUM_H_
