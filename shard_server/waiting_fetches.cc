#include "shard_server/waiting_fetches.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pshard {

struct WaitingFetches::Counts {
  Counts(Limits l, metrics::Gauge* g) : limits(l), gauge(g) {}
  const Limits limits;
  metrics::Gauge* const gauge;
  absl::Mutex mu;
  int total ABSL_GUARDED_BY(mu) = 0;
  absl::flat_hash_map<std::string, int> by_connection ABSL_GUARDED_BY(mu);
};

class WaitingFetches::Place {
 public:
  Place(std::shared_ptr<Counts> counts, std::string connection)
      : counts_(std::move(counts)), connection_(std::move(connection)) {}
  Place(const Place&) = delete;
  Place& operator=(const Place&) = delete;
  ~Place() {
    absl::MutexLock lock(&counts_->mu);
    auto it = counts_->by_connection.find(connection_);
    if (--it->second == 0) counts_->by_connection.erase(it);
    --counts_->total;
    if (counts_->gauge) counts_->gauge->Set(counts_->total);
  }

 private:
  const std::shared_ptr<Counts> counts_;
  const std::string connection_;
};

WaitingFetches::WaitingFetches(Limits limits, metrics::Gauge* gauge)
    : counts_(std::make_shared<Counts>(limits, gauge)) {}

absl::StatusOr<std::shared_ptr<WaitingFetches::Place>> WaitingFetches::Take(const std::string& connection) {
  Counts& c = *counts_;
  absl::MutexLock lock(&c.mu);
  if (c.total >= c.limits.total) {
    return absl::ResourceExhaustedError(absl::StrCat("this shard holds ", c.total,
                                                     " fetches waiting for their versions, its cap: try again later"));
  }
  int& mine = c.by_connection[connection];
  if (mine >= c.limits.per_connection) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this connection holds ", mine, " fetches waiting for their versions, the cap of one connection"));
  }
  ++mine;
  ++c.total;
  if (c.gauge) c.gauge->Set(c.total);
  return std::make_shared<Place>(counts_, connection);
}

int WaitingFetches::total() const {
  absl::MutexLock lock(&counts_->mu);
  return counts_->total;
}

}  // namespace pshard
