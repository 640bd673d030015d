#include "common/deadline_timer.h"

namespace pshard {

DeadlineTimer::DeadlineTimer() : thread_([this] { Run(); }) {}

DeadlineTimer::~DeadlineTimer() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void DeadlineTimer::Schedule(absl::Time deadline, std::function<void()> callback) {
  absl::MutexLock lock(&mu_);
  pending_.emplace(deadline, std::move(callback));
}

bool DeadlineTimer::ShouldWake() const { return stopping_ || pending_.size() != seen_; }

void DeadlineTimer::Run() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    const absl::Time next = pending_.empty() ? absl::InfiniteFuture() : pending_.begin()->first;
    const absl::Time wake = std::min(next, absl::Now() + absl::Milliseconds(200));
    // Wakes early when something is scheduled or on shutdown.
    seen_ = pending_.size();
    mu_.AwaitWithDeadline(absl::Condition(this, &DeadlineTimer::ShouldWake), wake);
    while (!pending_.empty() && pending_.begin()->first <= absl::Now()) {
      std::function<void()> fn = std::move(pending_.begin()->second);
      pending_.erase(pending_.begin());
      mu_.Unlock();
      fn();
      mu_.Lock();
    }
  }
}

}  // namespace pshard
