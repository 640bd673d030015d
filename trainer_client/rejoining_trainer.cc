#include "trainer_client/rejoining_trainer.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "proto/rpc_util.h"

namespace pshard {

RejoiningTrainer::RejoiningTrainer(Options options, const TokenDataset* data, std::unique_ptr<ShardClient> client,
                                   std::unique_ptr<Trainer> trainer)
    : options_(std::move(options)),
      data_(data),
      fingerprint_(JobFingerprint(client->job())),
      client_(std::move(client)),
      trainer_(std::move(trainer)),
      next_step_(client_->joined_step()) {}

void RejoiningTrainer::Log(const std::string& line) const {
  const std::string text = absl::StrCat("pshard-trainer ", options_.client.trainer_rank, ": ", line);
  if (options_.log) {
    options_.log(text);
  } else {
    std::fprintf(stderr, "%s\n", text.c_str());
  }
}

absl::StatusOr<StepReport> RejoiningTrainer::Step() {
  const absl::Time outage_start = absl::Now();
  while (true) {
    absl::StatusOr<StepReport> report = trainer_->RunStep(next_step_);
    if (report.ok()) {
      ++next_step_;
      return report;
    }
    const bool stopping = options_.stopping && options_.stopping();
    if (options_.retry_limit <= absl::ZeroDuration() || !IsRecoverableFailure(report.status()) || stopping) {
      return report.status();
    }
    const absl::Time give_up = outage_start + options_.retry_limit;
    Log(absl::StrCat("step ", next_step_, " failed: ", report.status().ToString(), "; rejoining the servers (for at most ",
                     absl::FormatDuration(absl::Trunc(give_up - absl::Now(), absl::Seconds(1))), " more)"));
    ASSIGN_OR_RETURN(const int64_t resumed, Rejoin(report.status(), give_up));
    ++rejoins_;
    Log(absl::StrCat("rejoined (", rejoins_, " so far); resuming at step ", resumed,
                     resumed < next_step_ ? absl::StrCat(" (redoing ", next_step_ - resumed, " steps)") : ""));
    next_step_ = resumed;
  }
}

absl::StatusOr<int64_t> RejoiningTrainer::Rejoin(const absl::Status& failure, absl::Time give_up) {
  absl::Status last = failure;
  trainer_.reset();
  // Rejoining retires these sessions on their servers (they do not hold
  // places of this rank while the new ones are made).
  if (client_) previous_sessions_ = client_->sessions();
  client_.reset();  // cancels and drains its transfers
  for (absl::Duration backoff = absl::Milliseconds(100);; backoff = std::min(2 * backoff, absl::Seconds(5))) {
    if (options_.stopping && options_.stopping()) return absl::CancelledError("stopped while rejoining");
    if (absl::Now() >= give_up) {
      return absl::DeadlineExceededError(absl::StrCat("the servers did not take this trainer back within ",
                                                      absl::FormatDuration(options_.retry_limit),
                                                      " (--server_retry_limit); last: ", last.message()));
    }
    absl::SleepFor(std::min(backoff, give_up - absl::Now()));
    ShardClient::Options again = options_.client;
    again.roll_back_to_common_step = true;
    again.previous_sessions = previous_sessions_;
    again.join_timeout = std::max(absl::Seconds(1), give_up - absl::Now());
    absl::StatusOr<std::unique_ptr<ShardClient>> joined = ShardClient::Connect(again);
    if (!joined.ok()) {
      if (!IsRecoverableFailure(joined.status())) return joined.status();
      last = joined.status();
      continue;
    }
    if (JobFingerprint((*joined)->job()) != fingerprint_) {
      return absl::FailedPreconditionError("the servers now run a different job from the one this trainer joined");
    }
    ASSIGN_OR_RETURN(trainer_, Trainer::Create(joined->get(), data_, options_.trainer));
    client_ = std::move(*joined);
    return client_->joined_step();
  }
}

}  // namespace pshard
