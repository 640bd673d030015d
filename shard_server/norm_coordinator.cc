#include "shard_server/norm_coordinator.h"

#include <algorithm>
#include <iterator>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace pshard {

StepNorm NormCoordinator::Sum(const Round& round) {
  StepNorm total;
  total.checkpoint_steps = round.partials.front()->checkpoint_steps;
  for (const auto& p : round.partials) {
    total.sum_of_squares.Add(p->sum_of_squares);
    total.non_finite = total.non_finite || p->non_finite;
    std::vector<int64_t> common;
    std::set_intersection(total.checkpoint_steps.begin(), total.checkpoint_steps.end(),
                          p->checkpoint_steps.begin(), p->checkpoint_steps.end(), std::back_inserter(common));
    total.checkpoint_steps = std::move(common);
  }
  return total;
}

std::vector<int> NormCoordinator::MissingFrom(const Round& round) {
  std::vector<int> shards;
  if (round.total) return shards;
  for (int s = 0; s < static_cast<int>(round.partials.size()); ++s) {
    if (!round.partials[s]) shards.push_back(s);
  }
  return shards;
}

std::vector<int> NormCoordinator::Missing(int64_t step) {
  absl::MutexLock lock(&mu_);
  auto it = rounds_.find(step);
  return it == rounds_.end() ? std::vector<int>() : MissingFrom(it->second);
}

void NormCoordinator::Report(int64_t step, int shard, const StepNorm& partial, absl::Time deadline,
                             std::function<void(absl::StatusOr<StepNorm>)> done) {
  auto waiter = std::make_shared<OneShotWaiter>([done = std::move(done), this, step](absl::Status s) {
    if (!s.ok()) return done(s);
    std::optional<StepNorm> total;
    {
      absl::MutexLock lock(&mu_);
      auto it = rounds_.find(step);
      if (it != rounds_.end()) total = it->second.total;
    }
    if (!total) return done(absl::InternalError(absl::StrCat("step ", step, ": norm round forgotten")));
    done(*total);  // outside the lock: `done` finishes RPCs
  });
  std::vector<std::shared_ptr<OneShotWaiter>> ready;
  {
    absl::MutexLock lock(&mu_);
    Round& round = rounds_[step];
    if (round.partials.empty()) round.partials.resize(num_shards_);
    if (!round.total) round.partials[shard] = partial;
    round.waiters.push_back(waiter);
    const bool complete = std::all_of(round.partials.begin(), round.partials.end(),
                                      [](const auto& p) { return p.has_value(); });
    if (complete) {
      if (!round.total) round.total = Sum(round);
      ready.swap(round.waiters);
      while (!rounds_.empty() && rounds_.begin()->first < step - kRoundsKept) rounds_.erase(rounds_.begin());
    } else {
      timer_.Schedule(deadline, [this, step, waiter] {
        std::string missing = "(forgotten: later steps have completed)";
        {
          absl::MutexLock lock(&mu_);
          auto it = rounds_.find(step);
          // A completed round answered its waiters already; one dropped
          // unfinished (older than kRoundsKept completed steps) has not.
          if (it != rounds_.end()) {
            if (it->second.total) return;  // completed meanwhile
            missing = absl::StrJoin(MissingFrom(it->second), ",");
          }
        }
        waiter->Fire(absl::DeadlineExceededError(absl::StrCat(
            "step ", step, ": no gradient norm from shard(s) ", missing, " before the deadline")));
      });
    }
  }
  for (auto& w : ready) w->Fire(absl::OkStatus());
}

void NormCoordinator::ForgetFrom(int64_t step) {
  std::vector<std::shared_ptr<OneShotWaiter>> dropped;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = rounds_.lower_bound(step); it != rounds_.end(); it = rounds_.erase(it)) {
      for (auto& w : it->second.waiters) dropped.push_back(std::move(w));
    }
  }
  for (auto& w : dropped) {
    w->Fire(absl::AbortedError(absl::StrCat("the coordinator (shard 0) rolled back to step ", step,
                                            ": its norm rounds from there on start again")));
  }
}

}  // namespace pshard
