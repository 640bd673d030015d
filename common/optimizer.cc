#include "common/optimizer.h"

#include <algorithm>
#include <cmath>

namespace pshard {

double LearningRateAt(const OptimizerConfig& config, int64_t step) {
  if (config.warmup_steps > 0 && step < config.warmup_steps) {
    return config.lr * static_cast<double>(step + 1) / static_cast<double>(config.warmup_steps);
  }
  if (config.total_steps <= 0) return config.lr;
  if (step >= config.total_steps) return config.min_lr;
  // Here warmup_steps <= step < total_steps, so the cosine has positive length.
  const double progress = static_cast<double>(step - config.warmup_steps) /
                          static_cast<double>(config.total_steps - config.warmup_steps);
  const double cosine = 0.5 * (1.0 + std::cos(M_PI * progress));
  return config.min_lr + cosine * (config.lr - config.min_lr);
}

double ClipCoefficient(double max_norm, double total_norm) {
  if (max_norm <= 0.0) return 1.0;
  return std::min(1.0, max_norm / (total_norm + 1e-6));
}

double SumOfSquares(std::span<const float> values) {
  double sum = 0.0;
  for (float x : values) sum += static_cast<double>(x) * static_cast<double>(x);
  return sum;
}

namespace {

// Elements [begin, end) of one update with a fixed decay factor.
void AdamWRange(const OptimizerConfig& config, const AdamWStep& step, float decay_factor,
                float* p, float* m, float* v, const float* g, int64_t begin, int64_t end,
                AdamWNorms* norms) {
  const float one_minus_beta1 = static_cast<float>(1.0 - config.beta1);
  const float beta2 = static_cast<float>(config.beta2);
  const float one_minus_beta2 = static_cast<float>(1.0 - config.beta2);
  const double bias_correction1 = 1.0 - std::pow(config.beta1, static_cast<double>(step.count));
  const double bias_correction2 = 1.0 - std::pow(config.beta2, static_cast<double>(step.count));
  const float neg_step_size = static_cast<float>(-(step.lr / bias_correction1));
  const float bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  const float eps = static_cast<float>(config.eps);
  double update_sq = 0.0;
  double weight_sq = 0.0;
  for (int64_t i = begin; i < end; ++i) {
    const float before = p[i];
    const float grad = g[i] * step.grad_scale;
    p[i] = p[i] * decay_factor;
    m[i] = m[i] + one_minus_beta1 * (grad - m[i]);  // torch lerp for weight < 0.5
    v[i] = v[i] * beta2;
    v[i] = v[i] + one_minus_beta2 * (grad * grad);
    const float denom = std::sqrt(v[i]) / bias_correction2_sqrt + eps;
    p[i] = p[i] + neg_step_size * (m[i] / denom);
    const double delta = static_cast<double>(p[i]) - before;
    update_sq += delta * delta;
    weight_sq += static_cast<double>(p[i]) * p[i];
  }
  norms->update_sum_of_squares += update_sq;
  norms->weight_sum_of_squares += weight_sq;
}

}  // namespace

void AdamWUpdate(const OptimizerConfig& config, const AdamWStep& step, std::span<float> param,
                 std::span<float> m, std::span<float> v, std::span<const float> grad,
                 std::span<const ElementRun> decay_runs, AdamWNorms* norms) {
  AdamWNorms unused;
  if (norms == nullptr) norms = &unused;
  const float decay = static_cast<float>(1.0 - step.lr * config.weight_decay);
  const int64_t n = static_cast<int64_t>(param.size());
  int64_t at = 0;
  for (const ElementRun& run : decay_runs) {
    AdamWRange(config, step, 1.0f, param.data(), m.data(), v.data(), grad.data(), at, run.begin,
               norms);
    AdamWRange(config, step, decay, param.data(), m.data(), v.data(), grad.data(), run.begin,
               run.end, norms);
    at = run.end;
  }
  AdamWRange(config, step, 1.0f, param.data(), m.data(), v.data(), grad.data(), at, n, norms);
}

}  // namespace pshard
