#include "shard_server/session_tokens.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pshard {

absl::StatusOr<uint64_t> SessionTokens::Issue(int rank, uint64_t replaces) {
  const absl::Time now = now_();
  absl::MutexLock lock(&mu_);
  std::deque<uint64_t>& issued = by_rank_[rank];
  if (replaces != 0) {
    if (auto it = std::find(issued.begin(), issued.end(), replaces); it != issued.end()) Retire(issued, it);
  }
  if (issued.size() >= kPerRank) {
    auto idle = rank < 0 ? issued.begin()
                         : std::find_if(issued.begin(), issued.end(),
                                        [&](uint64_t t) { return !Live(sessions_.at(t), now); });
    if (idle == issued.end()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "trainer ", rank, " already holds ", kPerRank, " live sessions (each used within ",
          absl::FormatDuration(kUsedLive), ", or issued within ", absl::FormatDuration(kUnusedGrace),
          "); a Join as that rank cannot take one away: retry when one has fallen idle"));
    }
    Retire(issued, idle);
  }
  uint64_t token = 0;
  while (token == 0 || sessions_.contains(token)) token = (uint64_t{rng_()} << 32) ^ rng_();
  sessions_[token] = Session{rank, now, std::nullopt};
  issued.push_back(token);
  return token;
}

std::optional<int> SessionTokens::Lookup(uint64_t token) {
  const absl::Time now = now_();
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(token);
  if (it == sessions_.end()) return std::nullopt;
  it->second.used = now;
  return it->second.rank;
}

}  // namespace pshard
