#include "shard_server/connection_caps.h"

#include "absl/strings/str_cat.h"

namespace pshard {

struct ConnectionCaps::Counts {
  Counts(std::string w, Limits l, metrics::Gauge* g, std::string p)
      : what(std::move(w)), per(std::move(p)), limits(l), gauge(g) {}
  const std::string what;
  const std::string per;
  const Limits limits;
  metrics::Gauge* const gauge;
  absl::Mutex mu;
  int64_t total ABSL_GUARDED_BY(mu) = 0;
  absl::flat_hash_map<std::string, int64_t> by_connection ABSL_GUARDED_BY(mu);
};

ConnectionCaps::Place::~Place() {
  if (held_ == 0) return;
  Counts& c = *counts_;
  absl::MutexLock lock(&c.mu);
  auto it = c.by_connection.find(connection_);
  if ((it->second -= held_) == 0) c.by_connection.erase(it);
  c.total -= held_;
  if (c.gauge) c.gauge->Set(static_cast<double>(c.total));
}

absl::Status ConnectionCaps::Place::Grow(int64_t amount) {
  if (amount == 0) return absl::OkStatus();
  Counts& c = *counts_;
  absl::MutexLock lock(&c.mu);
  if (c.total + amount > c.limits.total) {
    return absl::ResourceExhaustedError(absl::StrCat("this shard holds ", c.total, " ", c.what, " of at most ",
                                                     c.limits.total, ": try again later"));
  }
  int64_t& mine = c.by_connection[connection_];
  if (mine + amount > c.limits.per_connection) {
    const int64_t now = mine;
    if (now == 0) c.by_connection.erase(connection_);
    return absl::ResourceExhaustedError(absl::StrCat("this ", c.per, " holds ", now, " ", c.what, " of at most ",
                                                     c.limits.per_connection, " a ", c.per));
  }
  mine += amount;
  held_ += amount;
  c.total += amount;
  if (c.gauge) c.gauge->Set(static_cast<double>(c.total));
  return absl::OkStatus();
}

ConnectionCaps::ConnectionCaps(std::string what, Limits limits, metrics::Gauge* gauge, std::string per)
    : counts_(std::make_shared<Counts>(std::move(what), limits, gauge, std::move(per))) {}

absl::StatusOr<std::shared_ptr<ConnectionCaps::Place>> ConnectionCaps::Take(const std::string& connection,
                                                                            int64_t amount) {
  auto place = std::make_shared<Place>(counts_, connection);
  if (absl::Status s = place->Grow(amount); !s.ok()) return s;
  return place;
}

int64_t ConnectionCaps::total() const {
  absl::MutexLock lock(&counts_->mu);
  return counts_->total;
}

const ConnectionCaps::Limits& ConnectionCaps::limits() const { return counts_->limits; }

}  // namespace pshard
