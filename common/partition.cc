#include "common/partition.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pshard {

SliceRange UnitPartition::Slice(int shard) const {
  SliceRange r;
  r.begin = static_cast<int64_t>(shard) * slice_length;
  r.length = slice_length;
  r.valid = std::clamp<int64_t>(numel - r.begin, 0, slice_length);
  return r;
}

absl::StatusOr<UnitPartition> PartitionUnit(int64_t numel, int num_shards,
                                            int64_t alignment) {
  if (numel < 0) return absl::InvalidArgumentError(absl::StrCat("unit size ", numel, " is negative"));
  if (num_shards < 1) {
    return absl::InvalidArgumentError(absl::StrCat("number of shards ", num_shards, " must be >= 1"));
  }
  if (alignment < 1) return absl::InvalidArgumentError(absl::StrCat("alignment ", alignment, " must be >= 1"));
  UnitPartition p;
  p.numel = numel;
  p.num_shards = num_shards;
  const int64_t per_shard = (numel + num_shards - 1) / num_shards;
  // Every slice has at least one aligned block so that no shard is empty.
  p.slice_length = std::max<int64_t>(1, (per_shard + alignment - 1) / alignment) * alignment;
  return p;
}

absl::StatusOr<std::vector<UnitPartition>> PartitionUnits(std::span<const int64_t> unit_numels,
                                                          int num_shards, int64_t alignment) {
  std::vector<UnitPartition> out;
  out.reserve(unit_numels.size());
  for (int64_t n : unit_numels) {
    ASSIGN_OR_RETURN(UnitPartition p, PartitionUnit(n, num_shards, alignment));
    out.push_back(p);
  }
  return out;
}

}  // namespace pshard
