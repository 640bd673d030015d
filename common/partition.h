// The partition of each unit's flat parameter vector into N shard slices.
//
// A unit of `numel` elements is padded to `N * slice_length` elements, where
// slice_length is ceil(numel / N) rounded up to the alignment. Shard s owns
// elements [s * slice_length, (s + 1) * slice_length) of the padded vector;
// the padding (at the end of the vector) is always zero. The partition is a
// pure function of (unit sizes, N, alignment).
#ifndef PSHARD_COMMON_PARTITION_H_
#define PSHARD_COMMON_PARTITION_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"

namespace pshard {

/// Default slice alignment in elements (256 bytes of fp32).
inline constexpr int64_t kSliceAlignment = 64;

/// One shard's slice of a unit, in padded-unit coordinates.
struct SliceRange {
  int64_t begin = 0;   ///< first element of the slice
  int64_t length = 0;  ///< elements in the slice (padding included)
  /// Elements of real (non-padding) data at the start of the slice.
  int64_t valid = 0;
};

/// How one unit is split over the shards. A plain value type.
struct UnitPartition {
  int64_t numel = 0;         ///< real elements of the unit
  int64_t slice_length = 0;  ///< elements per slice, a multiple of alignment
  int num_shards = 0;

  int64_t padded_numel() const { return slice_length * num_shards; }
  SliceRange Slice(int shard) const;
};

/// Partitions one unit. Fails for numel < 0, num_shards < 1, alignment < 1.
absl::StatusOr<UnitPartition> PartitionUnit(int64_t numel, int num_shards,
                                            int64_t alignment = kSliceAlignment);

/// Partitions every unit of a model the same way.
absl::StatusOr<std::vector<UnitPartition>> PartitionUnits(
    std::span<const int64_t> unit_numels, int num_shards,
    int64_t alignment = kSliceAlignment);

}  // namespace pshard

#endif  // PSHARD_COMMON_PARTITION_H_
