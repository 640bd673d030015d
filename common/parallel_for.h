// A fixed set of threads that split a loop over [0, n) between them and the
// caller: the host-side copies and bf16 rounding of whole units, which one
// core does at a fraction of the memory bandwidth.
#ifndef PSHARD_COMMON_PARALLEL_FOR_H_
#define PSHARD_COMMON_PARALLEL_FOR_H_

#include <cstdint>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"

namespace pshard {

/// Thread-compatible: one Run at a time (Run is not reentrant).
class ParallelFor {
 public:
  /// `threads` >= 1 counts the caller: threads - 1 workers are started.
  explicit ParallelFor(int threads);
  ~ParallelFor();  ///< stops and joins the workers
  ParallelFor(const ParallelFor&) = delete;
  ParallelFor& operator=(const ParallelFor&) = delete;

  /// Calls fn(begin, end) on disjoint ranges that cover [0, n), each of at
  /// least `grain` elements (but the last), on the workers and the calling
  /// thread; returns when every call has returned.
  void Run(int64_t n, int64_t grain, absl::FunctionRef<void(int64_t, int64_t)> fn);

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

 private:
  void WorkerLoop();
  // Runs chunks of the current job until none are left.
  void RunChunks();
  bool HasWorkOrStopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool NoWorkerBusy() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::vector<std::thread> workers_;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int busy_workers_ ABSL_GUARDED_BY(mu_) = 0;     // workers inside the current job
  // The current job: chunk i covers [i * chunk_, min(n_, (i + 1) * chunk_)).
  const absl::FunctionRef<void(int64_t, int64_t)>* fn_ ABSL_GUARDED_BY(mu_) = nullptr;
  int64_t n_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t chunk_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t next_chunk_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t chunks_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pshard

#endif  // PSHARD_COMMON_PARALLEL_FOR_H_
