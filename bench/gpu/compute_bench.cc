// Compute benchmark of the CUDA GPT: forward + backward of one micro-batch
// with every unit's bf16 weights already on the device (no fetches, no
// copies), timed with CUDA events. Reports ms per iteration, tokens/s,
// TFLOP/s and MFU against --peak_tflops, for the model as trained and with
// blocks recomputed (activation memory saved, time it costs); then runs
// PyTorch eager on the same GPU (bench/gpu/torch_gpt.py: same model, batch
// and sequence length, bf16 weights, scaled_dot_product_attention) as the
// baseline and prints the tokens/s ratio. The last stdout line is JSON.
//
//   gpu_compute_bench [--layers=12 --d_model=768 --heads=12 --context=1024
//                      --batch=16 --seq_len=1024 --iters=20]
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/marshalling.h"

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/bf16.h"
#include "common/json.h"
#include "common/model_spec.h"
#include "common/rng.h"
#include "common/status_macros.h"
#include "trainer_client/model/cuda/cuda_check.h"
#include "trainer_client/model/cuda/cuda_gpt.h"

ABSL_FLAG(int, layers, 12, "transformer blocks");
ABSL_FLAG(int, d_model, 768, "model width");
ABSL_FLAG(int, heads, 12, "attention heads");
ABSL_FLAG(int, context, 1024, "maximum sequence length");
ABSL_FLAG(int, vocab, 256, "vocabulary (bytes)");
ABSL_FLAG(int, batch, 16, "sequences per micro-batch");
ABSL_FLAG(int, seq_len, 1024, "tokens per sequence");
ABSL_FLAG(int, warmup, 5, "untimed iterations first");
ABSL_FLAG(int, iters, 20, "timed iterations");
ABSL_FLAG(double, peak_tflops, 989.0, "the device's dense bf16 rate that MFU is taken against (H200 datasheet)");
ABSL_FLAG(int, device, 0, "CUDA device");
ABSL_FLAG(std::vector<std::string>, attention, std::vector<std::string>({"fused", "materialized"}),
          "attention kernels to time (the first is also timed with recomputation and compared with PyTorch)");
ABSL_FLAG(std::string, python, "python3", "python with torch for the baseline");
ABSL_FLAG(std::string, torch_script, PSHARD_TORCH_SCRIPT, "the PyTorch eager baseline (empty: skip it)");

namespace pshard {
namespace {

using bf16 = __nv_bfloat16;

struct Timing {
  double mean_ms = 0;
  double best_ms = 0;
  int64_t activation_bytes = 0;
  float loss = 0;
};

// Device buffers for every unit's weights (initialised as training starts)
// and gradients.
class DeviceUnits {
 public:
  static absl::StatusOr<DeviceUnits> Create(const ModelSpec& spec) {
    DeviceUnits units;
    for (const UnitSpec& unit : spec.units) {
      std::vector<float> w(unit.numel);
      InitializeUnitRange(unit, /*seed=*/1234, 0, w);
      std::vector<uint16_t> bits(unit.numel);
      EncodeBf16(w, bits);
      void* weights = nullptr;
      void* grads = nullptr;
      CUDA_RETURN_IF_ERROR(cudaMalloc(&weights, bits.size() * sizeof(uint16_t)));
      units.weights_.emplace_back(static_cast<bf16*>(weights));
      CUDA_RETURN_IF_ERROR(cudaMemcpy(weights, bits.data(), bits.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));
      CUDA_RETURN_IF_ERROR(cudaMalloc(&grads, unit.numel * sizeof(float)));
      units.grads_.emplace_back(static_cast<float*>(grads));
    }
    return units;
  }
  DeviceUnits() = default;
  DeviceUnits(DeviceUnits&&) = default;
  ~DeviceUnits() {
    for (bf16* w : weights_) cudaFree(w);
    for (float* g : grads_) cudaFree(g);
  }
  const bf16* weights(int unit) const { return weights_[unit]; }
  float* grads(int unit) const { return grads_[unit]; }

 private:
  std::vector<bf16*> weights_;
  std::vector<float*> grads_;
};

absl::Status Iteration(CudaGpt& model, const DeviceUnits& units, cudaStream_t stream) {
  const int k = model.num_units();
  for (int u = 0; u < k; ++u) RETURN_IF_ERROR(model.ForwardUnit(u, units.weights(u), stream));
  for (int u = k - 1; u >= 0; --u) RETURN_IF_ERROR(model.BackwardUnit(u, units.weights(u), units.grads(u), stream));
  return absl::OkStatus();
}

absl::StatusOr<Timing> Measure(const ModelSpec& spec, const DeviceUnits& units, CudaAttention attention,
                               bool recompute) {
  const int batch = absl::GetFlag(FLAGS_batch);
  const int seq_len = absl::GetFlag(FLAGS_seq_len);
  CudaGptOptions options;
  options.batch = batch;
  options.seq_len = seq_len;
  options.device = absl::GetFlag(FLAGS_device);
  options.recompute_blocks = recompute;
  options.attention = attention;
  ASSIGN_OR_RETURN(std::unique_ptr<CudaGpt> model, CudaGpt::Create(spec, options));
  std::vector<int32_t> tokens(static_cast<size_t>(batch) * seq_len), targets(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<int32_t>(CounterHash(7, 1, i) % GptConfigFromSpec(spec).value().vocab);
    targets[i] = static_cast<int32_t>(CounterHash(7, 2, i) % GptConfigFromSpec(spec).value().vocab);
  }
  RETURN_IF_ERROR(model->SetBatch(tokens, targets));
  cudaStream_t stream = nullptr;
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int i = 0; i < absl::GetFlag(FLAGS_warmup); ++i) RETURN_IF_ERROR(Iteration(*model, units, stream));
  const int iters = absl::GetFlag(FLAGS_iters);
  std::vector<cudaEvent_t> events(iters + 1);
  for (cudaEvent_t& e : events) CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
  CUDA_RETURN_IF_ERROR(cudaEventRecord(events[0], stream));
  for (int i = 0; i < iters; ++i) {
    RETURN_IF_ERROR(Iteration(*model, units, stream));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(events[i + 1], stream));
  }
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  Timing t;
  t.best_ms = 1e30;
  for (int i = 0; i < iters; ++i) {
    float ms = 0;
    CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, events[i], events[i + 1]));
    t.mean_ms += ms / iters;
    t.best_ms = std::min<double>(t.best_ms, ms);
  }
  ASSIGN_OR_RETURN(t.loss, model->Loss(stream));
  t.activation_bytes = model->ActivationBytes();
  for (cudaEvent_t e : events) cudaEventDestroy(e);
  cudaStreamDestroy(stream);
  return t;
}

// PyTorch eager on the same device: the JSON its script prints last.
absl::StatusOr<JsonValue> TorchBaseline(const GptConfig& cfg) {
  const std::string cmd = absl::StrCat(
      "CUDA_VISIBLE_DEVICES=", absl::GetFlag(FLAGS_device), " ", absl::GetFlag(FLAGS_python), " ",
      absl::GetFlag(FLAGS_torch_script), " --device=cuda --layers=", cfg.num_layers, " --d_model=", cfg.d_model,
      " --heads=", cfg.num_heads, " --context=", cfg.context, " --vocab=", cfg.vocab,
      " --batch=", absl::GetFlag(FLAGS_batch), " --seq_len=", absl::GetFlag(FLAGS_seq_len),
      " --warmup=", absl::GetFlag(FLAGS_warmup), " --iters=", absl::GetFlag(FLAGS_iters),
      " --peak_tflops=", absl::GetFlag(FLAGS_peak_tflops));
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return absl::InternalError(absl::StrCat("cannot run: ", cmd));
  std::string last, line;
  char buf[4096];
  while (fgets(buf, sizeof(buf), pipe) != nullptr) {
    line += buf;
    if (!line.empty() && line.back() == '\n') {
      if (line.size() > 1) last = line;
      line.clear();
    }
  }
  if (!line.empty()) last = line;
  const int rc = pclose(pipe);
  if (rc != 0) return absl::InternalError(absl::StrCat("the PyTorch baseline failed (status ", rc, "): ", cmd));
  return ParseJson(last);
}

double Number(const JsonValue& json, const std::string& key) {
  const JsonValue* v = json.Find(key);
  return v != nullptr && v->is_number() ? v->as_number() : 0.0;
}

int Run() {
  GptConfig cfg;
  cfg.num_layers = absl::GetFlag(FLAGS_layers);
  cfg.d_model = absl::GetFlag(FLAGS_d_model);
  cfg.num_heads = absl::GetFlag(FLAGS_heads);
  cfg.context = absl::GetFlag(FLAGS_context);
  cfg.vocab = absl::GetFlag(FLAGS_vocab);
  absl::StatusOr<ModelSpec> spec = MakeGptSpec(cfg);
  if (!spec.ok()) {
    std::fprintf(stderr, "gpu_compute_bench: %s\n", spec.status().ToString().c_str());
    return 2;
  }
  if (absl::GetFlag(FLAGS_iters) < 1 || absl::GetFlag(FLAGS_warmup) < 0) {
    std::fprintf(stderr, "gpu_compute_bench: need --iters >= 1 and --warmup >= 0\n");
    return 2;
  }
  if (cudaSetDevice(absl::GetFlag(FLAGS_device)) != cudaSuccess) {
    std::fprintf(stderr, "gpu_compute_bench: CUDA device %d is not usable\n", absl::GetFlag(FLAGS_device));
    return 1;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, absl::GetFlag(FLAGS_device));
  std::vector<CudaAttention> kinds;
  for (const std::string& name : absl::GetFlag(FLAGS_attention)) {
    absl::StatusOr<CudaAttention> kind = ParseCudaAttention(name);
    if (!kind.ok()) {
      std::fprintf(stderr, "gpu_compute_bench: --attention: %s\n", kind.status().ToString().c_str());
      return 2;
    }
    kinds.push_back(*kind);
  }
  if (kinds.empty()) {
    std::fprintf(stderr, "gpu_compute_bench: --attention names no kernel\n");
    return 2;
  }
  const int batch = absl::GetFlag(FLAGS_batch);
  const int seq_len = absl::GetFlag(FLAGS_seq_len);
  const double tokens = static_cast<double>(batch) * seq_len;
  const double flops = GptModelFlops(cfg, batch, seq_len);
  const double peak = absl::GetFlag(FLAGS_peak_tflops) * 1e12;
  const auto report = [&](const std::string& what, const Timing& t) {
    std::printf("%-34s: %8.2f ms/iter (best %.2f) | %10.0f tok/s | %6.1f TFLOP/s | MFU %5.1f%% | activations "
                "%.0f MiB | loss %.4f\n",
                what.c_str(), t.mean_ms, t.best_ms, tokens / (t.mean_ms / 1e3), flops / (t.mean_ms / 1e3) / 1e12,
                100.0 * flops / (t.mean_ms / 1e3) / peak, t.activation_bytes / 1048576.0, t.loss);
  };
  std::printf("CUDA GPT %d x %d, %d heads, vocab %d; batch %d x %d on %s; %.3f TFLOP per iteration (model FLOPs)\n",
              cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.vocab, batch, seq_len, prop.name, flops / 1e12);
  absl::StatusOr<DeviceUnits> units = DeviceUnits::Create(*spec);
  if (!units.ok()) {
    std::fprintf(stderr, "gpu_compute_bench: %s\n", units.status().ToString().c_str());
    return 1;
  }
  // The first kernel that runs is the one compared with PyTorch and timed
  // with recomputation; one that fails is reported and skipped.
  absl::StatusOr<Timing> kept = absl::NotFoundError("no attention kernel ran");
  absl::StatusOr<Timing> recomputed = kept;
  for (size_t i = 0; i < kinds.size(); ++i) {
    const std::string name = absl::GetFlag(FLAGS_attention)[i];
    absl::StatusOr<Timing> t = Measure(*spec, *units, kinds[i], false);
    if (!t.ok()) {
      std::fprintf(stderr, "gpu_compute_bench: %s attention: %s\n", name.c_str(), t.status().ToString().c_str());
      continue;
    }
    report(absl::StrCat("pshard, ", name, " attention"), *t);
    if (!kept.ok()) {
      kept = t;
      recomputed = Measure(*spec, *units, kinds[i], true);
      if (!recomputed.ok()) {
        std::fprintf(stderr, "gpu_compute_bench: %s\n", recomputed.status().ToString().c_str());
        return 1;
      }
      report(absl::StrCat("pshard, ", name, ", recomputed"), *recomputed);
    }
  }
  if (!kept.ok()) return 1;
  std::printf("recompute: %.0f MiB of activations saved (%.1f%%), %.1f%% more time\n",
              (kept->activation_bytes - recomputed->activation_bytes) / 1048576.0,
              100.0 * (kept->activation_bytes - recomputed->activation_bytes) / kept->activation_bytes,
              100.0 * (recomputed->mean_ms / kept->mean_ms - 1.0));
  double torch_tokens_per_s = 0;
  std::string torch_line = "null";
  if (!absl::GetFlag(FLAGS_torch_script).empty()) {
    absl::StatusOr<JsonValue> torch = TorchBaseline(cfg);
    if (!torch.ok()) {
      std::fprintf(stderr, "gpu_compute_bench: %s\n", torch.status().ToString().c_str());
      return 1;
    }
    torch_tokens_per_s = Number(*torch, "tokens_per_s");
    std::printf("%-34s: %8.2f ms/iter (best %.2f) | %10.0f tok/s | %6.1f TFLOP/s | MFU %5.1f%% | peak memory %.0f "
                "MiB\n",
                "PyTorch eager", Number(*torch, "ms_per_iter"), Number(*torch, "best_ms"), torch_tokens_per_s,
                Number(*torch, "tflops"), 100.0 * Number(*torch, "mfu"), Number(*torch, "max_memory_bytes") / 1048576.0);
    std::printf("ratio (pshard tok/s / PyTorch eager tok/s): %.2f (goal >= 1.0); MFU %.1f%% (goal >= 40%%)\n",
                tokens / (kept->mean_ms / 1e3) / torch_tokens_per_s, 100.0 * flops / (kept->mean_ms / 1e3) / peak);
    torch_line = absl::StrFormat("%.1f", torch_tokens_per_s);
  }
  std::printf(
      "{\"impl\": \"pshard-cuda\", \"device_name\": \"%s\", \"layers\": %d, \"d_model\": %d, \"heads\": %d, "
      "\"batch\": %d, \"seq_len\": %d, \"ms_per_iter\": %.3f, \"tokens_per_s\": %.1f, \"mfu\": %.4f, "
      "\"recompute_ms_per_iter\": %.3f, \"activation_bytes\": %lld, \"recompute_activation_bytes\": %lld, "
      "\"torch_tokens_per_s\": %s}\n",
      prop.name, cfg.num_layers, cfg.d_model, cfg.num_heads, batch, seq_len, kept->mean_ms,
      tokens / (kept->mean_ms / 1e3), flops / (kept->mean_ms / 1e3) / peak, recomputed->mean_ms,
      static_cast<long long>(kept->activation_bytes), static_cast<long long>(recomputed->activation_bytes),
      torch_line.c_str());
  return 0;
}

}  // namespace
}  // namespace pshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return pshard::Run();
}
