// The session tokens a shard server hands out at Join: the credential of a
// joined trainer on data paths that do not go through gRPC (UCX).
#ifndef PSHARD_SHARD_SERVER_SESSION_TOKENS_H_
#define PSHARD_SHARD_SERVER_SESSION_TOKENS_H_

#include <cstdint>
#include <optional>
#include <random>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"

namespace pshard {

/// Random token -> trainer rank. Thread-safe.
class SessionTokens {
 public:
  /// A fresh random token for a trainer that joined as `rank` (-1: a tool).
  uint64_t Issue(int rank) {
    absl::MutexLock lock(&mu_);
    uint64_t token = 0;
    while (token == 0 || ranks_.contains(token)) token = (uint64_t{rng_()} << 32) ^ rng_();
    ranks_[token] = rank;
    return token;
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
};

}  // namespace pshard

#endif  // PSHARD_SHARD_SERVER_SESSION_TOKENS_H_
