// Collectives inside a fabric group: trainers joined by a fast fabric that
// split each unit's fetch among themselves (all-gather) and reduce their
// gradients before pushing (reduce-scatter), so the slow network carries
// each byte once per group. Implementations, a folder each: host/ (threads
// of one process, shared memory: the grouping logic runs anywhere),
// socket/ (processes over TCP) and nccl/ (GPUs, built into the GPU plugin).
#ifndef PSHARD_TRAINER_CLIENT_GROUP_GROUP_COLLECTIVE_H_
#define PSHARD_TRAINER_CLIENT_GROUP_GROUP_COLLECTIVE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/partition.h"
#include "common/wire_encoding.h"

namespace pshard {

/// A run of elements [begin, begin + length) of a unit buffer.
struct ElementRange {
  int64_t begin = 0;
  int64_t length = 0;
};

/// Which ranges of a unit buffer each member is responsible for.
using GroupOwnership = std::vector<std::vector<ElementRange>>;  // [member][range]

/// One member's handle on its group. Every member must make the same calls
/// in the same order (they are collective). Not thread-safe per member.
class GroupCollective {
 public:
  virtual ~GroupCollective() = default;
  virtual int size() const = 0;
  /// This member's index in the group, 0..size()-1.
  virtual int rank() const = 0;

  /// On entry each member's `buffer` holds valid data in its own ranges of
  /// `owned`; on return every member's buffer holds every member's ranges.
  virtual absl::Status AllGather(std::span<float> buffer, const GroupOwnership& owned) = 0;

  /// On entry each member's `buffer` holds its full contribution; on return
  /// this member's ranges of `owned` hold the sum over members, in the
  /// canonical tree order of member index (common/reduction_tree.h). Other
  /// ranges are unspecified.
  virtual absl::Status ReduceScatter(std::span<float> buffer, const GroupOwnership& owned) = 0;

  /// All-to-all: hands `outgoing[m]` to every other member m and returns
  /// what each member m handed this one (`expected[m]` elements; this
  /// member's own entry empty). Elements are copied, never computed on, so
  /// they may carry any bits (encoded bytes, four to an element).
  virtual absl::StatusOr<std::vector<std::vector<float>>> Exchange(const std::vector<std::vector<float>>& outgoing,
                                                                   const std::vector<int64_t>& expected) = 0;
};

/// How the members of a group that are separate processes find each other:
/// posts this member's payload and returns every member's, in member order.
using RendezvousFn = std::function<absl::StatusOr<std::vector<std::string>>(const std::string& payload)>;

/// Elements in `ranges`.
int64_t RangeElements(const std::vector<ElementRange>& ranges);
/// Copies `buffer`'s elements in `ranges`, in order, to `out` (which holds
/// RangeElements(ranges)); UnpackRanges puts them back.
void PackRanges(std::span<const float> buffer, const std::vector<ElementRange>& ranges, float* out);
void UnpackRanges(const float* in, const std::vector<ElementRange>& ranges, std::span<float> buffer);

/// Checks that `owned` lists `group_size` members and that every range lies
/// inside a buffer of `buffer_size` elements (the collectives' precondition).
absl::Status CheckOwnership(int64_t buffer_size, const GroupOwnership& owned, int group_size);

/// Bytes per element of `format` over a long run of elements (a block's
/// scale spread over its elements): what a fabric collective moves per
/// element of the ranges it carries.
double FabricBytesPerElement(const WireFormat& format);

/// AllGather of a unit's weights as they arrived from the servers in
/// `weights`: bf16 and int8 values cross the fabric encoded (each range
/// coded again so that it decodes to the same bits, a range being a slice
/// whose blocks start at its first element), fp32 as itself; every member
/// ends with the bits a plain AllGather gives. Internal error when this
/// member's values are not a decode of `weights`. Returns the payload bytes
/// this member received: the encoded bytes of the other members' ranges.
absl::StatusOr<int64_t> AllGatherWeights(GroupCollective& group, std::span<float> buffer, const GroupOwnership& owned,
                                         const WireFormat& weights);

/// ReduceScatter of a unit's gradients in the encoding they are pushed in:
/// each member encodes its contribution to every other member's ranges in
/// `grads` (int8 and int4 after adding this member's error-feedback
/// `residual` for that range, a unit-sized buffer or empty for none, which
/// keeps what the encoding took off), and each member sums, range by range
/// in member order (the canonical tree), the others' decoded contributions
/// and its own. fp32 is a plain ReduceScatter. A contribution that is not
/// finite arrives as NaN, so that the sum says so. Returns the payload bytes
/// this member received.
absl::StatusOr<int64_t> ReduceScatterGradients(GroupCollective& group, std::span<float> buffer,
                                               const GroupOwnership& owned, const WireFormat& grads,
                                               std::span<float> residual);

/// Shard s is fetched and pushed by member s % group_size: the ranges of
/// each member in a unit with that partition.
GroupOwnership ShardOwnership(const UnitPartition& partition, int group_size);

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_GROUP_GROUP_COLLECTIVE_H_
