// Agreement on each step's global gradient norm. Shard 0 hosts the
// coordinator: every shard reports its partial sum of squares, and all learn
// the total (exact, so the same bits for any number of shards) before any
// of them updates a slice.
#ifndef PSHARD_SHARD_SERVER_NORM_COORDINATOR_H_
#define PSHARD_SHARD_SERVER_NORM_COORDINATOR_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/deadline_timer.h"
#include "shard_server/shard_state.h"

namespace pshard {

/// A shard reports at most this many checkpoint steps per norm round (its
/// newest ones).
inline constexpr int kMaxReportedCheckpoints = 64;

/// Collects partial norms per step; also intersects the shards' lists of
/// checkpoint steps held on disk (each sorted). Thread-safe.
class NormCoordinator {
 public:
  /// Finished rounds kept so that a retried report still gets its answer.
  static constexpr int64_t kRoundsKept = 4;

  explicit NormCoordinator(int num_shards) : num_shards_(num_shards) {}

  /// Records `shard`'s partial for `step` (a repeated report replaces the
  /// first) and calls `done` once all shards have reported, or with
  /// DeadlineExceeded naming the missing shards at `deadline`.
  void Report(int64_t step, int shard, const StepNorm& partial, absl::Time deadline,
              std::function<void(absl::StatusOr<StepNorm>)> done);
  /// Drops the rounds of `step` and later (shard 0 rolled back to `step`):
  /// their waiting reports end with Aborted, and the rounds start afresh.
  void ForgetFrom(int64_t step);
  /// The shards whose partial for `step` has not come, while its round is
  /// open (empty once it completed, or before anyone reported).
  std::vector<int> Missing(int64_t step);

 private:
  struct Round {
    std::vector<std::optional<StepNorm>> partials;
    std::vector<std::shared_ptr<OneShotWaiter>> waiters;
    std::optional<StepNorm> total;
  };
  static StepNorm Sum(const Round& round);
  static std::vector<int> MissingFrom(const Round& round);

  const int num_shards_;
  absl::Mutex mu_;
  std::map<int64_t, Round> rounds_ ABSL_GUARDED_BY(mu_);
  DeadlineTimer timer_;
};

}  // namespace pshard

#endif  // PSHARD_SHARD_SERVER_NORM_COORDINATOR_H_
