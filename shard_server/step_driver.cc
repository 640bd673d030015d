#include "shard_server/step_driver.h"

#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"

namespace pshard {
namespace {
// How often a waiting driver checks whether it should stop.
constexpr absl::Duration kPollInterval = absl::Milliseconds(100);
// Longest single attempt at the norm agreement.
constexpr absl::Duration kAgreeRound = absl::Seconds(1);
}  // namespace

StepDriver::StepDriver(ShardState* state, AgreeFn agree, absl::Duration step_timeout, ServerMetrics* metrics,
                       AfterStepFn after_step)
    : state_(state),
      agree_(std::move(agree)),
      step_timeout_(step_timeout),
      metrics_(metrics),
      after_step_(std::move(after_step)),
      thread_([this] { Run(); }) {}

StepDriver::~StepDriver() {
  stop_.Notify();
  thread_.join();
}

void StepDriver::Run() {
  while (!stop_.HasBeenNotified()) {
    // Wait for the step's contributions, complaining every step_timeout.
    const absl::Time wait_start = absl::Now();
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
    const absl::Time agree_start = absl::Now();
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
      std::fprintf(stderr, "pshard-server: shard %d, step %lld: non-finite gradient (%s); update skipped\n",
                   state_->shard_index(), static_cast<long long>(step),
                   partial.non_finite ? partial.non_finite_source.c_str() : "seen by another shard");
    }
    const absl::Time update_start = absl::Now();
    const StepOutcome outcome = state_->ApplyStep(*agreed);
    Record(outcome, agree_start - wait_start, update_start - agree_start, absl::Now() - update_start);
    if (after_step_) after_step_(outcome);
  }
}

void StepDriver::Record(const StepOutcome& outcome, absl::Duration contributions, absl::Duration agreement,
                        absl::Duration update) {
  if (metrics_ == nullptr) return;
  metrics_->wait_contributions_seconds.Increment(absl::ToDoubleSeconds(contributions));
  metrics_->wait_norm_seconds.Increment(absl::ToDoubleSeconds(agreement));
  metrics_->optimizer_step_seconds.Observe(absl::ToDoubleSeconds(update));
  metrics_->step.Set(static_cast<double>(outcome.step + 1));
  for (metrics::Gauge* v : metrics_->unit_version) v->Set(static_cast<double>(outcome.step + 1));
  metrics_->grad_norm.Set(outcome.grad_norm);
  metrics_->state_published_bytes.Set(static_cast<double>(state_->counters().published_bytes));
  if (outcome.skipped) {
    metrics_->skipped_steps.Increment();
    return;
  }
  metrics_->applied_updates.Increment();
  metrics_->learning_rate.Set(outcome.learning_rate);
  if (outcome.weight_sum_of_squares > 0) {
    metrics_->update_weight_ratio.Set(std::sqrt(outcome.update_sum_of_squares / outcome.weight_sum_of_squares));
  }
}

}  // namespace pshard
