// A thread of its own that runs posted work in order: for work that must not
// hold up the thread that found it (e.g. verifying a received slice on the
// thread that drives a transport).
#ifndef PSHARD_COMMON_SERIAL_EXECUTOR_H_
#define PSHARD_COMMON_SERIAL_EXECUTOR_H_

#include <deque>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace pshard {

/// Runs each posted callback once, in posting order, on its own thread.
/// Thread-safe. The destructor runs what is still queued, then joins.
class SerialExecutor {
 public:
  SerialExecutor();
  ~SerialExecutor();
  SerialExecutor(const SerialExecutor&) = delete;
  SerialExecutor& operator=(const SerialExecutor&) = delete;

  void Post(std::function<void()> work);

 private:
  void Run();

  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace pshard

#endif  // PSHARD_COMMON_SERIAL_EXECUTOR_H_
