#include "common/parallel_for.h"

#include <algorithm>

namespace pshard {

ParallelFor::ParallelFor(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ParallelFor::~ParallelFor() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : workers_) t.join();
}

void ParallelFor::Run(int64_t n, int64_t grain, absl::FunctionRef<void(int64_t, int64_t)> fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t chunk = std::max(grain, (n + threads() - 1) / threads());
  if (workers_.empty() || chunk >= n) {
    fn(0, n);
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    fn_ = &fn;
    n_ = n;
    chunk_ = chunk;
    chunks_ = (n + chunk - 1) / chunk;
    next_chunk_ = 0;
  }
  RunChunks();
  // Every chunk is handed out; wait for the workers still running theirs.
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(this, &ParallelFor::NoWorkerBusy));
  fn_ = nullptr;
}

bool ParallelFor::NoWorkerBusy() const { return busy_workers_ == 0; }

void ParallelFor::RunChunks() {
  while (true) {
    int64_t begin, end;
    const absl::FunctionRef<void(int64_t, int64_t)>* fn;
    {
      absl::MutexLock lock(&mu_);
      if (fn_ == nullptr || next_chunk_ >= chunks_) return;
      const int64_t i = next_chunk_++;
      begin = i * chunk_;
      end = std::min(n_, begin + chunk_);
      fn = fn_;
    }
    (*fn)(begin, end);
  }
}

void ParallelFor::WorkerLoop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      // Sleeps between jobs: a job whose chunks are all handed out does not
      // wake anyone.
      mu_.Await(absl::Condition(this, &ParallelFor::HasWorkOrStopping));
      if (stopping_) return;
      ++busy_workers_;
    }
    RunChunks();
    absl::MutexLock lock(&mu_);
    --busy_workers_;
  }
}

bool ParallelFor::HasWorkOrStopping() const { return stopping_ || (fn_ != nullptr && next_chunk_ < chunks_); }

}  // namespace pshard
