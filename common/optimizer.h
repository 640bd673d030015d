// AdamW with torch.optim.AdamW semantics, the learning-rate schedule and
// global-norm clipping helpers. Pure functions over spans; no state.
#ifndef PSHARD_COMMON_OPTIMIZER_H_
#define PSHARD_COMMON_OPTIMIZER_H_

#include <cstdint>
#include <span>

#include "common/model_spec.h"

namespace pshard {

/// Training hyper-parameters shared by every shard server of a job.
struct OptimizerConfig {
  double lr = 3e-4;          ///< peak learning rate
  double min_lr = 3e-5;      ///< floor of the cosine decay
  int64_t warmup_steps = 0;  ///< linear warm-up length
  int64_t total_steps = 0;   ///< end of the cosine decay; 0 keeps lr constant after warm-up
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;  ///< decoupled; applied to matrices only
  double grad_clip = 1.0;     ///< max global gradient L2 norm; 0 disables clipping
};

/// Learning rate for 0-based training step `step`: linear warm-up from
/// lr/warmup to lr over warmup_steps, then cosine decay to min_lr at
/// total_steps, min_lr after.
double LearningRateAt(const OptimizerConfig& config, int64_t step);

/// torch.nn.utils.clip_grad_norm_'s factor: min(1, max_norm / (norm + 1e-6)),
/// or 1 when clipping is disabled (max_norm <= 0).
double ClipCoefficient(double max_norm, double total_norm);

/// Sum of squares in double, accumulated strictly left to right.
double SumOfSquares(std::span<const float> values);

/// Scalars of one AdamW update.
struct AdamWStep {
  double lr = 0.0;
  int64_t count = 1;        ///< 1-based number of this update (bias correction)
  float grad_scale = 1.0f;  ///< multiplies the gradient first (clipping)
};

/// Squared norms of one update and of the weights after it (for the
/// update/weight ratio users watch to spot a diverging run).
struct AdamWNorms {
  double update_sum_of_squares = 0.0;
  double weight_sum_of_squares = 0.0;
};

/// One AdamW update of `param`, `m`, `v` from `grad` (all the same length),
/// in the order torch.optim.AdamW (single-tensor path) applies it:
///   p *= 1 - lr*wd;  m = lerp(m, g, 1-b1);  v = v*b2 + (1-b2) g^2;
///   p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
/// Weight decay applies only to the elements in `decay_runs`.
void AdamWUpdate(const OptimizerConfig& config, const AdamWStep& step, std::span<float> param,
                 std::span<float> m, std::span<float> v, std::span<const float> grad,
                 std::span<const ElementRun> decay_runs, AdamWNorms* norms = nullptr);

}  // namespace pshard

#endif  // PSHARD_COMMON_OPTIMIZER_H_
