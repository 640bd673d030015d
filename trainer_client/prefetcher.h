// Fetches the units of one pass in schedule order, a configurable number
// ahead of the one being computed, and accounts the time spent waiting.
#ifndef PSHARD_TRAINER_CLIENT_PREFETCHER_H_
#define PSHARD_TRAINER_CLIENT_PREFETCHER_H_

#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "trainer_client/busy_clock.h"
#include "trainer_client/group/group_collective.h"
#include "trainer_client/shard_client.h"

namespace pshard {

/// Accounting shared by everything a step transfers.
struct TransferLog {
  IntervalUnion waits;  ///< when the trainer waited for (or issued) transfers
  IntervalUnion busy;   ///< when any transfer was in flight
  std::vector<absl::Duration> fetch_latencies;
  std::vector<absl::Duration> push_latencies;
  int64_t bytes_fetched = 0;
  int64_t bytes_pushed = 0;
  int64_t payload_fetched = 0;  ///< UnitTransfer::payload_bytes
  int64_t payload_pushed = 0;
  /// Received from the fabric group's other members (unit parts, encoded).
  int64_t fabric_gathered = 0;
  int64_t fabric_reduced = 0;
};

/// Not thread-safe. With a fabric group, each member fetches only its
/// shards and the group all-gathers the rest when a unit is consumed.
class Prefetcher {
 public:
  /// `group` may be null. All pointers must outlive the prefetcher.
  Prefetcher(ShardClient* client, GroupCollective* group, std::vector<int> schedule, int64_t version, int depth,
             TransferLog* log);
  ~Prefetcher();  ///< waits for fetches started but not consumed

  /// The unit at schedule position `i` (positions are consumed in order).
  absl::StatusOr<std::shared_ptr<UnitTransfer>> Get(size_t i);

 private:
  ShardClient* const client_;
  GroupCollective* const group_;
  const std::vector<int> schedule_;
  const int64_t version_;
  const int depth_;
  TransferLog* const log_;
  std::optional<std::vector<int>> my_shards_;  // unset without a group
  std::vector<std::shared_ptr<UnitTransfer>> transfers_;
  size_t started_ = 0;
};

/// The shards member `member` of a group of `size` fetches and pushes.
std::vector<int> MemberShards(int num_shards, int size, int member);

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_PREFETCHER_H_
