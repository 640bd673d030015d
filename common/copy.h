// The data path's copies of large byte ranges.
#ifndef PSHARD_COMMON_COPY_H_
#define PSHARD_COMMON_COPY_H_

#include <cstddef>

namespace pshard {

/// memcpy(dst, src, n) for ranges that do not overlap, with 16-byte vector
/// moves from 256 bytes up to 4 MiB. glibc's memcpy uses `rep movsb` in that
/// range, which some CPUs run at a small fraction of their vector copy rate
/// (measured on an AMD EPYC VM: 2 GB/s for 32 KiB in cache, against 46 GB/s;
/// bench/README.md, wire_codec_bench). Beyond 4 MiB glibc's non-temporal
/// copy is used as it is.
void CopyBytes(void* dst, const void* src, size_t n);

}  // namespace pshard

#endif  // PSHARD_COMMON_COPY_H_
