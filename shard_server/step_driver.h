// The thread that closes each step: waits for every contribution, agrees on
// the global gradient norm with the other shards, applies AdamW, publishes.
#ifndef PSHARD_SHARD_SERVER_STEP_DRIVER_H_
#define PSHARD_SHARD_SERVER_STEP_DRIVER_H_

#include <functional>
#include <map>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "shard_server/server_metrics.h"
#include "shard_server/shard_state.h"

namespace pshard {

class StepDriver {
 public:
  /// Returns the job-wide norm for `step` given this shard's partial, by
  /// `deadline`. Called from the driver thread only.
  using AgreeFn = std::function<absl::StatusOr<StepNorm>(int64_t step, const StepNorm& partial,
                                                         absl::Time deadline)>;
  /// Runs on the driver thread after each step is applied and published,
  /// before the next one closes (checkpoints are written here).
  using AfterStepFn = std::function<void(const StepOutcome& outcome)>;

  /// Starts the thread. `state` must outlive the driver. `step_timeout` is
  /// how long a step may wait for contributions or for the norm before the
  /// driver logs what it is missing (it then keeps waiting).
  /// `metrics` and `after_step` may be null.
  StepDriver(ShardState* state, AgreeFn agree, absl::Duration step_timeout, ServerMetrics* metrics,
             AfterStepFn after_step = nullptr);
  /// Stops the thread (between waits; an agreement in progress is abandoned).
  ~StepDriver();

 private:
  void Run();
  // Logs a slow step and counts, per trainer, the time it was missing.
  void ReportMissing(int64_t step, absl::Duration waited, const std::map<int, absl::Duration>& missing);
  void Record(const StepOutcome& outcome, absl::Duration contributions, absl::Duration agreement,
              absl::Duration update);

  ShardState* const state_;
  const AgreeFn agree_;
  const absl::Duration step_timeout_;
  ServerMetrics* const metrics_;
  const AfterStepFn after_step_;
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace pshard

#endif  // PSHARD_SHARD_SERVER_STEP_DRIVER_H_
