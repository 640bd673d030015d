#include "tests/testutil/async_cpu_model.h"

#include <algorithm>
#include <deque>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"

namespace pshard::testing {
namespace {

class AsyncCpuModel final : public UnitModel {
 public:
  AsyncCpuModel(std::unique_ptr<UnitModel> inner, const ModelSpec& spec, absl::Duration min_unit_time)
      : inner_(std::move(inner)), min_unit_time_(min_unit_time), worker_([this] { Work(); }) {
    for (const UnitSpec& unit : spec.units) unit_numel_.push_back(unit.numel);
  }
  ~AsyncCpuModel() override {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    worker_.join();
  }

  absl::Status SetBatch(int lane, std::span<const int32_t> tokens, std::span<const int32_t> targets) override {
    RETURN_IF_ERROR(Drain());
    return inner_->SetBatch(lane, tokens, targets);
  }
  absl::Status ForwardUnit(int unit, std::span<const float> weights) override {
    if (unit < 0 || unit >= num_units()) return absl::InvalidArgumentError("unknown unit");
    // The caller may release its weights on return: the job owns a copy.
    Enqueue([this, unit, w = std::vector<float>(weights.begin(), weights.end())] {
      return Stretch([&] { return inner_->ForwardUnit(unit, w); });
    });
    return absl::OkStatus();
  }
  absl::Status BackwardUnit(int unit, std::span<const float> weights, std::span<float> grads) override {
    if (unit < 0 || unit >= num_units()) return absl::InvalidArgumentError("unknown unit");
    RETURN_IF_ERROR(pending_.Start(unit));
    auto result = std::make_shared<std::vector<float>>(unit_numel_[unit]);
    const uint64_t job = Enqueue([this, unit, result, w = std::vector<float>(weights.begin(), weights.end())] {
      return Stretch([&]() -> absl::Status {
        RETURN_IF_ERROR(inner_->BackwardUnit(unit, w, *result));
        return inner_->FinishBackward(unit);
      });
    });
    results_.push_back({result, grads.first(unit_numel_[unit]), job});
    return absl::OkStatus();
  }
  absl::Status FinishBackward(int unit) override {
    RETURN_IF_ERROR(pending_.Finish(unit));
    // Waits for this backward only; later work keeps running.
    RETURN_IF_ERROR(WaitFor(results_.front().job));
    const Result done = std::move(results_.front());
    results_.pop_front();
    std::copy(done.values->begin(), done.values->end(), done.destination.begin());
    return absl::OkStatus();
  }
  absl::StatusOr<double> Loss(int lane) override {
    RETURN_IF_ERROR(Drain());
    return inner_->Loss(lane);
  }
  absl::StatusOr<ModelTimeline> TakeTimeline() override {
    RETURN_IF_ERROR(Drain());
    RETURN_IF_ERROR(inner_->TakeTimeline().status());  // its own calls only; ours include the stretch
    absl::MutexLock lock(&mu_);
    return std::exchange(timeline_, {});
  }
  int num_units() const override { return inner_->num_units(); }
  int lanes() const override { return inner_->lanes(); }
  ModelMemory Memory() const override { return inner_->Memory(); }
  double FlopsPerMicroBatch() const override { return inner_->FlopsPerMicroBatch(); }
  std::string DeviceName() const override { return "cpu (asynchronous)"; }
  bool asynchronous() const override { return true; }

 private:
  struct Result {
    std::shared_ptr<std::vector<float>> values;
    std::span<float> destination;
    uint64_t job;  // the queued job that computes it
  };

  absl::Status Stretch(const std::function<absl::Status()>& work) {
    const absl::Time start = absl::Now();
    absl::Status status = work();
    absl::SleepFor(min_unit_time_ - (absl::Now() - start));
    return status;
  }
  // Queues `job`; returns its number (1-based, in queue order).
  uint64_t Enqueue(std::function<absl::Status()> job) {
    absl::MutexLock lock(&mu_);
    queue_.push_back(std::move(job));
    return ++queued_;
  }
  // Waits until job number `job` has run; the first error of any job.
  absl::Status WaitFor(uint64_t job) {
    std::pair<AsyncCpuModel*, uint64_t> arg(this, job);
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](std::pair<AsyncCpuModel*, uint64_t>* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return a->first->done_ >= a->second;
        },
        &arg));
    return error_;
  }
  absl::Status Drain() {
    uint64_t last;
    {
      absl::MutexLock lock(&mu_);
      last = queued_;
    }
    return WaitFor(last);
  }
  void Work() {
    while (true) {
      std::function<absl::Status()> job;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](AsyncCpuModel* self) ABSL_NO_THREAD_SAFETY_ANALYSIS {
              return self->stopping_ || !self->queue_.empty();
            },
            this));
        if (queue_.empty()) return;  // stopping, nothing left
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      const absl::Time start = absl::Now();
      absl::Status status = job();
      absl::MutexLock lock(&mu_);
      timeline_.compute.emplace_back(start, absl::Now());
      if (error_.ok()) error_ = status;
      ++done_;
    }
  }

  std::unique_ptr<UnitModel> inner_;
  const absl::Duration min_unit_time_;
  std::vector<int64_t> unit_numel_;
  PendingBackwards pending_;
  std::deque<Result> results_;  // caller's thread only
  absl::Mutex mu_;
  std::deque<std::function<absl::Status()>> queue_ ABSL_GUARDED_BY(mu_);
  uint64_t queued_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t done_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  ModelTimeline timeline_ ABSL_GUARDED_BY(mu_);  // every job, start to end
  std::thread worker_;  // last: starts after everything above exists
};

}  // namespace

absl::StatusOr<std::unique_ptr<UnitModel>> MakeAsyncCpuModel(const ModelSpec& spec, const UnitModelOptions& options,
                                                             absl::Duration min_unit_time) {
  if (options.device != "cpu") return absl::InvalidArgumentError("the asynchronous CPU model runs on the cpu only");
  ASSIGN_OR_RETURN(std::unique_ptr<UnitModel> inner, CreateUnitModel(spec, options));
  return std::unique_ptr<UnitModel>(new AsyncCpuModel(std::move(inner), spec, min_unit_time));
}

}  // namespace pshard::testing
