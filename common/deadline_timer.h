// A single thread that runs callbacks at deadlines. Used to bound every wait
// that is not a blocking call (e.g. a streaming RPC waiting for a version).
#ifndef PSHARD_COMMON_DEADLINE_TIMER_H_
#define PSHARD_COMMON_DEADLINE_TIMER_H_

#include <functional>
#include <map>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pshard {

/// Runs each scheduled callback once, on the timer's own thread, at or soon
/// after its deadline. Callbacks must not block. Thread-safe. The destructor
/// drops callbacks that have not run yet.
class DeadlineTimer {
 public:
  DeadlineTimer();
  ~DeadlineTimer();
  DeadlineTimer(const DeadlineTimer&) = delete;
  DeadlineTimer& operator=(const DeadlineTimer&) = delete;

  void Schedule(absl::Time deadline, std::function<void()> callback);

 private:
  void Run();
  bool ShouldWake() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  std::multimap<absl::Time, std::function<void()>> pending_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  size_t seen_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace pshard

#endif  // PSHARD_COMMON_DEADLINE_TIMER_H_
