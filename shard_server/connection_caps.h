// Bounds on what callers make a shard server hold: the fetches it keeps
// waiting for a version, the bytes of pushes not yet complete. Each is an
// amount held per connection; without a bound, a caller that opens
// thousands of calls holds the server's memory.
#ifndef PSHARD_SHARD_SERVER_CONNECTION_CAPS_H_
#define PSHARD_SHARD_SERVER_CONNECTION_CAPS_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics/metrics.h"

namespace pshard {

/// An amount held by callers, capped per connection (a peer address, or a
/// UCX session) and in all: past either cap, more is refused at once with
/// RESOURCE_EXHAUSTED, naming what was capped. Thread-safe; places may
/// outlive the caps.
class ConnectionCaps {
 public:
  struct Limits {
    int64_t per_connection = 0;
    int64_t total = 0;
  };
  struct Counts;
  /// What one call holds; given back when destroyed.
  class Place {
   public:
    Place(std::shared_ptr<Counts> counts, std::string connection) noexcept
        : counts_(std::move(counts)), connection_(std::move(connection)) {}
    Place(const Place&) = delete;
    Place& operator=(const Place&) = delete;
    ~Place();
    /// Holds `amount` more, or why not (then holds what it held).
    absl::Status Grow(int64_t amount);

   private:
    const std::shared_ptr<Counts> counts_;
    const std::string connection_;
    int64_t held_ = 0;
  };

  /// `what` names the amount in refusals ("fetches waiting for their
  /// versions"), `per` what it is capped per ("connection", "host");
  /// `gauge` (may be null) follows the total.
  ConnectionCaps(std::string what, Limits limits, metrics::Gauge* gauge, std::string per = "connection");
  /// A place holding `amount` on `connection`, or why there is none.
  absl::StatusOr<std::shared_ptr<Place>> Take(const std::string& connection, int64_t amount);
  /// The amount held now, in all.
  int64_t total() const;
  const Limits& limits() const;

 private:
  const std::shared_ptr<Counts> counts_;
};

}  // namespace pshard

#endif  // PSHARD_SHARD_SERVER_CONNECTION_CAPS_H_
