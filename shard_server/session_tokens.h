// The session tokens a shard server hands out at Join: the credential of a
// joined trainer on data paths that do not go through gRPC (UCX).
#ifndef PSHARD_SHARD_SERVER_SESSION_TOKENS_H_
#define PSHARD_SHARD_SERVER_SESSION_TOKENS_H_

#include <cstdint>
#include <deque>
#include <optional>
#include <random>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"

namespace pshard {

/// Random token -> trainer rank. Thread-safe. Each rank holds at most
/// kPerRank tokens (a rank's newest joins: a restarted trainer's, or a
/// tool's): issuing one more retires the rank's oldest, so that repeated
/// joins hold no growing state.
class SessionTokens {
 public:
  static constexpr size_t kPerRank = 8;

  /// A fresh random token for a trainer that joined as `rank` (-1: a tool).
  uint64_t Issue(int rank) {
    absl::MutexLock lock(&mu_);
    uint64_t token = 0;
    while (token == 0 || ranks_.contains(token)) token = (uint64_t{rng_()} << 32) ^ rng_();
    ranks_[token] = rank;
    std::deque<uint64_t>& issued = by_rank_[rank];
    issued.push_back(token);
    if (issued.size() > kPerRank) {
      ranks_.erase(issued.front());
      issued.pop_front();
    }
    return token;
  }
  /// Tokens held (for tests of the bound).
  size_t size() const {
    absl::MutexLock lock(&mu_);
    return ranks_.size();
  }
  /// The rank `token` was issued to, or nothing for a token never issued.
  std::optional<int> Lookup(uint64_t token) const {
    absl::MutexLock lock(&mu_);
    auto it = ranks_.find(token);
    if (it == ranks_.end()) return std::nullopt;
    return it->second;
  }

 private:
  mutable absl::Mutex mu_;
  std::random_device rng_;
  absl::flat_hash_map<uint64_t, int> ranks_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<int, std::deque<uint64_t>> by_rank_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pshard

#endif  // PSHARD_SHARD_SERVER_SESSION_TOKENS_H_
