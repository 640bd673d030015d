// The CUDA GPT against the CPU model (same bf16-rounded weights and batch):
// loss and every tensor of every unit's gradient; bit-identical reruns, also
// across streams; the bf16 conversion kernels against common/bf16.h; misuse.
// Every test skips on machines without a CUDA device.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "common/bf16.h"
#include "common/model_spec.h"
#include "common/rng.h"
#include "trainer_client/model/cuda/cuda_gpt.h"
#include "trainer_client/model/cuda/kernels.h"
#include "trainer_client/model/gpt.h"

namespace pshard {
namespace {

using bf16 = __nv_bfloat16;

constexpr uint64_t kSeed = 2024;
constexpr int kBatch = 4;
constexpr int kSeqLen = 32;
constexpr int64_t kPadding = 5;  // elements after each unit's weights and gradients

GptConfig SmallConfig() {
  GptConfig cfg;
  cfg.num_layers = 2;
  cfg.d_model = 64;
  cfg.num_heads = 4;
  cfg.context = 32;
  cfg.vocab = 256;
  return cfg;
}

ModelSpec SmallSpec() {
  absl::StatusOr<ModelSpec> spec = MakeGptSpec(SmallConfig());
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

// Head size 64, the fused attention's, and sequences of 80 tokens: one full
// 64-token tile and a partial one.
constexpr int kAttentionSeqLen = 80;

ModelSpec AttentionSpec() {
  GptConfig cfg = SmallConfig();
  cfg.d_model = 128;
  cfg.num_heads = 2;
  cfg.context = kAttentionSeqLen;
  absl::StatusOr<ModelSpec> spec = MakeGptSpec(cfg);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

CudaGptOptions Options(int seq_len = kSeqLen, CudaAttention attention = CudaAttention::kAuto,
                       bool recompute_blocks = false) {
  CudaGptOptions options;
  options.batch = kBatch;
  options.seq_len = seq_len;
  options.recompute_blocks = recompute_blocks;
  options.attention = attention;
  return options;
}

// Device memory for `count` elements of T, freed on scope exit.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(int64_t count) : count_(count) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&data_), bytes()), cudaSuccess);
  }
  ~DeviceArray() {
    if (data_ != nullptr) cudaFree(data_);
  }
  DeviceArray(DeviceArray&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), count_(other.count_) {}
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return data_; }
  size_t bytes() const { return static_cast<size_t>(count_) * sizeof(T); }
  // Copies bytes() bytes from / to host memory.
  void Upload(const void* host) {
    EXPECT_EQ(cudaMemcpy(data_, host, bytes(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  void Download(void* host) const {
    EXPECT_EQ(cudaMemcpy(host, data_, bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
  }

 private:
  T* data_ = nullptr;
  int64_t count_;
};

// Weights away from the initialisation (LayerNorm gains off 1, biases off 0,
// larger matrices) so every term of every gradient is sizeable; rounded to
// bf16, the format the GPU model reads, so both models see the same values.
std::vector<std::vector<float>> Bf16Weights(const ModelSpec& spec) {
  std::vector<std::vector<float>> weights;
  for (const UnitSpec& unit : spec.units) {
    std::vector<float> w(unit.numel);
    for (const TensorSpec& t : unit.tensors) {
      for (int64_t i = 0; i < t.numel; ++i) {
        const double base = t.init == InitKind::kOnes ? 1.0 : 0.0;
        w[t.offset + i] = static_cast<float>(base + 0.1 * NormalAt(kSeed, 1000 + t.rng_stream, i));
      }
    }
    RoundToBf16InPlace(w);
    weights.push_back(std::move(w));
  }
  return weights;
}

std::vector<int32_t> RandomTokens(int n, int vocab, uint64_t stream) {
  std::vector<int32_t> tokens(n);
  for (int i = 0; i < n; ++i) {
    tokens[i] = static_cast<int32_t>(CounterHash(kSeed, stream, i) % vocab);
  }
  return tokens;
}

// The weights on the device as bf16, each unit followed by kPadding NaNs
// that the model must ignore.
std::vector<DeviceArray<bf16>> UploadWeights(const std::vector<std::vector<float>>& weights) {
  std::vector<DeviceArray<bf16>> device;
  for (const std::vector<float>& w : weights) {
    std::vector<uint16_t> bits(w.size() + kPadding, FloatToBf16(std::nanf("")));
    EncodeBf16(w, bits);
    device.emplace_back(static_cast<int64_t>(bits.size()));
    device.back().Upload(bits.data());
  }
  return device;
}

struct GpuResult {
  float loss = 0;
  std::vector<std::vector<float>> grads;  // per unit, numel + kPadding
};

// A full forward and backward on the device; units alternate between
// `streams` (one stream: all on it). Gradient padding is pre-filled with a
// sentinel, 7.0, which must survive.
void RunGpu(CudaGpt& model, const ModelSpec& spec, const std::vector<DeviceArray<bf16>>& weights,
            const std::vector<cudaStream_t>& streams, GpuResult* result) {
  const int units = static_cast<int>(spec.units.size());
  auto stream = [&](int unit) { return streams[unit % streams.size()]; };
  for (int u = 0; u < units; ++u) {
    ASSERT_TRUE(model.ForwardUnit(u, weights[u].get(), stream(u)).ok()) << "unit " << u;
  }
  absl::StatusOr<float> loss = model.Loss(stream(units - 1));
  ASSERT_TRUE(loss.ok()) << loss.status();
  result->loss = *loss;
  result->grads.assign(units, {});
  for (int u = units - 1; u >= 0; --u) {
    std::vector<float>& g = result->grads[u];
    g.assign(spec.units[u].numel + kPadding, 7.0f);
    DeviceArray<float> grads(static_cast<int64_t>(g.size()));
    grads.Upload(g.data());
    const absl::Status status = model.BackwardUnit(u, weights[u].get(), grads.get(), stream(u));
    ASSERT_TRUE(status.ok()) << "unit " << u << ": " << status;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    grads.Download(g.data());
    for (int64_t i = spec.units[u].numel; i < static_cast<int64_t>(g.size()); ++i) {
      ASSERT_EQ(g[i], 7.0f) << "unit " << u << " gradient padding written at " << i;
    }
  }
}

std::unique_ptr<CudaGpt> MakeGpuModel(const ModelSpec& spec, const CudaGptOptions& options = Options()) {
  absl::StatusOr<std::unique_ptr<CudaGpt>> model = CudaGpt::Create(spec, options);
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return nullptr;
  const int n = options.batch * options.seq_len;
  const absl::Status status = (*model)->SetBatch(RandomTokens(n, GptConfigFromSpec(spec).value().vocab, 1),
                                                 RandomTokens(n, GptConfigFromSpec(spec).value().vocab, 2));
  EXPECT_TRUE(status.ok()) << status;
  return std::move(*model);
}

double L2(const float* a, const float* b, int64_t n) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = b == nullptr ? a[i] : static_cast<double>(a[i]) - b[i];
    sum += d * d;
  }
  return std::sqrt(sum);
}

// The GPU model's loss and every gradient tensor against the CPU fp32 model
// on the same bf16-rounded weights and batch.
void ExpectMatchesCpuModel(const ModelSpec& spec, const CudaGptOptions& options, GpuResult* gpu_result = nullptr) {
  const std::vector<std::vector<float>> weights = Bf16Weights(spec);

  absl::StatusOr<CpuGpt<float>> cpu = CpuGpt<float>::Create(spec, options.batch, options.seq_len);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const int n = options.batch * options.seq_len;
  ASSERT_TRUE(
      cpu->SetBatch(RandomTokens(n, GptConfigFromSpec(spec).value().vocab, 1), RandomTokens(n, GptConfigFromSpec(spec).value().vocab, 2))
          .ok());
  std::vector<std::vector<float>> cpu_grads;
  absl::StatusOr<float> cpu_loss = LossAndGradients(*cpu, weights, &cpu_grads);
  ASSERT_TRUE(cpu_loss.ok()) << cpu_loss.status();

  std::unique_ptr<CudaGpt> gpu = MakeGpuModel(spec, options);
  ASSERT_NE(gpu, nullptr);
  const std::vector<DeviceArray<bf16>> device_weights = UploadWeights(weights);
  GpuResult result;
  ASSERT_NO_FATAL_FAILURE(RunGpu(*gpu, spec, device_weights, {nullptr}, &result));

  // The GPU rounds every activation (and activation gradient) to bf16, a
  // relative error of at most 2^-9 = 0.2% each. The loss (about 5.9 here)
  // moves by the logits' error, a few such roundings of logits of order 1,
  // averaged over 128 rows. A CPU emulation of exactly these rounding points
  // (same weights and batch) moved it by 9.4e-4, so 1e-2 leaves a 10x margin.
  std::printf("loss: cpu %.6f gpu %.6f\n", *cpu_loss, result.loss);
  EXPECT_NEAR(result.loss, *cpu_loss, 1e-2);

  // A gradient tensor goes through about ten such roundings on its way back
  // from the loss (more for block 0), some after cancellations (LayerNorm
  // and softmax backward subtract means). The CPU emulation of the GPU's
  // rounding points gave relative L2 errors of 1.6e-3 .. 8.4e-3 per tensor,
  // so 2e-2 leaves a 2.4x margin for summation order and libm differences,
  // while a missing or wrong term (a transpose, a scale, a lost residual
  // path) gives errors of order 1. The errors are printed to retune.
  constexpr double kGradTolerance = 2e-2;
  for (size_t u = 0; u < spec.units.size(); ++u) {
    for (const TensorSpec& t : spec.units[u].tensors) {
      const float* want = cpu_grads[u].data() + t.offset;
      const float* got = result.grads[u].data() + t.offset;
      const double norm = L2(want, nullptr, t.numel);
      const double error = L2(got, want, t.numel) / norm;
      std::printf("%-22s |grad| %.3e  relative L2 error %.2e\n", t.name.c_str(), norm, error);
      EXPECT_LT(error, kGradTolerance) << t.name << " (|grad| " << norm << ")";
    }
  }
  if (gpu_result != nullptr) *gpu_result = std::move(result);
}

// The planner's figure for a GPU trainer (GptGpuActivationBytes, written
// out piece by piece) is what the model lays out, for either attention and
// with or without recomputation; no device needed.
TEST(CudaGptAllocation, ThePlannersFigureIsWhatTheModelLaysOut) {
  struct Case {
    int layers, d_model, heads, batch, seq_len;
    bool recompute;
    CudaAttention attention;
  };
  for (const Case& c : {Case{2, 64, 2, 2, 16, false, CudaAttention::kAuto},
                        Case{3, 128, 2, 3, 80, false, CudaAttention::kAuto},
                        Case{3, 128, 2, 3, 80, true, CudaAttention::kAuto},
                        Case{3, 128, 2, 3, 80, false, CudaAttention::kMaterialized},
                        Case{4, 96, 3, 1, 33, true, CudaAttention::kMaterialized},
                        Case{12, 768, 12, 4, 1024, true, CudaAttention::kFused}}) {
    GptConfig cfg = SmallConfig();
    cfg.num_layers = c.layers;
    cfg.d_model = c.d_model;
    cfg.num_heads = c.heads;
    cfg.context = c.seq_len;
    absl::StatusOr<ModelSpec> spec = MakeGptSpec(cfg);
    ASSERT_TRUE(spec.ok()) << spec.status();
    CudaGptOptions options;
    options.batch = c.batch;
    options.seq_len = c.seq_len;
    options.recompute_blocks = c.recompute;
    options.attention = c.attention;
    absl::StatusOr<CudaGpt::Allocation> laid_out = CudaGpt::PlanAllocation(*spec, options);
    ASSERT_TRUE(laid_out.ok()) << laid_out.status();
    const bool fused = c.attention == CudaAttention::kFused ||
                       (c.attention == CudaAttention::kAuto && c.d_model / c.heads == 64);
    EXPECT_EQ(GptGpuFusesAttention(cfg), c.d_model / c.heads == 64);
    const GpuActivationBytes planned = GptGpuActivationBytes(cfg, c.batch, c.seq_len, c.recompute, fused);
    EXPECT_EQ(planned.lane, laid_out->lane) << c.layers << "x" << c.d_model << " recompute " << c.recompute;
    EXPECT_EQ(planned.workspace, laid_out->workspace) << c.layers << "x" << c.d_model << " recompute " << c.recompute;
  }
}

TEST(CudaGptTest, ThePlannedAllocationIsWhatCreateAllocates) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  for (bool recompute : {false, true}) {
    const CudaGptOptions options = Options(kAttentionSeqLen, CudaAttention::kAuto, recompute);
    absl::StatusOr<std::unique_ptr<CudaGpt>> model = CudaGpt::Create(AttentionSpec(), options);
    ASSERT_TRUE(model.ok()) << model.status();
    absl::StatusOr<CudaGpt::Allocation> planned = CudaGpt::PlanAllocation(AttentionSpec(), options);
    ASSERT_TRUE(planned.ok()) << planned.status();
    EXPECT_EQ((*model)->ActivationBytes(), planned->lane + planned->workspace) << "recompute " << recompute;
  }
}

TEST(CudaGptTest, LossAndGradientsMatchCpuModel) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  ExpectMatchesCpuModel(SmallSpec(), Options());
}

// Head size 64 and a partial last tile: the fused attention (no T×T
// matrices, online softmax, probabilities recomputed in backward) and the
// materialized one both match the CPU model, and the fused one reruns
// bit-identically.
TEST(CudaGptTest, FusedAndMaterializedAttentionMatchCpuModel) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const ModelSpec spec = AttentionSpec();
  GpuResult fused, materialized;
  std::printf("fused attention:\n");
  ASSERT_NO_FATAL_FAILURE(
      ExpectMatchesCpuModel(spec, Options(kAttentionSeqLen, CudaAttention::kFused), &fused));
  std::printf("materialized attention:\n");
  ASSERT_NO_FATAL_FAILURE(
      ExpectMatchesCpuModel(spec, Options(kAttentionSeqLen, CudaAttention::kMaterialized), &materialized));
  std::unique_ptr<CudaGpt> again = MakeGpuModel(spec, Options(kAttentionSeqLen, CudaAttention::kFused));
  ASSERT_NE(again, nullptr);
  EXPECT_TRUE(again->fused_attention());
  GpuResult rerun;
  ASSERT_NO_FATAL_FAILURE(RunGpu(*again, spec, UploadWeights(Bf16Weights(spec)), {nullptr}, &rerun));
  EXPECT_EQ(std::memcmp(&rerun.loss, &fused.loss, sizeof(float)), 0);
  for (size_t u = 0; u < spec.units.size(); ++u) {
    EXPECT_EQ(std::memcmp(rerun.grads[u].data(), fused.grads[u].data(), fused.grads[u].size() * sizeof(float)), 0)
        << "unit " << u;
  }
  // No [B,H,T,T] probabilities kept, no T×T scratch.
  std::unique_ptr<CudaGpt> kept = MakeGpuModel(spec, Options(kAttentionSeqLen, CudaAttention::kMaterialized));
  ASSERT_NE(kept, nullptr);
  EXPECT_LT(again->ActivationBytes(), kept->ActivationBytes());
}

TEST(CudaGptTest, RunsAreBitIdenticalOnOneOrSeveralStreams) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const ModelSpec spec = SmallSpec();
  const std::vector<DeviceArray<bf16>> weights = UploadWeights(Bf16Weights(spec));
  std::unique_ptr<CudaGpt> model = MakeGpuModel(spec);
  ASSERT_NE(model, nullptr);
  cudaStream_t streams[2];
  for (cudaStream_t& s : streams) {
    ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  }

  GpuResult first;
  ASSERT_NO_FATAL_FAILURE(RunGpu(*model, spec, weights, {streams[0]}, &first));
  // Another batch in between, so nothing can be left over from the first.
  const int n = kBatch * kSeqLen;
  ASSERT_TRUE(
      model->SetBatch(RandomTokens(n, GptConfigFromSpec(spec).value().vocab, 3), RandomTokens(n, GptConfigFromSpec(spec).value().vocab, 4))
          .ok());
  GpuResult other;
  ASSERT_NO_FATAL_FAILURE(RunGpu(*model, spec, weights, {streams[0]}, &other));
  EXPECT_NE(other.loss, first.loss);
  ASSERT_TRUE(
      model->SetBatch(RandomTokens(n, GptConfigFromSpec(spec).value().vocab, 1), RandomTokens(n, GptConfigFromSpec(spec).value().vocab, 2))
          .ok());
  GpuResult again;
  ASSERT_NO_FATAL_FAILURE(RunGpu(*model, spec, weights, {streams[0]}, &again));
  // Alternating streams: the model orders its own work across them.
  GpuResult two_streams;
  ASSERT_NO_FATAL_FAILURE(RunGpu(*model, spec, weights, {streams[0], streams[1]}, &two_streams));

  for (const GpuResult* run : {&again, &two_streams}) {
    const char* what = run == &again ? "rerun" : "two streams";
    EXPECT_EQ(std::memcmp(&run->loss, &first.loss, sizeof(float)), 0) << what;
    for (size_t u = 0; u < spec.units.size(); ++u) {
      ASSERT_EQ(run->grads[u].size(), first.grads[u].size());
      EXPECT_EQ(std::memcmp(run->grads[u].data(), first.grads[u].data(),
                            first.grads[u].size() * sizeof(float)),
                0)
          << what << ": unit " << u << " gradients differ";
    }
  }
  for (cudaStream_t s : streams) cudaStreamDestroy(s);
}

// Recomputing each block's internals in backward reruns exactly the same
// kernels on the same inputs: bit-identical results for less memory.
TEST(CudaGptTest, RecomputedBlocksGiveBitIdenticalResultsInLessMemory) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  for (const bool fused : {false, true}) {
    const ModelSpec spec = fused ? AttentionSpec() : SmallSpec();
    const int seq_len = fused ? kAttentionSeqLen : kSeqLen;
    const CudaAttention attention = fused ? CudaAttention::kFused : CudaAttention::kMaterialized;
    const std::vector<DeviceArray<bf16>> weights = UploadWeights(Bf16Weights(spec));
    std::unique_ptr<CudaGpt> kept = MakeGpuModel(spec, Options(seq_len, attention));
    std::unique_ptr<CudaGpt> recomputed = MakeGpuModel(spec, Options(seq_len, attention, /*recompute_blocks=*/true));
    ASSERT_NE(kept, nullptr);
    ASSERT_NE(recomputed, nullptr);
    GpuResult want, got;
    ASSERT_NO_FATAL_FAILURE(RunGpu(*kept, spec, weights, {nullptr}, &want));
    ASSERT_NO_FATAL_FAILURE(RunGpu(*recomputed, spec, weights, {nullptr}, &got));
    EXPECT_EQ(std::memcmp(&got.loss, &want.loss, sizeof(float)), 0) << (fused ? "fused" : "materialized");
    for (size_t u = 0; u < spec.units.size(); ++u) {
      EXPECT_EQ(std::memcmp(got.grads[u].data(), want.grads[u].data(), want.grads[u].size() * sizeof(float)), 0)
          << (fused ? "fused" : "materialized") << ": unit " << u << " gradients differ";
    }
    // One block's internals instead of two.
    std::printf("%s attention, activation bytes: kept %lld, recomputed %lld\n", fused ? "fused" : "materialized",
                static_cast<long long>(kept->ActivationBytes()),
                static_cast<long long>(recomputed->ActivationBytes()));
    EXPECT_LT(recomputed->ActivationBytes(), kept->ActivationBytes());
  }
}

TEST(CudaGptTest, Bf16ConversionMatchesHost) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  std::vector<float> values = {0.0f,
                               -0.0f,
                               1.0f,
                               -2.5f,
                               std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::max(),  // rounds up to inf
                               std::numeric_limits<float>::denorm_min(),
                               std::nanf(""),
                               -std::nanf("")};
  // Ties: exactly halfway between two bf16 values, below and above an even one.
  for (uint32_t bits : {0x3f808000u, 0x3f818000u, 0xbf808000u, 0x3f808001u, 0x7fc00001u}) {
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    values.push_back(f);
  }
  for (int i = 0; i < 1000; ++i) {
    values.push_back(static_cast<float>(NormalAt(kSeed, 9, i) * std::pow(10.0, i % 20 - 10)));
  }
  const int64_t count = static_cast<int64_t>(values.size());
  std::vector<uint16_t> want(count);
  EncodeBf16(values, want);

  DeviceArray<float> in(count);
  DeviceArray<bf16> out(count);
  DeviceArray<float> back(count);
  in.Upload(values.data());
  ASSERT_EQ(internal::Fp32ToBf16(out.get(), in.get(), count, nullptr), cudaSuccess);
  ASSERT_EQ(internal::Bf16ToFp32(back.get(), out.get(), count, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> got(count);
  std::vector<float> widened(count);
  out.Download(got.data());
  back.Download(widened.data());
  for (int64_t i = 0; i < count; ++i) {
    EXPECT_EQ(got[i], want[i]) << "value " << values[i] << " (index " << i << ")";
    const float exact = Bf16ToFloat(want[i]);
    EXPECT_EQ(std::memcmp(&widened[i], &exact, sizeof(float)), 0) << "index " << i;
  }
}

TEST(CudaGptTest, ReportsMisuse) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const ModelSpec spec = SmallSpec();
  EXPECT_EQ(CudaGpt::Create(spec, Options(GptConfigFromSpec(spec).value().context + 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  CudaGptOptions no_batch = Options();
  no_batch.batch = 0;
  EXPECT_EQ(CudaGpt::Create(spec, no_batch).status().code(), absl::StatusCode::kInvalidArgument);
  // Head size 16: the fused attention does not apply.
  EXPECT_EQ(CudaGpt::Create(spec, Options(kSeqLen, CudaAttention::kFused)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseCudaAttention("flash").status().code(), absl::StatusCode::kInvalidArgument);

  absl::StatusOr<std::unique_ptr<CudaGpt>> model = CudaGpt::Create(spec, Options());
  ASSERT_TRUE(model.ok()) << model.status();
  CudaGpt& gpt = **model;
  const std::vector<DeviceArray<bf16>> weights = UploadWeights(Bf16Weights(spec));
  DeviceArray<float> grads(spec.units[0].numel);
  EXPECT_EQ(gpt.ForwardUnit(0, weights[0].get(), nullptr).code(),
            absl::StatusCode::kFailedPrecondition);  // no batch yet

  const int n = kBatch * kSeqLen;
  std::vector<int32_t> tokens = RandomTokens(n, GptConfigFromSpec(spec).value().vocab, 1);
  std::vector<int32_t> targets = RandomTokens(n, GptConfigFromSpec(spec).value().vocab, 2);
  EXPECT_EQ(gpt.SetBatch(std::span(tokens).first(n - 1), targets).code(),
            absl::StatusCode::kInvalidArgument);
  tokens[5] = GptConfigFromSpec(spec).value().vocab;
  EXPECT_EQ(gpt.SetBatch(tokens, targets).code(), absl::StatusCode::kInvalidArgument);
  tokens[5] = 0;
  ASSERT_TRUE(gpt.SetBatch(tokens, targets).ok());

  EXPECT_EQ(gpt.Loss(nullptr).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(gpt.BackwardUnit(0, weights[0].get(), grads.get(), nullptr).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(gpt.ForwardUnit(1, weights[1].get(), nullptr).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(gpt.ForwardUnit(0, nullptr, nullptr).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(gpt.ForwardUnit(0, weights[0].get(), nullptr).ok());
  EXPECT_EQ(gpt.ForwardUnit(2, weights[2].get(), nullptr).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(gpt.Loss(nullptr).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST(CudaGptTest, CountsFlopsAndBytesLikeTheCpuModel) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const ModelSpec spec = SmallSpec();
  absl::StatusOr<CpuGpt<float>> cpu = CpuGpt<float>::Create(spec, kBatch, kSeqLen);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  absl::StatusOr<std::unique_ptr<CudaGpt>> gpu = CudaGpt::Create(spec, Options());
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  EXPECT_EQ((*gpu)->FlopsPerMicroBatch(), cpu->FlopsPerMicroBatch());
  // bf16 activations plus fp32 attention scores and the cuBLAS workspace.
  EXPECT_GT((*gpu)->ActivationBytes(), int64_t{32} << 20);
  EXPECT_LT((*gpu)->ActivationBytes(), cpu->ActivationBytes() + (int64_t{64} << 20));
}

}  // namespace
}  // namespace pshard
