#include "shard_server/step_driver.h"

#include <cstdio>

#include "absl/strings/str_cat.h"

namespace pshard {
namespace {
// How often a waiting driver checks whether it should stop.
constexpr absl::Duration kPollInterval = absl::Milliseconds(100);
// Longest single attempt at the norm agreement.
constexpr absl::Duration kAgreeRound = absl::Seconds(1);
}  // namespace

StepDriver::StepDriver(ShardState* state, AgreeFn agree, absl::Duration step_timeout)
    : state_(state), agree_(std::move(agree)), step_timeout_(step_timeout), thread_([this] { Run(); }) {}

StepDriver::~StepDriver() {
  stop_.Notify();
  thread_.join();
}

void StepDriver::Run() {
  while (!stop_.HasBeenNotified()) {
    // Wait for the step's contributions, complaining every step_timeout.
    absl::Time complain_at = absl::Now() + step_timeout_;
    bool complete = false;
    while (!stop_.HasBeenNotified()) {
      absl::Status s = state_->AwaitContributions(absl::Now() + kPollInterval);
      if (s.ok()) {
        complete = true;
        break;
      }
      if (absl::Now() >= complain_at) {
        std::fprintf(stderr, "pshard-server: still waiting: %s\n", std::string(s.message()).c_str());
        complain_at = absl::Now() + step_timeout_;
      }
    }
    if (!complete) return;
    const int64_t step = state_->current_step();
    const StepNorm partial = state_->FinishReduction();
    absl::StatusOr<StepNorm> agreed;
    complain_at = absl::Now() + step_timeout_;
    while (!stop_.HasBeenNotified()) {
      // Short rounds so that a stopping server is never stuck in a wait.
      agreed = agree_(step, partial, absl::Now() + kAgreeRound);
      if (agreed.ok()) break;
      if (absl::Now() >= complain_at) {
        std::fprintf(stderr, "pshard-server: shard %d, step %lld: still no norm agreement: %s\n",
                     state_->shard_index(), static_cast<long long>(step),
                     std::string(agreed.status().message()).c_str());
        complain_at = absl::Now() + step_timeout_;
      }
      if (!absl::IsDeadlineExceeded(agreed.status())) absl::SleepFor(kPollInterval);
    }
    if (!agreed.ok()) return;
    if (agreed->non_finite) {
      std::fprintf(stderr, "pshard-server: shard %d, step %lld: non-finite gradient; update skipped\n",
                   state_->shard_index(), static_cast<long long>(step));
    }
    state_->ApplyStep(*agreed);
  }
}

}  // namespace pshard
