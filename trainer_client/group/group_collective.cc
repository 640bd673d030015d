#include "trainer_client/group/group_collective.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/partition.h"
#include "common/reduction_tree.h"
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

namespace {

// Floats that hold `bytes` bytes (encoded bytes travel four to a float).
int64_t SlotsFor(int64_t bytes) { return (bytes + 3) / 4; }

// The encoded bytes of `ranges`, each a slice of its own.
int64_t EncodedBytesOf(const WireFormat& format, const std::vector<ElementRange>& ranges) {
  int64_t bytes = 0;
  for (const ElementRange& r : ranges) bytes += static_cast<int64_t>(format.EncodedBytes(r.length));
  return bytes;
}

std::byte* BytesOf(std::vector<float>& v) { return reinterpret_cast<std::byte*>(v.data()); }

}  // namespace

double FabricBytesPerElement(const WireFormat& format) {
  if (!format.quantized()) return static_cast<double>(format.EncodedBytes(1));
  return static_cast<double>(format.EncodedBytes(format.block())) / format.block();
}

absl::StatusOr<int64_t> AllGatherWeights(GroupCollective& group, std::span<float> buffer, const GroupOwnership& owned,
                                         const WireFormat& weights) {
  const int size = group.size(), me = group.rank();
  RETURN_IF_ERROR(CheckOwnership(static_cast<int64_t>(buffer.size()), owned, size));
  int64_t received = 0;
  for (int m = 0; m < size; ++m) received += m == me ? 0 : EncodedBytesOf(weights, owned[m]);
  if (weights.encoding() == WireEncoding::kFp32) {
    RETURN_IF_ERROR(group.AllGather(buffer, owned));
    return received;
  }
  // Each member's ranges encoded one after another, in float slots: one
  // range of a packed buffer that the group all-gathers (bits copied).
  std::vector<int64_t> offset(size + 1, 0);
  GroupOwnership packed_owned(size);
  for (int m = 0; m < size; ++m) {
    const int64_t slots = SlotsFor(EncodedBytesOf(weights, owned[m]));
    packed_owned[m] = {ElementRange{offset[m], slots}};
    offset[m + 1] = offset[m] + slots;
  }
  std::vector<float> packed(offset[size], 0.0f);
  std::byte* at = BytesOf(packed) + 4 * offset[me];
  for (const ElementRange& r : owned[me]) {
    if (!EncodeDecodedExactly(weights, buffer.subspan(r.begin, r.length), at)) {
      return absl::InternalError(absl::StrCat("fabric all-gather: member ", me, "'s range [", r.begin, ", ",
                                              r.begin + r.length, ") is not a decode of ", weights.ToString(),
                                              ": the weights did not come in that encoding"));
    }
    at += weights.EncodedBytes(r.length);
  }
  RETURN_IF_ERROR(group.AllGather(packed, packed_owned));
  for (int m = 0; m < size; ++m) {
    if (m == me) continue;
    at = BytesOf(packed) + 4 * offset[m];
    for (const ElementRange& r : owned[m]) {
      DecodeElements(weights, at, buffer.subspan(r.begin, r.length));
      at += weights.EncodedBytes(r.length);
    }
  }
  return received;
}

absl::StatusOr<int64_t> ReduceScatterGradients(GroupCollective& group, std::span<float> buffer,
                                               const GroupOwnership& owned, const WireFormat& grads,
                                               std::span<float> residual) {
  const int size = group.size(), me = group.rank();
  RETURN_IF_ERROR(CheckOwnership(static_cast<int64_t>(buffer.size()), owned, size));
  if (grads.encoding() == WireEncoding::kFp32) {
    RETURN_IF_ERROR(group.ReduceScatter(buffer, owned));
    return 4 * (size - 1) * RangeElements(owned[me]);
  }
  if (!residual.empty() && residual.size() != buffer.size()) {
    return absl::InvalidArgumentError(absl::StrCat("fabric reduce-scatter: a residual of ", residual.size(),
                                                   " elements for a unit of ", buffer.size()));
  }
  const bool feedback = grads.quantized() && !residual.empty();
  // This member's contribution to each other member's ranges, encoded.
  std::vector<std::vector<float>> outgoing(size);
  std::vector<int64_t> expected(size, 0);
  std::vector<float> part, scratch;
  for (int m = 0; m < size; ++m) {
    if (m == me) continue;
    expected[m] = SlotsFor(EncodedBytesOf(grads, owned[me]));
    outgoing[m].assign(SlotsFor(EncodedBytesOf(grads, owned[m])), 0.0f);
    std::byte* at = BytesOf(outgoing[m]);
    for (const ElementRange& r : owned[m]) {
      part.assign(buffer.begin() + r.begin, buffer.begin() + r.begin + r.length);
      const bool finite =
          QuantizeWithFeedback(grads, part, feedback ? residual.subspan(r.begin, r.length) : std::span<float>(),
                               &scratch);
      EncodeElements(grads, part, at);
      if (!finite && grads.quantized()) {
        // Blocks of a non-finite contribution code to zero: a NaN scale
        // makes them decode to NaN instead (bf16 carries inf and NaN itself).
        const float nan = std::numeric_limits<float>::quiet_NaN();
        for (int64_t b = 0; b < r.length; b += grads.block()) std::memcpy(at + grads.EncodedBytes(b), &nan, 4);
      }
      at += grads.EncodedBytes(r.length);
    }
  }
  ASSIGN_OR_RETURN(std::vector<std::vector<float>> received, group.Exchange(outgoing, expected));
  if (static_cast<int>(received.size()) != size) {
    return absl::InternalError(absl::StrCat("fabric reduce-scatter: the exchange returned ", received.size(),
                                            " members' parts for ", size));
  }
  std::vector<const std::byte*> at(size, nullptr);
  for (int m = 0; m < size; ++m) {
    if (m == me) continue;
    if (static_cast<int64_t>(received[m].size()) != expected[m]) {
      return absl::InternalError(absl::StrCat("fabric reduce-scatter: member ", m, " sent ", received[m].size(),
                                              " elements; expected ", expected[m]));
    }
    at[m] = BytesOf(received[m]);
  }
  int64_t bytes = 0;
  for (const ElementRange& r : owned[me]) {
    std::vector<std::vector<float>> parts(size);
    for (int m = 0; m < size; ++m) {
      if (m == me) {
        parts[m].assign(buffer.begin() + r.begin, buffer.begin() + r.begin + r.length);
        continue;
      }
      parts[m].resize(r.length);
      DecodeElements(grads, at[m], parts[m]);
      at[m] += grads.EncodedBytes(r.length);
      bytes += static_cast<int64_t>(grads.EncodedBytes(r.length));
    }
    const std::vector<float> sum = TreeSum(std::move(parts));
    std::copy(sum.begin(), sum.end(), buffer.begin() + r.begin);
  }
  return bytes;
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
