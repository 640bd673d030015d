#include "trainer_client/group/group_collective.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "common/partition.h"
#include "common/status_macros.h"

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

int FabricGatherBytesPerElement(WireEncoding weights) { return weights == WireEncoding::kBf16 ? 2 : 4; }

absl::StatusOr<int64_t> AllGatherWeights(GroupCollective& group, std::span<float> buffer, const GroupOwnership& owned,
                                         WireEncoding weights) {
  const int size = group.size(), me = group.rank();
  RETURN_IF_ERROR(CheckOwnership(static_cast<int64_t>(buffer.size()), owned, size));
  int64_t others = 0;
  for (int m = 0; m < size; ++m) others += m == me ? 0 : RangeElements(owned[m]);
  if (FabricGatherBytesPerElement(weights) == 4) {
    RETURN_IF_ERROR(group.AllGather(buffer, owned));
    return 4 * others;
  }
  // Each member's values as bf16, two to a float slot, its slots one range
  // of a packed buffer that the group all-gathers (bits copied, never
  // computed on).
  std::vector<int64_t> count(size), offset(size + 1, 0);
  GroupOwnership packed_owned(size);
  for (int m = 0; m < size; ++m) {
    count[m] = RangeElements(owned[m]);
    const int64_t slots = (count[m] + 1) / 2;
    packed_owned[m] = {ElementRange{offset[m], slots}};
    offset[m + 1] = offset[m] + slots;
  }
  std::vector<float> packed(offset[size], 0.0f);
  {
    std::vector<float> mine(count[me]);
    PackRanges(buffer, owned[me], mine.data());
    std::vector<uint16_t> bf16(count[me]);
    for (int64_t i = 0; i < count[me]; ++i) {
      bf16[i] = FloatToBf16(mine[i]);
      const float back = Bf16ToFloat(bf16[i]);
      if (std::memcmp(&back, &mine[i], sizeof(float)) != 0) {
        return absl::InternalError(absl::StrCat("fabric all-gather: element ", i, " of member ", me,
                                                "'s ranges is not a bf16 value: the weights did not come as bf16"));
      }
    }
    std::memcpy(packed.data() + offset[me], bf16.data(), bf16.size() * sizeof(uint16_t));
  }
  RETURN_IF_ERROR(group.AllGather(packed, packed_owned));
  for (int m = 0; m < size; ++m) {
    if (m == me) continue;
    std::vector<uint16_t> bf16(count[m]);
    std::memcpy(bf16.data(), packed.data() + offset[m], bf16.size() * sizeof(uint16_t));
    std::vector<float> values(count[m]);
    for (int64_t i = 0; i < count[m]; ++i) values[i] = Bf16ToFloat(bf16[i]);
    UnpackRanges(values.data(), owned[m], buffer);
  }
  return 2 * others;
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
