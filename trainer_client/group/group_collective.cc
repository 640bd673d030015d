#include "trainer_client/group/group_collective.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/partition.h"

namespace pshard {

int64_t RangeElements(const std::vector<ElementRange>& ranges) {
  int64_t n = 0;
  for (const ElementRange& r : ranges) n += r.length;
  return n;
}

void PackRanges(std::span<const float> buffer, const std::vector<ElementRange>& ranges, float* out) {
  for (const ElementRange& r : ranges) {
    std::memcpy(out, buffer.data() + r.begin, r.length * sizeof(float));
    out += r.length;
  }
}

void UnpackRanges(const float* in, const std::vector<ElementRange>& ranges, std::span<float> buffer) {
  for (const ElementRange& r : ranges) {
    std::memcpy(buffer.data() + r.begin, in, r.length * sizeof(float));
    in += r.length;
  }
}

absl::Status CheckOwnership(int64_t buffer_size, const GroupOwnership& owned, int group_size) {
  if (static_cast<int>(owned.size()) != group_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("ownership lists ", owned.size(), " members; the group has ", group_size));
  }
  for (const auto& ranges : owned) {
    for (const ElementRange& r : ranges) {
      if (r.begin < 0 || r.length < 0 || r.begin + r.length > buffer_size) {
        return absl::InvalidArgumentError(absl::StrCat("range [", r.begin, ", ", r.begin + r.length,
                                                       ") is outside a buffer of ", buffer_size));
      }
    }
  }
  return absl::OkStatus();
}

GroupOwnership ShardOwnership(const UnitPartition& partition, int group_size) {
  GroupOwnership owned(group_size);
  for (int s = 0; s < partition.num_shards; ++s) {
    const SliceRange slice = partition.Slice(s);
    owned[s % group_size].push_back({slice.begin, slice.length});
  }
  return owned;
}

}  // namespace pshard
