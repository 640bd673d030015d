// CpuGpt with activation recomputation: bit-identical losses and gradients,
// the activation memory it saves and the FLOPs and time it costs.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/model_spec.h"
#include "common/rng.h"
#include "trainer_client/model/gpt.h"
#include "trainer_client/model/gpt_layout.h"

namespace pshard {
namespace {

constexpr uint64_t kSeed = 91;

GptConfig Config(int layers, int d_model, int heads, int context, int vocab) {
  GptConfig cfg;
  cfg.num_layers = layers;
  cfg.d_model = d_model;
  cfg.num_heads = heads;
  cfg.context = context;
  cfg.vocab = vocab;
  return cfg;
}

// 3 layers: the last block reuses the scratch its forward left, the others
// are recomputed.
GptConfig SmallConfig() { return Config(3, 16, 2, 8, 64); }
// The demo model of `pshard local`.
GptConfig DemoConfig() { return Config(4, 128, 4, 64, 256); }
// GPT-2 124M's shape over a byte vocabulary.
GptConfig Gpt2SmallConfig() { return Config(12, 768, 12, 1024, 256); }

ModelSpec Spec(const GptConfig& cfg) {
  absl::StatusOr<ModelSpec> spec = MakeGptSpec(cfg);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

template <typename T>
CpuGpt<T> Model(const ModelSpec& spec, int batch, int seq_len, bool recompute) {
  absl::StatusOr<CpuGpt<T>> model = CpuGpt<T>::Create(spec, batch, seq_len, recompute);
  EXPECT_TRUE(model.ok()) << model.status();
  return std::move(*model);
}

// Weights away from the initialisation, so every gradient term is sizeable.
template <typename T>
std::vector<std::vector<T>> RandomWeights(const ModelSpec& spec) {
  std::vector<std::vector<T>> weights;
  for (const UnitSpec& unit : spec.units) {
    std::vector<T> w(unit.numel);
    for (const TensorSpec& t : unit.tensors) {
      const double base = t.init == InitKind::kOnes ? 1.0 : 0.0;
      for (int64_t i = 0; i < t.numel; ++i) {
        w[t.offset + i] = static_cast<T>(base + 0.2 * NormalAt(kSeed, 1000 + t.rng_stream, i));
      }
    }
    weights.push_back(std::move(w));
  }
  return weights;
}

std::vector<int32_t> RandomTokens(int n, int vocab, uint64_t stream) {
  std::vector<int32_t> tokens(n);
  for (int i = 0; i < n; ++i)
    tokens[i] = static_cast<int32_t>(CounterHash(kSeed, stream, i) % vocab);
  return tokens;
}

// One micro-batch (tokens from `stream`), unit by unit as the trainer runs
// it; returns the loss and fills one gradient vector per unit.
template <typename T>
T RunMicroBatch(CpuGpt<T>& model, const ModelSpec& spec, int rows, uint64_t stream,
                const std::vector<std::vector<T>>& weights, std::vector<std::vector<T>>* grads) {
  const int vocab = GptConfigFromSpec(spec).value().vocab;
  EXPECT_TRUE(
      model.SetBatch(RandomTokens(rows, vocab, stream), RandomTokens(rows, vocab, stream + 1))
          .ok());
  const int units = model.num_units();
  for (int u = 0; u < units; ++u) model.ForwardUnit(u, weights[u]);
  grads->assign(units, {});
  for (int u = units - 1; u >= 0; --u) {
    (*grads)[u].assign(spec.units[u].numel, T(0));
    model.BackwardUnit(u, weights[u], (*grads)[u]);
  }
  return model.loss();
}

template <typename T>
class GptRecomputeTest : public ::testing::Test {};
using Precisions = ::testing::Types<float, double>;
TYPED_TEST_SUITE(GptRecomputeTest, Precisions);

TYPED_TEST(GptRecomputeTest, LossAndGradientsAreBitIdentical) {
  using T = TypeParam;
  const ModelSpec spec = Spec(SmallConfig());
  constexpr int kBatch = 2, kSeqLen = 7;
  CpuGpt<T> kept = Model<T>(spec, kBatch, kSeqLen, false);
  CpuGpt<T> recomputed = Model<T>(spec, kBatch, kSeqLen, true);
  EXPECT_FALSE(kept.recompute_blocks());
  EXPECT_TRUE(recomputed.recompute_blocks());
  const std::vector<std::vector<T>> weights = RandomWeights<T>(spec);
  // Two micro-batches in a row: the second must not see the first's scratch.
  for (uint64_t stream : {1, 3}) {
    std::vector<std::vector<T>> expected, actual;
    const T expected_loss = RunMicroBatch(kept, spec, kBatch * kSeqLen, stream, weights, &expected);
    const T actual_loss =
        RunMicroBatch(recomputed, spec, kBatch * kSeqLen, stream, weights, &actual);
    EXPECT_EQ(actual_loss, expected_loss) << "micro-batch " << stream;
    ASSERT_EQ(actual.size(), expected.size());
    for (size_t u = 0; u < expected.size(); ++u) {
      ASSERT_EQ(actual[u].size(), expected[u].size());
      for (size_t i = 0; i < expected[u].size(); ++i) {
        ASSERT_EQ(actual[u][i], expected[u][i]) << spec.units[u].name << " element " << i;
      }
    }
  }
}

// Bytes of the internals of one block: what recomputation stops keeping for
// all blocks but one (see CpuGpt::BlockActivations).
int64_t BlockInternalsBytes(const GptConfig& cfg, int batch, int seq_len, int64_t element_bytes) {
  const int64_t n = int64_t{batch} * seq_len;
  const int64_t c = cfg.d_model;
  // ln1, qkv, atty, residual2, ln2, fch and fch_gelu; 2 LayerNorms' mean and rstd.
  const int64_t per_row = 15 * c + 4;
  const int64_t att = int64_t{batch} * cfg.num_heads * seq_len * seq_len;
  return (n * per_row + att) * element_bytes;
}

void ExpectAndPrintActivationBytes(const char* name, const GptConfig& cfg, int batch, int seq_len) {
  const ModelSpec spec = Spec(cfg);
  const int64_t kept = Model<float>(spec, batch, seq_len, false).ActivationBytes();
  const int64_t recomputed = Model<float>(spec, batch, seq_len, true).ActivationBytes();
  EXPECT_EQ(kept - recomputed,
            (cfg.num_layers - 1) * BlockInternalsBytes(cfg, batch, seq_len, sizeof(float)));
  std::printf(
      "%s (%d layers, width %d, %d heads, batch %d x %d tokens, float): activations %.1f MiB kept, "
      "%.1f MiB with recomputation (%.1fx less)\n",
      name, cfg.num_layers, cfg.d_model, cfg.num_heads, batch, seq_len, kept / 1048576.0,
      recomputed / 1048576.0, static_cast<double>(kept) / recomputed);
}

TEST(GptRecomputeMemoryTest, ActivationBytesDropToOneBlocksInternals) {
  ExpectAndPrintActivationBytes("demo", DemoConfig(), 8, 64);
  // Allocated by Create and reported before anything runs.
  ExpectAndPrintActivationBytes("GPT-2-124M-like", Gpt2SmallConfig(), 1, 1024);
}

// The planner's figure (GptActivationBytes) is what the model allocates,
// with and without recomputation, for odd and even shapes.
TEST(GptRecomputeMemoryTest, TheActivationFormulaIsWhatTheModelAllocates) {
  for (const GptConfig& cfg : {SmallConfig(), DemoConfig(), Config(1, 24, 3, 16, 40), Config(5, 32, 4, 32, 256)}) {
    const ModelSpec spec = Spec(cfg);
    for (const auto& [batch, seq_len] : {std::pair{1, 1}, std::pair{3, 7}, std::pair{2, cfg.context}}) {
      for (bool recompute : {false, true}) {
        SCOPED_TRACE(absl::StrCat(cfg.num_layers, " layers, width ", cfg.d_model, ", batch ", batch, " x ",
                                  seq_len, recompute ? ", recomputed" : ""));
        EXPECT_EQ(GptActivationBytes(cfg, batch, seq_len, recompute),
                  Model<float>(spec, batch, seq_len, recompute).ActivationBytes());
      }
    }
  }
}

TEST(GptRecomputeFlopsTest, ModelFlopsUnchangedRecomputeFlopsCounted) {
  const GptConfig cfg = DemoConfig();
  const ModelSpec spec = Spec(cfg);
  constexpr int kBatch = 8, kSeqLen = 64;
  const CpuGpt<float> kept = Model<float>(spec, kBatch, kSeqLen, false);
  const CpuGpt<float> recomputed = Model<float>(spec, kBatch, kSeqLen, true);
  EXPECT_EQ(recomputed.FlopsPerMicroBatch(), kept.FlopsPerMicroBatch());
  EXPECT_EQ(kept.RecomputeFlopsPerMicroBatch(), 0.0);
  // L-1 blocks rerun qkv, attention projection and fc (8 C^2 weights) and
  // the attention products.
  const double c = cfg.d_model, tokens = kBatch * kSeqLen;
  const double per_block = 2 * 8 * c * c * tokens + 4.0 * kBatch * kSeqLen * kSeqLen * c;
  EXPECT_DOUBLE_EQ(recomputed.RecomputeFlopsPerMicroBatch(), (cfg.num_layers - 1) * per_block);
  std::printf("demo: %.3f GFLOP model + %.3f GFLOP recomputed per micro-batch (+%.1f%%)\n",
              kept.FlopsPerMicroBatch() / 1e9, recomputed.RecomputeFlopsPerMicroBatch() / 1e9,
              100.0 * recomputed.RecomputeFlopsPerMicroBatch() / kept.FlopsPerMicroBatch());
}

}  // namespace
}  // namespace pshard
