// The whole CpuGpt: gradients against finite differences in double, float vs
// double, determinism, the loss at initialisation, and argument checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/model_spec.h"
#include "common/rng.h"
#include "trainer_client/model/gpt.h"

namespace pshard {
namespace {

constexpr uint64_t kSeed = 77;
constexpr int kBatch = 2;
constexpr int kSeqLen = 6;  // below the context, so the last wpe rows get no gradient

GptConfig TinyConfig() {
  GptConfig cfg;
  cfg.num_layers = 2;
  cfg.d_model = 16;
  cfg.num_heads = 2;
  cfg.context = 8;
  cfg.vocab = 64;
  return cfg;
}

ModelSpec TinySpec() {
  absl::StatusOr<ModelSpec> spec = MakeGptSpec(TinyConfig());
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

// Weights far from the initialisation (LayerNorm gains away from 1, biases
// away from 0, larger matrices) so that every term of every gradient is
// exercised with a sizeable value.
template <typename T>
std::vector<std::vector<T>> RandomWeights(const ModelSpec& spec) {
  std::vector<std::vector<T>> weights;
  for (const UnitSpec& unit : spec.units) {
    std::vector<T> w(unit.numel);
    for (const TensorSpec& t : unit.tensors) {
      for (int64_t i = 0; i < t.numel; ++i) {
        const double z = NormalAt(kSeed, 1000 + t.rng_stream, i);
        const double base = t.init == InitKind::kOnes ? 1.0 : 0.0;
        const double scale = t.init == InitKind::kNormal ? 0.3 : 0.2;
        w[t.offset + i] = static_cast<T>(base + scale * z);
      }
    }
    weights.push_back(std::move(w));
  }
  return weights;
}

template <typename T>
std::vector<std::vector<T>> InitialWeights(const ModelSpec& spec) {
  std::vector<std::vector<T>> weights;
  for (const UnitSpec& unit : spec.units) {
    std::vector<float> w(unit.numel);
    InitializeUnitRange(unit, kSeed, 0, w);
    weights.emplace_back(w.begin(), w.end());
  }
  return weights;
}

std::vector<int32_t> RandomTokens(int n, int vocab, uint64_t stream) {
  std::vector<int32_t> tokens(n);
  for (int i = 0; i < n; ++i)
    tokens[i] = static_cast<int32_t>(CounterHash(kSeed, stream, i) % vocab);
  return tokens;
}

template <typename T>
CpuGpt<T> MakeModel(const ModelSpec& spec) {
  absl::StatusOr<CpuGpt<T>> model = CpuGpt<T>::Create(spec, kBatch, kSeqLen);
  EXPECT_TRUE(model.ok()) << model.status();
  const int vocab = GptConfigFromSpec(spec).value().vocab;
  EXPECT_TRUE(model
                  ->SetBatch(RandomTokens(kBatch * kSeqLen, vocab, 1),
                             RandomTokens(kBatch * kSeqLen, vocab, 2))
                  .ok());
  return std::move(*model);
}

// Elements of a tensor to check: both ends and a spread of hashed positions.
std::vector<int64_t> SampleElements(const TensorSpec& t, int count) {
  std::vector<int64_t> picks = {0, t.numel - 1};
  for (int k = 0; k < count; ++k) picks.push_back(CounterHash(kSeed, t.rng_stream, k) % t.numel);
  return picks;
}

TEST(GptGradTest, EveryUnitMatchesFiniteDifferences) {
  const ModelSpec spec = TinySpec();
  CpuGpt<double> model = MakeModel<double>(spec);
  std::vector<std::vector<double>> weights = RandomWeights<double>(spec);
  std::vector<std::vector<double>> grads;
  ASSERT_TRUE(LossAndGradients(model, weights, &grads).ok());

  // The mean loss is about log(64) = 4.2, so central differences with step
  // 1e-5 carry a rounding error of about 1e-16 * 4 / 1e-5 = 4e-11 and a
  // truncation error of the same order (the largest difference measured
  // over every 7th weight is 1.3e-10). Gradients are compared with a
  // relative tolerance of 1e-6, floored at an absolute 1e-8 for elements
  // whose gradient is tiny (or exactly zero, like unused wte rows): about
  // 100x above that noise, and far below the error of any wrong term on the
  // sizeable (1e-3 .. 3e-1) gradients of these weights.
  constexpr double kStep = 1e-5;
  auto loss = [&] { return LossAndGradients(model, weights, nullptr).value(); };
  int checked = 0;
  for (size_t u = 0; u < spec.units.size(); ++u) {
    for (const TensorSpec& t : spec.units[u].tensors) {
      for (int64_t i : SampleElements(t, 6)) {
        double& w = weights[u][t.offset + i];
        const double saved = w;
        w = saved + kStep;
        const double plus = loss();
        w = saved - kStep;
        const double minus = loss();
        w = saved;
        const double numeric = (plus - minus) / (2 * kStep);
        const double analytic = grads[u][t.offset + i];
        EXPECT_NEAR(analytic, numeric, 1e-6 * std::max(std::abs(numeric), 1e-2))
            << t.name << "[" << i << "]";
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 100);
  // wte rows of tokens in the batch do get gradient; rows past seq_len of wpe do not.
  const TensorSpec* wpe = spec.units[0].Find(".wpe");
  ASSERT_NE(wpe, nullptr);
  const int64_t c = GptConfigFromSpec(spec).value().d_model;
  for (int64_t i = kSeqLen * c; i < wpe->numel; ++i) EXPECT_EQ(grads[0][wpe->offset + i], 0.0);
}

TEST(GptGradTest, UnitByUnitWithPaddingMatchesWholeModel) {
  const ModelSpec spec = TinySpec();
  CpuGpt<double> model = MakeModel<double>(spec);
  const std::vector<std::vector<double>> weights = RandomWeights<double>(spec);
  std::vector<std::vector<double>> expected;
  const double expected_loss = LossAndGradients(model, weights, &expected).value();

  constexpr int kPadding = 5;
  constexpr double kSentinel = -123.0;
  const int units = model.num_units();
  ASSERT_EQ(units, GptConfigFromSpec(spec).value().num_layers + 2);
  std::vector<std::vector<double>> padded = weights;
  for (std::vector<double>& w : padded) w.insert(w.end(), kPadding, 1e30);  // ignored
  for (int u = 0; u < units; ++u) model.ForwardUnit(u, padded[u]);
  EXPECT_EQ(model.loss(), expected_loss);
  for (int u = units - 1; u >= 0; --u) {
    std::vector<double> grad(spec.units[u].numel + kPadding, kSentinel);
    model.BackwardUnit(u, padded[u], grad);
    for (int64_t i = 0; i < spec.units[u].numel; ++i) {
      ASSERT_EQ(grad[i], expected[u][i]) << spec.units[u].name << " element " << i;
    }
    for (int k = 0; k < kPadding; ++k) EXPECT_EQ(grad[spec.units[u].numel + k], kSentinel);
  }
}

TEST(GptGradTest, FloatAgreesWithDouble) {
  const ModelSpec spec = TinySpec();
  CpuGpt<double> model64 = MakeModel<double>(spec);
  CpuGpt<float> model32 = MakeModel<float>(spec);
  const std::vector<std::vector<double>> weights64 = RandomWeights<double>(spec);
  std::vector<std::vector<float>> weights32;
  for (const std::vector<double>& w : weights64) weights32.emplace_back(w.begin(), w.end());
  std::vector<std::vector<double>> grads64;
  std::vector<std::vector<float>> grads32;
  const double loss64 = LossAndGradients(model64, weights64, &grads64).value();
  const float loss32 = LossAndGradients(model32, weights32, &grads32).value();
  // float carries ~7 digits; a few hundred roundings per value lose at most
  // about two of them.
  EXPECT_NEAR(loss32, loss64, 1e-5 * loss64);
  for (size_t u = 0; u < grads64.size(); ++u) {
    double scale = 0;
    for (double g : grads64[u]) scale = std::max(scale, std::abs(g));
    for (size_t i = 0; i < grads64[u].size(); ++i) {
      ASSERT_NEAR(grads32[u][i], grads64[u][i], 1e-4 * scale) << spec.units[u].name << " " << i;
    }
  }
}

TEST(GptGradTest, RepeatedCallsAreBitIdentical) {
  const ModelSpec spec = TinySpec();
  CpuGpt<float> first = MakeModel<float>(spec);
  CpuGpt<float> second = MakeModel<float>(spec);
  std::vector<std::vector<float>> weights;
  for (const std::vector<double>& w : RandomWeights<double>(spec)) {
    weights.emplace_back(w.begin(), w.end());
  }
  std::vector<std::vector<float>> a, b, c;
  const float loss_a = LossAndGradients(first, weights, &a).value();
  const float loss_b = LossAndGradients(first, weights, &b).value();
  const float loss_c = LossAndGradients(second, weights, &c).value();
  EXPECT_EQ(std::memcmp(&loss_a, &loss_b, sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(&loss_a, &loss_c, sizeof(float)), 0);
  for (size_t u = 0; u < a.size(); ++u) {
    ASSERT_EQ(std::memcmp(a[u].data(), b[u].data(), a[u].size() * sizeof(float)), 0) << u;
    ASSERT_EQ(std::memcmp(a[u].data(), c[u].data(), a[u].size() * sizeof(float)), 0) << u;
  }
}

TEST(GptGradTest, InitialLossIsNearLogVocab) {
  const ModelSpec spec = TinySpec();
  CpuGpt<float> model = MakeModel<float>(spec);
  const float loss = LossAndGradients(model, InitialWeights<float>(spec), nullptr).value();
  // Logits start with a standard deviation of about 0.02 * sqrt(d_model) =
  // 0.08, which raises the expected loss above log(V) by about 0.08^2 / 2.
  EXPECT_NEAR(loss, std::log(static_cast<double>(GptConfigFromSpec(spec).value().vocab)), 0.02);
}

TEST(GptGradTest, RejectsBadArguments) {
  const ModelSpec spec = TinySpec();
  EXPECT_FALSE(CpuGpt<float>::Create(spec, 0, 4).ok());
  EXPECT_FALSE(CpuGpt<float>::Create(spec, 2, 0).ok());
  EXPECT_FALSE(CpuGpt<float>::Create(spec, 2, GptConfigFromSpec(spec).value().context + 1).ok());
  ModelSpec truncated = spec;
  truncated.units.pop_back();
  EXPECT_FALSE(CpuGpt<float>::Create(truncated, 2, 4).ok());

  CpuGpt<float> model = CpuGpt<float>::Create(spec, 2, 4).value();
  const std::vector<int32_t> ok(8, 3);
  EXPECT_TRUE(model.SetBatch(ok, ok).ok());
  EXPECT_EQ(model.SetBatch(std::vector<int32_t>(7, 3), ok).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<int32_t> bad = ok;
  bad[5] = GptConfigFromSpec(spec).value().vocab;
  EXPECT_EQ(model.SetBatch(ok, bad).code(), absl::StatusCode::kInvalidArgument);
  bad[5] = -1;
  EXPECT_EQ(model.SetBatch(bad, ok).code(), absl::StatusCode::kInvalidArgument);

  const std::vector<std::vector<float>> weights = InitialWeights<float>(spec);
  std::vector<std::vector<float>> too_few(weights.begin(), weights.end() - 1);
  EXPECT_FALSE(LossAndGradients(model, too_few, nullptr).ok());
}

TEST(GptGradDeathTest, UnitsOutOfOrderAbort) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // BLAS may have started threads
  const ModelSpec spec = TinySpec();
  CpuGpt<float> model = MakeModel<float>(spec);
  const std::vector<std::vector<float>> weights = InitialWeights<float>(spec);
  std::vector<float> grads(spec.units[1].numel);
  EXPECT_DEATH(model.ForwardUnit(2, weights[2]), "out of order");
  EXPECT_DEATH(model.BackwardUnit(1, weights[1], grads), "out of order");
  // A new batch invalidates the saved activations of a finished forward.
  for (int u = 0; u < model.num_units(); ++u) model.ForwardUnit(u, weights[u]);
  const std::vector<int32_t> batch(kBatch * kSeqLen, 1);
  ASSERT_TRUE(model.SetBatch(batch, batch).ok());
  std::vector<float> head_grads(spec.units.back().numel);
  EXPECT_DEATH(model.BackwardUnit(model.num_units() - 1, weights.back(), head_grads),
               "out of order");
}

TEST(GptGradTest, FlopsAndBytes) {
  const ModelSpec spec = TinySpec();
  CpuGpt<float> model = MakeModel<float>(spec);
  const double c = 16, tokens = kBatch * kSeqLen;
  const double expected =
      6.0 * (2 * 12 * c * c + 64 * c) * tokens + 12.0 * 2 * kBatch * kSeqLen * kSeqLen * c;
  EXPECT_DOUBLE_EQ(model.FlopsPerMicroBatch(), expected);
  // At least the saved residual stream of every unit boundary.
  EXPECT_GT(model.ActivationBytes(), 3 * tokens * c * sizeof(float));
}

}  // namespace
}  // namespace pshard
