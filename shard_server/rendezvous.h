// Meeting points for fabric groups: every member of a group posts a payload
// and all of them learn every member's payload once the last arrives. A
// round completes once; the next post to the same group starts a new round
// (a group that restarts meets again).
#ifndef PSHARD_SHARD_SERVER_RENDEZVOUS_H_
#define PSHARD_SHARD_SERVER_RENDEZVOUS_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/deadline_timer.h"

namespace pshard {

class RendezvousTable {
 public:
  using Done = std::function<void(absl::StatusOr<std::vector<std::string>>)>;
  /// Withdraws one post while it waits; a no-op once it was answered.
  using Withdraw = std::function<void()>;
  static constexpr size_t kMaxPayloadBytes = 4096;
  static constexpr size_t kMaxGroupNameBytes = 256;
  /// What a table holds at most: the memory of all open rounds stays below
  /// max_open_rounds x max_group_size x (kMaxPayloadBytes + a few hundred
  /// bytes), whoever posts.
  struct Limits {
    int max_group_size = 1024;
    int max_open_rounds = 1024;
  };
  RendezvousTable() = default;
  explicit RendezvousTable(Limits limits) : limits_(limits) {}

  /// Posts `member`'s payload to `group` (of `size` members) and calls
  /// `done` with all payloads in member order when the round completes, or
  /// with DeadlineExceeded naming the members that did not post by
  /// `deadline` (this member's post is then withdrawn). Bad arguments, or a
  /// size that differs from the round's, fail at once and change nothing. A
  /// member that posts again in an open round replaces its earlier post,
  /// whose `done` gets Aborted. A new round beyond the limit of open ones
  /// is refused (ResourceExhausted). Returns what withdraws this post
  /// (its `done` then gets Cancelled, and a round left empty closes): for a
  /// caller that went away, whose seat must not hold a round open.
  Withdraw Post(const std::string& group, int member, int size, std::string payload, absl::Time deadline, Done done);

  /// Answers every waiting post with Unavailable, and every later one too
  /// (the server is stopping).
  void Close();

  /// Open rounds (for tests and status).
  int open_rounds() const;

 private:
  // Calls `done` at most once, whichever of completion, expiry or
  // replacement comes first.
  struct Waiter {
    Done done;
    std::atomic<bool> fired{false};
    void Fire(absl::StatusOr<std::vector<std::string>> result) {
      if (!fired.exchange(true)) done(std::move(result));
    }
  };
  struct Round {
    int size = 0;
    int64_t id = 0;
    std::vector<std::optional<std::string>> payloads;
    std::vector<std::shared_ptr<Waiter>> waiters;
  };
  // Takes `waiter`'s post out of its round, if it still waits there, and
  // answers it with `why` (given the members still missing).
  void TakeOut(const std::string& group, int64_t round_id, int member, const std::shared_ptr<Waiter>& waiter,
               const std::function<absl::Status(const std::vector<int>& missing)>& why);

  const Limits limits_;
  mutable absl::Mutex mu_;
  std::map<std::string, Round> rounds_ ABSL_GUARDED_BY(mu_);
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  DeadlineTimer timer_;
};

}  // namespace pshard

#endif  // PSHARD_SHARD_SERVER_RENDEZVOUS_H_
