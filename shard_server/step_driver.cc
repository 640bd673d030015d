#include "shard_server/step_driver.h"

#include <cmath>
#include <cstdio>

#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace pshard {
namespace {
// How often a waiting driver checks whether it should stop.
constexpr absl::Duration kPollInterval = absl::Milliseconds(100);
// Longest single attempt at the norm agreement.
constexpr absl::Duration kAgreeRound = absl::Seconds(1);
// A step that waits longer than this for its gradients is reported, with
// the time each missing trainer held it up.
constexpr absl::Duration kSlowStep = absl::Seconds(1);
}  // namespace

StepDriver::StepDriver(ShardState* state, AgreeFn agree, absl::Duration step_timeout, ServerMetrics* metrics,
                       AfterStepFn after_step)
    : state_(state),
      agree_(std::move(agree)),
      step_timeout_(step_timeout),
      metrics_(metrics),
      after_step_(std::move(after_step)),
      thread_([this] { Run(); }) {}

void StepDriver::ReportMissing(int64_t step, absl::Duration waited, const std::map<int, absl::Duration>& missing) {
  std::vector<std::string> parts;
  for (const auto& [trainer, d] : missing) {
    parts.push_back(absl::StrFormat("trainer %d %.1f s", trainer, absl::ToDoubleSeconds(d)));
    metrics_->missing_trainer_seconds(trainer).Increment(absl::ToDoubleSeconds(d));
  }
  std::fprintf(stderr, "pshard-server: shard %d, step %lld waited %.1f s for its gradients: missing %s\n",
               state_->shard_index(), static_cast<long long>(step), absl::ToDoubleSeconds(waited),
               absl::StrJoin(parts, ", ").c_str());
}

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
    // Once the step is slow: how long each trainer was missing (the wait
    // before that is counted against those missing when it became slow).
    std::map<int, absl::Duration> missing_for;
    absl::Time counted_until = wait_start;
    while (!stop_.HasBeenNotified()) {
      absl::Status s = state_->AwaitContributions(absl::Now() + kPollInterval);
      if (const absl::Time now = absl::Now(); now - wait_start > kSlowStep) {
        for (int t : state_->MissingTrainers()) missing_for[t] += now - counted_until;
        counted_until = now;
      }
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
    if (!missing_for.empty()) ReportMissing(step, agree_start - wait_start, missing_for);
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
