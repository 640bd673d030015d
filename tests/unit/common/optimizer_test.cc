#include "common/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "gtest/gtest.h"

namespace pshard {
namespace {

// Unit roundoff of float32.
constexpr double kFloatRoundoff = 0x1.0p-24;

// torch.optim.AdamW (single-tensor path) in double precision, one element.
struct ReferenceElement {
  double p = 0.0;
  double m = 0.0;
  double v = 0.0;

  void Step(const OptimizerConfig& c, double lr, int64_t t, double grad, bool decay) {
    if (decay) p *= 1.0 - lr * c.weight_decay;
    m += (1.0 - c.beta1) * (grad - m);
    v = c.beta2 * v + (1.0 - c.beta2) * grad * grad;
    const double bias_correction1 = 1.0 - std::pow(c.beta1, static_cast<double>(t));
    const double bias_correction2 = 1.0 - std::pow(c.beta2, static_cast<double>(t));
    const double denom = std::sqrt(v) / std::sqrt(bias_correction2) + c.eps;
    p -= lr / bias_correction1 * m / denom;
  }
};

// Gradient of element i at step t: mixed signs and magnitudes, some exact
// zeros, and a large step (t == 2) so that clipping engages.
float GradientAt(int64_t t, size_t i) {
  if (i == 5) return 0.0f;  // never receives a gradient
  const double base = std::sin(1.7 * static_cast<double>(i) + 0.9 * static_cast<double>(t));
  const double magnitude = (t == 2 ? 3.0 : 0.15) * (1.0 + 0.3 * static_cast<double>(i % 4));
  return static_cast<float>(base * magnitude);
}

struct Trajectory {
  std::vector<float> p, m, v;
  std::vector<ReferenceElement> reference;
  std::vector<double> lrs;
  std::vector<float> grad_scales;
  double max_abs_grad = 0.0;  ///< largest scaled gradient applied
};

// Runs `steps` AdamW updates from step 0 with the schedule and clipping of
// `config`, alongside the double-precision reference.
Trajectory RunSteps(const OptimizerConfig& config, int steps,
                    std::span<const ElementRun> decay_runs) {
  const std::vector<float> initial = {0.5f,  -1.25f, 2.0f, 0.0f,   -0.75f, 1.5f,
                                      -2.0f, 0.125f, 1.0f, -0.01f, 0.3f};
  const size_t n = initial.size();
  std::vector<bool> decays(n, false);
  for (const ElementRun& r : decay_runs) {
    for (int64_t i = r.begin; i < r.end; ++i) decays[i] = true;
  }
  Trajectory out;
  out.p = initial;
  out.m.assign(n, 0.0f);
  out.v.assign(n, 0.0f);
  for (float x : initial) out.reference.push_back({x, 0.0, 0.0});
  for (int step = 0; step < steps; ++step) {
    std::vector<float> grad(n);
    for (size_t i = 0; i < n; ++i) grad[i] = GradientAt(step, i);
    const double norm = std::sqrt(SumOfSquares(grad));
    AdamWStep s;
    s.lr = LearningRateAt(config, step);
    s.count = step + 1;
    s.grad_scale = static_cast<float>(ClipCoefficient(config.grad_clip, norm));
    out.lrs.push_back(s.lr);
    out.grad_scales.push_back(s.grad_scale);
    AdamWUpdate(config, s, out.p, out.m, out.v, grad, decay_runs);
    for (size_t i = 0; i < n; ++i) {
      const double g = static_cast<double>(grad[i]) * static_cast<double>(s.grad_scale);
      out.reference[i].Step(config, s.lr, s.count, g, decays[i]);
      out.max_abs_grad = std::max(out.max_abs_grad, std::abs(g));
    }
  }
  return out;
}

// Tolerance from float32 rounding. Per step each stored value goes through a
// handful of float operations (scale, lerp, multiply-add, sqrt, divide), each
// with relative error at most u = 2^-24; p additionally carries the decay
// product and the final add. A loose bound is 8 u per step relative to the
// magnitude involved (|p| or 1 for the parameter, since updates are O(lr/bc1)
// <= 0.1; the largest gradient for m; v itself), accumulated over the steps.
void ExpectMatchesReference(const Trajectory& t, int steps) {
  const double per_step = 8.0 * kFloatRoundoff * steps;
  for (size_t i = 0; i < t.p.size(); ++i) {
    const ReferenceElement& r = t.reference[i];
    EXPECT_NEAR(t.p[i], r.p, per_step * std::max(1.0, std::abs(r.p))) << "p[" << i << "]";
    EXPECT_NEAR(t.m[i], r.m, per_step * t.max_abs_grad) << "m[" << i << "]";
    EXPECT_NEAR(t.v[i], r.v, per_step * r.v) << "v[" << i << "]";
  }
}

OptimizerConfig TestConfig() {
  OptimizerConfig c;
  c.lr = 1e-2;
  c.min_lr = 1e-3;
  c.warmup_steps = 2;
  c.total_steps = 6;
  c.beta1 = 0.9;
  c.beta2 = 0.95;
  // Large enough that its place (outside the square root, after the bias
  // correction) changes the result far beyond the tolerance.
  c.eps = 1e-3;
  c.weight_decay = 0.1;
  c.grad_clip = 1.0;
  return c;
}

TEST(AdamWTest, MatchesTorchFormulaOverFiveSteps) {
  const OptimizerConfig config = TestConfig();
  const std::vector<ElementRun> decay_runs = {{1, 4}, {5, 6}, {8, 11}};
  constexpr int kSteps = 5;
  const Trajectory t = RunSteps(config, kSteps, decay_runs);

  // The scenario is what it claims: warm-up then cosine lr, clipping at step 2 only.
  EXPECT_DOUBLE_EQ(t.lrs[0], 5e-3);
  EXPECT_DOUBLE_EQ(t.lrs[1], 1e-2);
  EXPECT_LT(t.lrs[4], t.lrs[3]);
  for (int s = 0; s < kSteps; ++s) {
    if (s == 2) {
      EXPECT_LT(t.grad_scales[s], 0.5f);
    } else {
      EXPECT_EQ(t.grad_scales[s], 1.0f) << "step " << s;
    }
  }
  ExpectMatchesReference(t, kSteps);
}

TEST(AdamWTest, BiasCorrectionAtFirstStep) {
  // At t = 1: m = (1-b1) g, v = (1-b2) g^2, so the update is
  // lr * g / (|g| + eps) before decay: about lr * sign(g), not (1-b1) * lr.
  OptimizerConfig config = TestConfig();
  config.eps = 1e-8;
  config.weight_decay = 0.0;
  std::vector<float> p = {1.0f, 1.0f, 1.0f};
  std::vector<float> m(3, 0.0f);
  std::vector<float> v(3, 0.0f);
  const std::vector<float> g = {0.5f, -2.0f, 1e-3f};
  AdamWStep step;
  step.lr = 0.01;
  step.count = 1;
  AdamWUpdate(config, step, p, m, v, g, {});
  for (size_t i = 0; i < 3; ++i) {
    const double expected = 1.0 - 0.01 * g[i] / (std::abs(g[i]) + 1e-8);
    EXPECT_NEAR(p[i], expected, 4 * kFloatRoundoff) << i;
    EXPECT_NEAR(m[i], 0.1 * g[i], 4 * kFloatRoundoff * std::abs(g[i])) << i;
    EXPECT_NEAR(v[i], 0.05 * g[i] * g[i], 4 * kFloatRoundoff * g[i] * g[i]) << i;
  }
}

TEST(AdamWTest, DecayOnlyInsideRuns) {
  // With zero gradients the update is zero, so only the decay moves p.
  OptimizerConfig config = TestConfig();
  std::vector<float> p(8, 2.0f);
  std::vector<float> m(8, 0.0f);
  std::vector<float> v(8, 0.0f);
  const std::vector<float> g(8, 0.0f);
  AdamWStep step;
  step.lr = 0.5;  // decay factor 1 - 0.5 * 0.1 = 0.95
  const std::vector<ElementRun> runs = {{0, 1}, {3, 5}, {7, 8}};
  AdamWUpdate(config, step, p, m, v, g, runs);
  const std::vector<float> expected = {1.9f, 2.0f, 2.0f, 1.9f, 1.9f, 2.0f, 2.0f, 1.9f};
  for (size_t i = 0; i < p.size(); ++i) EXPECT_FLOAT_EQ(p[i], expected[i]) << i;
}

TEST(AdamWTest, DecayRunsEqualSeparateCalls) {
  // One call with decay runs equals calls on the pieces with all-or-nothing decay.
  const OptimizerConfig config = TestConfig();
  const std::vector<ElementRun> runs = {{2, 5}, {7, 9}};
  const Trajectory whole = RunSteps(config, 3, runs);

  const std::vector<ElementRun> everything = {{0, 11}};
  const Trajectory all_decay = RunSteps(config, 3, everything);
  const Trajectory no_decay = RunSteps(config, 3, {});
  for (size_t i = 0; i < whole.p.size(); ++i) {
    const bool decays = (i >= 2 && i < 5) || (i >= 7 && i < 9);
    EXPECT_EQ(whole.p[i], decays ? all_decay.p[i] : no_decay.p[i]) << i;
    EXPECT_EQ(whole.m[i], no_decay.m[i]) << i;
    EXPECT_EQ(whole.v[i], no_decay.v[i]) << i;
  }
}

TEST(AdamWTest, DefaultHyperParametersMatchReference) {
  OptimizerConfig config;  // eps 1e-8, lr 3e-4, constant schedule
  config.grad_clip = 0.0;  // disabled: grad_scale stays 1
  const std::vector<ElementRun> runs = {{0, 6}};
  constexpr int kSteps = 5;
  const Trajectory t = RunSteps(config, kSteps, runs);
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_EQ(t.grad_scales[s], 1.0f);
    EXPECT_DOUBLE_EQ(t.lrs[s], 3e-4);
  }
  ExpectMatchesReference(t, kSteps);
}

TEST(AdamWTest, GradScaleEqualsPrescaledGradient) {
  const OptimizerConfig config = TestConfig();
  const std::vector<float> grad = {0.3f, -1.0f, 2.5f, 0.0f};
  const float scale = 0.37f;
  std::vector<float> scaled(grad.size());
  for (size_t i = 0; i < grad.size(); ++i) scaled[i] = grad[i] * scale;
  std::vector<float> p1 = {1.0f, -1.0f, 0.5f, 0.25f};
  std::vector<float> m1(4, 0.01f), v1(4, 0.02f);
  std::vector<float> p2 = p1, m2 = m1, v2 = v1;
  AdamWStep step;
  step.lr = 0.01;
  step.count = 3;
  step.grad_scale = scale;
  const std::vector<ElementRun> runs = {{1, 3}};
  AdamWUpdate(config, step, p1, m1, v1, grad, runs);
  step.grad_scale = 1.0f;
  AdamWUpdate(config, step, p2, m2, v2, scaled, runs);
  for (size_t i = 0; i < grad.size(); ++i) {
    EXPECT_EQ(p1[i], p2[i]) << i;
    EXPECT_EQ(m1[i], m2[i]) << i;
    EXPECT_EQ(v1[i], v2[i]) << i;
  }
}

TEST(LearningRateTest, WarmupThenCosine) {
  OptimizerConfig c;
  c.lr = 1e-3;
  c.min_lr = 1e-4;
  c.warmup_steps = 10;
  c.total_steps = 110;
  EXPECT_DOUBLE_EQ(LearningRateAt(c, 0), 1e-4);  // lr * 1 / 10
  EXPECT_DOUBLE_EQ(LearningRateAt(c, 4), 5e-4);
  EXPECT_DOUBLE_EQ(LearningRateAt(c, 9), 1e-3);
  EXPECT_DOUBLE_EQ(LearningRateAt(c, 10), 1e-3);                 // cosine starts at the peak
  EXPECT_NEAR(LearningRateAt(c, 60), (1e-3 + 1e-4) / 2, 1e-15);  // midpoint
  EXPECT_NEAR(LearningRateAt(c, 35), 1e-4 + 0.5 * (1 + std::cos(M_PI / 4)) * 9e-4, 1e-15);
  EXPECT_DOUBLE_EQ(LearningRateAt(c, 110), 1e-4);
  EXPECT_DOUBLE_EQ(LearningRateAt(c, 111), 1e-4);
  EXPECT_DOUBLE_EQ(LearningRateAt(c, 1000000), 1e-4);
  for (int64_t s = 10; s < 110; ++s) {
    EXPECT_GE(LearningRateAt(c, s), LearningRateAt(c, s + 1)) << s;
    EXPECT_GE(LearningRateAt(c, s), c.min_lr) << s;
    EXPECT_LE(LearningRateAt(c, s), c.lr) << s;
  }
}

TEST(LearningRateTest, NoWarmup) {
  OptimizerConfig c;
  c.lr = 6e-4;
  c.min_lr = 6e-5;
  c.warmup_steps = 0;
  c.total_steps = 100;
  EXPECT_DOUBLE_EQ(LearningRateAt(c, 0), 6e-4);
  EXPECT_NEAR(LearningRateAt(c, 50), (6e-4 + 6e-5) / 2, 1e-15);
  EXPECT_DOUBLE_EQ(LearningRateAt(c, 100), 6e-5);
  EXPECT_DOUBLE_EQ(LearningRateAt(c, 500), 6e-5);
}

TEST(LearningRateTest, ZeroTotalStepsKeepsLrConstant) {
  OptimizerConfig c;
  c.lr = 2e-3;
  c.min_lr = 1e-5;
  c.total_steps = 0;
  for (int64_t s : {0, 1, 10, 1000000}) EXPECT_DOUBLE_EQ(LearningRateAt(c, s), 2e-3) << s;
  c.warmup_steps = 4;
  EXPECT_DOUBLE_EQ(LearningRateAt(c, 0), 5e-4);
  EXPECT_DOUBLE_EQ(LearningRateAt(c, 3), 2e-3);
  for (int64_t s : {4, 5, 1000000}) EXPECT_DOUBLE_EQ(LearningRateAt(c, s), 2e-3) << s;
}

TEST(LearningRateTest, DecayEndingWithWarmupGivesMinLrAfter) {
  // total_steps == warmup_steps: a cosine of length zero; min_lr after it.
  OptimizerConfig c;
  c.lr = 1e-3;
  c.min_lr = 1e-4;
  c.warmup_steps = 5;
  c.total_steps = 5;
  EXPECT_DOUBLE_EQ(LearningRateAt(c, 4), 1e-3);
  EXPECT_DOUBLE_EQ(LearningRateAt(c, 5), 1e-4);
  EXPECT_DOUBLE_EQ(LearningRateAt(c, 100), 1e-4);
}

TEST(ClipCoefficientTest, TorchSemantics) {
  EXPECT_EQ(ClipCoefficient(1.0, 0.5), 1.0);
  EXPECT_EQ(ClipCoefficient(1.0, 0.0), 1.0);
  EXPECT_DOUBLE_EQ(ClipCoefficient(1.0, 1.0), 1.0 / (1.0 + 1e-6));  // just clips at equality
  EXPECT_DOUBLE_EQ(ClipCoefficient(1.0, 4.0), 1.0 / (4.0 + 1e-6));
  EXPECT_DOUBLE_EQ(ClipCoefficient(2.5, 10.0), 2.5 / (10.0 + 1e-6));
  EXPECT_EQ(ClipCoefficient(0.0, 100.0), 1.0);  // disabled
  EXPECT_EQ(ClipCoefficient(-1.0, 100.0), 1.0);
}

TEST(SumOfSquaresTest, ExactOnSmallIntegers) {
  EXPECT_EQ(SumOfSquares({}), 0.0);
  const std::vector<float> values = {1, -2, 3, -4, 5, 0, 4096, -7};
  EXPECT_EQ(SumOfSquares(values), 1 + 4 + 9 + 16 + 25 + 0 + 16777216 + 49);
  // Strictly left to right: 2^54 absorbs each following 1 (ulp there is 4).
  const std::vector<float> ordered = {0x1.0p27f, 1, 1, 1, 1};
  EXPECT_EQ(SumOfSquares(ordered), 0x1.0p54);
  // Squares are taken in double: 2^100 does not overflow float arithmetic.
  const std::vector<float> big = {0x1.0p100f, 0x1.0p100f};
  EXPECT_EQ(SumOfSquares(big), 0x1.0p201);
}

}  // namespace
}  // namespace pshard
