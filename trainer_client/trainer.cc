#include "trainer_client/trainer.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/optimizer.h"
#include "common/status_macros.h"
#include "trainer_client/busy_clock.h"

namespace pshard {
namespace {

// Fetches the units of one step in schedule order, keeping `depth` fetches
// ahead of the one being consumed.
class Prefetcher {
 public:
  Prefetcher(ShardClient* client, std::vector<int> schedule, int64_t version, int depth)
      : client_(client), schedule_(std::move(schedule)), version_(version), depth_(depth),
        transfers_(schedule_.size()) {}

  /// Waits for the unit at schedule position `i`; the wait is exposed time.
  absl::StatusOr<std::shared_ptr<UnitTransfer>> Get(size_t i, absl::Duration* exposed) {
    // Issuing fetches is communication work done on this thread: exposed.
    const absl::Time wait_start = absl::Now();
    const size_t last = std::min(schedule_.size() - 1, i + static_cast<size_t>(depth_));
    for (; started_ <= last; ++started_) {
      transfers_[started_] = client_->StartFetch(schedule_[started_], version_);
    }
    std::shared_ptr<UnitTransfer> t = std::move(transfers_[i]);
    absl::Status s = t->Wait();
    *exposed += absl::Now() - wait_start;
    busy_.Add(t->started(), t->finished());
    latencies_.push_back(t->finished() - t->started());
    bytes_ += t->wire_bytes();
    if (!s.ok()) return s;
    return t;
  }

  /// Waits for fetches that were started but not consumed (on error paths).
  void Drain() {
    for (auto& t : transfers_) {
      if (t) t->Wait().IgnoreError();
    }
  }

  IntervalUnion& busy() { return busy_; }
  std::vector<absl::Duration>& latencies() { return latencies_; }
  int64_t bytes() const { return bytes_; }

 private:
  ShardClient* const client_;
  const std::vector<int> schedule_;
  const int64_t version_;
  const int depth_;
  std::vector<std::shared_ptr<UnitTransfer>> transfers_;
  size_t started_ = 0;
  IntervalUnion busy_;
  std::vector<absl::Duration> latencies_;
  int64_t bytes_ = 0;
};

}  // namespace

Trainer::Trainer(ShardClient* client, const TokenDataset* data, TrainerOptions options,
                 CpuGpt<float> model)
    : client_(client), data_(data), options_(options), model_(std::move(model)) {
  tokens_.resize(static_cast<size_t>(options.batch) * options.seq_len);
  targets_.resize(tokens_.size());
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(ShardClient* client, const TokenDataset* data,
                                                         TrainerOptions options) {
  if (options.prefetch_depth < 0) {
    return absl::InvalidArgumentError(absl::StrCat("prefetch depth ", options.prefetch_depth, " < 0"));
  }
  if (options.seq_len > client->job().model.context) {
    return absl::InvalidArgumentError(absl::StrCat("sequence length ", options.seq_len,
                                                   " exceeds the model context ", client->job().model.context));
  }
  ASSIGN_OR_RETURN(CpuGpt<float> model, CpuGpt<float>::Create(client->layout().spec, options.batch, options.seq_len));
  return std::unique_ptr<Trainer>(new Trainer(client, data, options, std::move(model)));
}

absl::StatusOr<StepReport> Trainer::RunStep(int64_t step) {
  const absl::Time step_start = absl::Now();
  StepReport report;
  report.step = step;
  StepTimes& times = report.times;

  absl::Time t0 = absl::Now();
  RETURN_IF_ERROR(data_->SampleBatch(options_.data_seed, step, rank(), /*micro=*/0, options_.batch,
                                     options_.seq_len, tokens_, targets_));
  RETURN_IF_ERROR(model_.SetBatch(tokens_, targets_));
  times.data = absl::Now() - t0;

  // Forward 0..K-1, then backward K-2..0: the last unit stays from forward.
  const int k = model_.num_units();
  std::vector<int> schedule;
  for (int u = 0; u < k; ++u) schedule.push_back(u);
  for (int u = k - 2; u >= 0; --u) schedule.push_back(u);
  Prefetcher prefetch(client_, schedule, step, options_.prefetch_depth);

  std::shared_ptr<UnitTransfer> last_unit;
  size_t position = 0;
  for (int u = 0; u < k; ++u, ++position) {
    absl::StatusOr<std::shared_ptr<UnitTransfer>> w = prefetch.Get(position, &times.comm_exposed);
    if (!w.ok()) {
      prefetch.Drain();
      return w.status();
    }
    t0 = absl::Now();
    model_.ForwardUnit(u, (*w)->values());
    times.compute += absl::Now() - t0;
    if (u == k - 1) last_unit = *w;
  }
  report.loss = model_.loss();

  std::vector<std::shared_ptr<UnitTransfer>> pushes;
  double grad_sum_of_squares = 0.0;
  for (int u = k - 1; u >= 0; --u) {
    std::shared_ptr<UnitTransfer> w = last_unit;
    if (u != k - 1) {
      absl::StatusOr<std::shared_ptr<UnitTransfer>> fetched = prefetch.Get(position++, &times.comm_exposed);
      if (!fetched.ok()) {
        prefetch.Drain();
        for (auto& p : pushes) p->Wait().IgnoreError();
        return fetched.status();
      }
      w = *fetched;
    }
    std::vector<float> grads(client_->layout().partitions[u].padded_numel(), 0.0f);
    t0 = absl::Now();
    model_.BackwardUnit(u, w->values(), grads);
    times.compute += absl::Now() - t0;
    grad_sum_of_squares += SumOfSquares(grads);
    w.reset();  // drop the weights as soon as they are used
    if (u == k - 1) last_unit.reset();
    t0 = absl::Now();
    pushes.push_back(client_->StartPush(u, step, std::move(grads)));
    times.comm_exposed += absl::Now() - t0;
  }

  absl::Status push_status;
  t0 = absl::Now();
  for (auto& p : pushes) {
    absl::Status s = p->Wait();
    if (push_status.ok()) push_status = s;
  }
  times.comm_exposed += absl::Now() - t0;
  RETURN_IF_ERROR(push_status);

  for (auto& p : pushes) {
    prefetch.busy().Add(p->started(), p->finished());
    report.bytes_pushed += p->wire_bytes();
    report.push_latencies.push_back(p->finished() - p->started());
  }
  report.fetch_latencies = std::move(prefetch.latencies());
  report.grad_norm = std::sqrt(grad_sum_of_squares);
  report.flops = model_.FlopsPerMicroBatch();
  report.bytes_fetched = prefetch.bytes();
  report.tokens = static_cast<int64_t>(tokens_.size());
  times.wall = absl::Now() - step_start;
  times.comm_busy = prefetch.busy().Total();
  times.other = times.wall - times.compute - times.comm_exposed - times.data;
  return report;
}

}  // namespace pshard
