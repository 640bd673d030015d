// The session tokens a shard server hands out at Join: the credential of a
// joined trainer on data paths that do not go through gRPC (UCX).
#ifndef PSHARD_SHARD_SERVER_SESSION_TOKENS_H_
#define PSHARD_SHARD_SERVER_SESSION_TOKENS_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <random>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace pshard {

/// Random token -> trainer rank. Thread-safe. Each rank holds at most
/// kPerRank tokens, so that repeated joins hold no growing state.
///
/// A trainer's session is never taken from it by another Join of its rank
/// while it is live: used on the data path within kUsedLive, or issued
/// within kUnusedGrace and not used yet (its hello is on the way). A Join
/// that names the token it replaces (a trainer rejoining) retires that one;
/// any other Join of a full rank retires the rank's oldest idle token, and
/// is refused (RESOURCE_EXHAUSTED) when every one is live. Readers (rank -1)
/// do not hold on: their oldest token retires.
class SessionTokens {
 public:
  static constexpr size_t kPerRank = 8;
  static constexpr absl::Duration kUsedLive = absl::Minutes(2);
  static constexpr absl::Duration kUnusedGrace = absl::Seconds(10);

  /// `now` is the clock (tests give their own).
  explicit SessionTokens(std::function<absl::Time()> now = [] { return absl::Now(); }) : now_(std::move(now)) {}

  /// A fresh random token for a trainer that joined as `rank` (-1: a tool),
  /// retiring `replaces` if it is a token of that rank.
  absl::StatusOr<uint64_t> Issue(int rank, uint64_t replaces = 0);
  /// Tokens held (for tests of the bound).
  size_t size() const {
    absl::MutexLock lock(&mu_);
    return sessions_.size();
  }
  /// The rank `token` was issued to, or nothing for a token never issued
  /// (or retired). A lookup is a use: it keeps the session live.
  std::optional<int> Lookup(uint64_t token);

 private:
  struct Session {
    int rank = 0;
    absl::Time issued;
    std::optional<absl::Time> used;  // the last lookup
  };
  bool Live(const Session& s, absl::Time now) const {
    return s.used ? now - *s.used < kUsedLive : now - s.issued < kUnusedGrace;
  }
  void Retire(std::deque<uint64_t>& issued, std::deque<uint64_t>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    sessions_.erase(*it);
    issued.erase(it);
  }

  const std::function<absl::Time()> now_;
  mutable absl::Mutex mu_;
  std::random_device rng_;
  absl::flat_hash_map<uint64_t, Session> sessions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<int, std::deque<uint64_t>> by_rank_ ABSL_GUARDED_BY(mu_);  // oldest first
};

}  // namespace pshard

#endif  // PSHARD_SHARD_SERVER_SESSION_TOKENS_H_
