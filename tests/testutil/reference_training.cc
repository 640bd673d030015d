#include "tests/testutil/reference_training.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/reduction_tree.h"
#include "common/square_sum.h"
#include "common/status_macros.h"
#include "common/optimizer.h"

namespace pshard::testing {

ReferenceTraining::ReferenceTraining(JobConfig job, JobLayout layout, WireEncodings encoding,
                                     TrainerOptions trainer, const TokenDataset* data,
                                     std::unique_ptr<UnitModel> model, bool error_feedback, int group_size)
    : job_(std::move(job)), layout_(std::move(layout)), encoding_(encoding), trainer_(trainer),
      data_(data), model_(std::move(model)), error_feedback_(error_feedback && encoding.grad_format().quantized()),
      group_size_(group_size) {
  for (size_t u = 0; u < layout_.spec.units.size(); ++u) {
    const int64_t padded = layout_.partitions[u].padded_numel();
    std::vector<float> w(padded);
    InitializeUnitRange(layout_.spec.units[u], job_.seed, 0, w);
    master_.push_back(std::move(w));
    m_.emplace_back(padded, 0.0f);
    v_.emplace_back(padded, 0.0f);
  }
  residual_.assign(job_.num_trainers, std::vector<std::vector<float>>());
  for (auto& per_unit : residual_) {
    for (const auto& w : master_) per_unit.emplace_back(w.size(), 0.0f);
  }
}

void ReferenceTraining::RoundTripBySlice(const WireFormat& format, size_t unit, std::vector<float>& values) const {
  for (int s = 0; s < job_.num_shards; ++s) {
    const SliceRange slice = layout_.partitions[unit].Slice(s);
    RoundTripInPlace(format, std::span<float>(values.data() + slice.begin, slice.length));
  }
}

absl::StatusOr<ReferenceTraining> ReferenceTraining::Create(const JobConfig& job, WireEncodings encoding,
                                                            const TrainerOptions& trainer,
                                                            const TokenDataset* data, bool error_feedback,
                                                            int group_size, const UnitModelFactory& model_factory) {
  if (group_size < 1 || job.num_trainers % group_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("group size ", group_size, " does not divide ", job.num_trainers));
  }
  ASSIGN_OR_RETURN(JobLayout layout, MakeJobLayout(job));
  UnitModelOptions options;
  options.batch = trainer.batch;
  options.seq_len = trainer.seq_len;
  options.device = "cpu";
  ASSIGN_OR_RETURN(std::unique_ptr<UnitModel> model, model_factory(layout.spec, options));
  return ReferenceTraining(job, std::move(layout), encoding, trainer, data, std::move(model), error_feedback,
                           group_size);
}

absl::StatusOr<std::vector<std::vector<float>>> ReferenceTraining::MicroBatchGradient(int64_t step, int rank,
                                                                                     int micro) {
  const size_t n = static_cast<size_t>(trainer_.batch) * trainer_.seq_len;
  std::vector<int32_t> tokens(n), targets(n);
  RETURN_IF_ERROR(data_->SampleBatch(trainer_.data_seed, step, rank, micro, trainer_.batch, trainer_.seq_len,
                                     tokens, targets));
  RETURN_IF_ERROR(model_->SetBatch(0, tokens, targets));
  std::vector<std::vector<float>> weights = master_;
  for (size_t u = 0; u < weights.size(); ++u) RoundTripBySlice(encoding_.weight_format(), u, weights[u]);
  const int units = static_cast<int>(weights.size());
  for (int u = 0; u < units; ++u) RETURN_IF_ERROR(model_->ForwardUnit(u, weights[u]));
  std::vector<std::vector<float>> grads(units);
  for (int u = units - 1; u >= 0; --u) {
    grads[u].assign(layout_.partitions[u].padded_numel(), 0.0f);
    RETURN_IF_ERROR(model_->BackwardUnit(u, weights[u], grads[u]));
    RETURN_IF_ERROR(model_->FinishBackward(u));
  }
  return grads;
}

absl::Status ReferenceTraining::Step(int64_t step) {
  const size_t units = master_.size();
  const int ranks = job_.num_trainers;
  const int micros = job_.micro_batches;
  bool non_finite = false;
  // g[m][r][u]: every micro-batch gradient of the step.
  std::vector<std::vector<std::vector<std::vector<float>>>> g(micros);
  for (int m = 0; m < micros; ++m) {
    for (int r = 0; r < ranks; ++r) {
      ASSIGN_OR_RETURN(std::vector<std::vector<float>> grad, MicroBatchGradient(step, r, m));
      g[m].push_back(std::move(grad));
    }
  }
  std::vector<std::vector<float>> sum(units);
  for (size_t u = 0; u < units; ++u) {
    const WireFormat format = encoding_.grad_format();
    std::vector<float> scratch;
    // What the pushes of the group whose first rank is `first` carry: slice
    // s is pushed by member s % G, with that member's residual.
    auto pushed = [&](int first, std::vector<float> v) {
      if (!format.quantized()) {
        RoundTripBySlice(format, u, v);
        for (float x : v) non_finite = non_finite || !std::isfinite(x);
        return v;
      }
      for (int s = 0; s < job_.num_shards; ++s) {
        const SliceRange slice = layout_.partitions[u].Slice(s);
        const std::span<float> part(v.data() + slice.begin, slice.length);
        const int rank = first + s % group_size_;
        const std::span<float> residual =
            error_feedback_ ? std::span<float>(residual_[rank][u].data() + slice.begin, slice.length)
                            : std::span<float>();
        if (!QuantizeWithFeedback(format, part, residual, &scratch)) {
          non_finite = true;
          std::fill(part.begin(), part.end(), 0.0f);  // sent as zero blocks
        }
        RoundTripInPlace(format, part);
      }
      return v;
    };
    // What member `member` (trainer `rank`) of a fabric group hands to the
    // group's sum: its own slices as they are, every other member's slices
    // in the gradients' encoding (quantized with its residual of them; a
    // slice that is not finite arrives as NaN).
    auto handed = [&](int rank, int member, std::vector<float> v) {
      if (group_size_ == 1 || format.encoding() == WireEncoding::kFp32) return v;
      for (int s = 0; s < job_.num_shards; ++s) {
        if (s % group_size_ == member) continue;
        const SliceRange slice = layout_.partitions[u].Slice(s);
        const std::span<float> part(v.data() + slice.begin, slice.length);
        const std::span<float> residual =
            error_feedback_ && format.quantized()
                ? std::span<float>(residual_[rank][u].data() + slice.begin, slice.length)
                : std::span<float>();
        if (!QuantizeWithFeedback(format, part, residual, &scratch)) {
          std::fill(part.begin(), part.end(), std::numeric_limits<float>::quiet_NaN());
          continue;
        }
        RoundTripInPlace(format, part);
      }
      return v;
    };
    // Each fabric group's members' gradients (each rank alone without
    // groups), summed in the tree's order and pushed once.
    auto pushed_by_groups = [&](std::vector<std::vector<float>> per_rank) {
      std::vector<std::vector<float>> per_group;
      for (int first = 0; first < ranks; first += group_size_) {
        std::vector<std::vector<float>> members;
        for (int m = 0; m < group_size_; ++m) members.push_back(handed(first + m, m, std::move(per_rank[first + m])));
        per_group.push_back(pushed(first, group_size_ == 1 ? std::move(members[0]) : TreeSum(std::move(members))));
      }
      return TreeSum(std::move(per_group));
    };
    if (job_.accumulate_on_trainer) {
      std::vector<std::vector<float>> per_rank;
      for (int r = 0; r < ranks; ++r) {
        std::vector<std::vector<float>> per_micro;
        for (int m = 0; m < micros; ++m) per_micro.push_back(g[m][r][u]);
        per_rank.push_back(TreeSum(std::move(per_micro)));
      }
      sum[u] = pushed_by_groups(std::move(per_rank));
    } else {
      std::vector<std::vector<float>> per_micro;
      for (int m = 0; m < micros; ++m) {
        std::vector<std::vector<float>> per_rank;
        for (int r = 0; r < ranks; ++r) per_rank.push_back(g[m][r][u]);
        per_micro.push_back(pushed_by_groups(std::move(per_rank)));
      }
      sum[u] = TreeSum(std::move(per_micro));
    }
  }
  const float contributions = static_cast<float>(ranks) * static_cast<float>(micros);
  for (auto& s : sum) {
    for (float& x : s) x = x / contributions;
  }
  // The norm is exact: the same whatever the shards' share of it.
  SquareSum squares;
  for (size_t u = 0; u < units; ++u) squares.AddSquares(sum[u]);
  const double total = squares.ToDouble();
  if (non_finite || !std::isfinite(total)) {
    ++skipped_;
    return absl::OkStatus();
  }
  AdamWStep adam;
  adam.lr = LearningRateAt(job_.optimizer, step);
  adam.count = ++applied_;
  adam.grad_scale = static_cast<float>(ClipCoefficient(job_.optimizer.grad_clip, std::sqrt(total)));
  for (size_t u = 0; u < units; ++u) {
    const std::vector<ElementRun> runs =
        WeightDecayRuns(layout_.spec.units[u], 0, static_cast<int64_t>(master_[u].size()));
    AdamWUpdate(job_.optimizer, adam, master_[u], m_[u], v_[u], sum[u], runs);
  }
  return absl::OkStatus();
}

void ReferenceTraining::ResetResidual(int rank) {
  for (auto& r : residual_[rank]) std::fill(r.begin(), r.end(), 0.0f);
}

std::vector<std::vector<float>> ReferenceTraining::MasterWeights() const {
  std::vector<std::vector<float>> out;
  for (size_t u = 0; u < master_.size(); ++u) {
    out.emplace_back(master_[u].begin(), master_[u].begin() + layout_.spec.units[u].numel);
  }
  return out;
}

absl::StatusOr<std::vector<std::vector<float>>> TrainReference(const JobConfig& job, WireEncodings encoding,
                                                              const TrainerOptions& trainer,
                                                              const TokenDataset& data, int64_t steps,
                                                              bool error_feedback, int group_size,
                                                              const UnitModelFactory& model) {
  ASSIGN_OR_RETURN(ReferenceTraining ref,
                   ReferenceTraining::Create(job, encoding, trainer, &data, error_feedback, group_size, model));
  for (int64_t step = 0; step < steps; ++step) RETURN_IF_ERROR(ref.Step(step));
  return ref.MasterWeights();
}

bool BitIdentical(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size() || a.empty()) return false;
  for (size_t u = 0; u < a.size(); ++u) {
    if (a[u].size() != b[u].size() || std::memcmp(a[u].data(), b[u].data(), a[u].size() * sizeof(float)) != 0) {
      return false;
    }
  }
  return true;
}

}  // namespace pshard::testing
