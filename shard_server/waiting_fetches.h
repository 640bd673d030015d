// Bounds on the fetches a shard server holds waiting for a version. Each
// waiting fetch holds a call (its buffers, a timer entry) until the version
// is published, its deadline passes or its caller leaves; without a bound,
// a caller that opens thousands holds the server's memory.
#ifndef PSHARD_SHARD_SERVER_WAITING_FETCHES_H_
#define PSHARD_SHARD_SERVER_WAITING_FETCHES_H_

#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics/metrics.h"

namespace pshard {

/// Counts the fetches not yet answered, in all and per connection (a peer
/// address, or a UCX session), and refuses one past either cap with
/// RESOURCE_EXHAUSTED, at once. Thread-safe; places may outlive it.
class WaitingFetches {
 public:
  struct Limits {
    int per_connection = 256;  ///< a trainer waits on a few units per server
    int total = 4096;          ///< every connection together
  };
  /// One fetch's place; given back when destroyed.
  class Place;

  /// `gauge` (may be null) follows the total.
  WaitingFetches(Limits limits, metrics::Gauge* gauge);
  /// A place for one more fetch on `connection`, or why there is none.
  absl::StatusOr<std::shared_ptr<Place>> Take(const std::string& connection);
  /// Places held now, in all.
  int total() const;

 private:
  struct Counts;
  const std::shared_ptr<Counts> counts_;
};

}  // namespace pshard

#endif  // PSHARD_SHARD_SERVER_WAITING_FETCHES_H_
