#include "trainer_client/model/cuda/cuda_gpt.h"

#include <cublas_v2.h>

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "trainer_client/model/gpt_layout.h"
#include "trainer_client/model/cuda/attention.h"
#include "trainer_client/model/cuda/cuda_check.h"
#include "trainer_client/model/cuda/kernels.h"

namespace pshard {
namespace {

using bf16 = __nv_bfloat16;

// cuBLAS workspace, the size NVIDIA recommends for Hopper. Owned by the model
// (not cuBLAS's per-stream pool) so every stream gets the same one.
constexpr int64_t kBlasWorkspaceBytes = int64_t{32} << 20;

// Offset of the tensor of `unit` named "<unit>.<name>", which must have
// `numel` elements.
// A row-major bf16 operand: element (i, j) of matrix b of a batch is
// data[b * stride + i * ld + j].
struct Operand {
  const bf16* data;
  int ld;
  int64_t stride = 0;
};

// Row-major C [m,n] = op(A) [m,k] * op(B) [k,n] + beta * C for `batch`
// matrices (op transposes when asked), with bf16 A and B, C of `c_type`
// (bf16 or fp32) and fp32 accumulation. cuBLAS is column-major and a
// row-major matrix is its column-major transpose, so this asks cuBLAS for
// C^T = op(B)^T op(A)^T: the operands swap places and keep their flags.
absl::Status Gemm(cublasHandle_t blas, bool trans_a, bool trans_b, int m, int n, int k, Operand a,
                  Operand b, float beta, void* c, cudaDataType_t c_type, int ldc,
                  int64_t stride_c = 0, int batch = 1) {
  const float alpha = 1.0f;
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (batch == 1) {
    CUBLAS_RETURN_IF_ERROR(cublasGemmEx(blas, op_b, op_a, n, m, k, &alpha, b.data, CUDA_R_16BF,
                                        b.ld, a.data, CUDA_R_16BF, a.ld, &beta, c, c_type, ldc,
                                        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  } else {
    CUBLAS_RETURN_IF_ERROR(
        cublasGemmStridedBatchedEx(blas, op_b, op_a, n, m, k, &alpha, b.data, CUDA_R_16BF, b.ld,
                                   b.stride, a.data, CUDA_R_16BF, a.ld, a.stride, &beta, c, c_type,
                                   ldc, stride_c, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  return absl::OkStatus();
}

}  // namespace

// Hands out aligned pieces of one allocation; with a null base it only
// measures (every piece is null).
class CudaGpt::Carver {
 public:
  explicit Carver(void* base) : base_(static_cast<char*>(base)) {}

  template <typename T>
  T* Take(int64_t count) {
    offset_ = (offset_ + kAlignment - 1) / kAlignment * kAlignment;
    T* piece = base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + offset_);
    offset_ += count * static_cast<int64_t>(sizeof(T));
    return piece;
  }
  int64_t bytes() const { return offset_; }

 private:
  static constexpr int64_t kAlignment = 256;
  char* base_;
  int64_t offset_ = 0;
};

// ---------------------------------------------------------------- lifetime

absl::StatusOr<CudaAttention> ParseCudaAttention(const std::string& name) {
  if (name == "auto") return CudaAttention::kAuto;
  if (name == "fused") return CudaAttention::kFused;
  if (name == "materialized") return CudaAttention::kMaterialized;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown attention \"", name, "\"; expected auto, fused or materialized"));
}

absl::StatusOr<CudaGpt::Allocation> CudaGpt::PlanAllocation(const ModelSpec& spec, const CudaGptOptions& options) {
  ASSIGN_OR_RETURN(const GptConfig cfg, GptConfigFromSpec(spec));
  ASSIGN_OR_RETURN(const bool fused, FusesAttention(cfg, options));
  std::unique_ptr<CudaGpt> model(new CudaGpt());
  model->config_ = cfg;
  model->batch_ = options.batch;
  model->seq_len_ = options.seq_len;
  model->recompute_blocks_ = options.recompute_blocks;
  model->fused_attention_ = fused;
  Carver lane(nullptr), workspace(nullptr);
  model->CarveLane(lane);
  model->CarveWorkspace(workspace);
  return Allocation{lane.bytes(), workspace.bytes()};
}

absl::StatusOr<bool> CudaGpt::FusesAttention(const GptConfig& cfg, const CudaGptOptions& options) {
  const bool head_size_fits = cfg.d_model / cfg.num_heads == internal::kFusedHeadSize;
  if (options.attention == CudaAttention::kFused && !head_size_fits) {
    return absl::InvalidArgumentError(absl::StrCat("fused attention needs a head size of ",
                                                   internal::kFusedHeadSize, ", not ",
                                                   cfg.d_model / cfg.num_heads));
  }
  return options.attention == CudaAttention::kFused || (options.attention == CudaAttention::kAuto && head_size_fits);
}

absl::StatusOr<std::unique_ptr<CudaGpt>> CudaGpt::Create(const ModelSpec& spec,
                                                         const CudaGptOptions& options,
                                                         const CudaGpt* share_workspace) {
  const int batch = options.batch;
  const int seq_len = options.seq_len;
  const int device = options.device;
  const bool recompute_blocks = options.recompute_blocks;
  ASSIGN_OR_RETURN(const GptConfig cfg, GptConfigFromSpec(spec));
  if (batch < 1 || seq_len < 1 || seq_len > cfg.context) {
    return absl::InvalidArgumentError(
        absl::StrCat("micro-batch of ", batch, " x ", seq_len,
                     " tokens; need batch >= 1 and 1 <= seq_len <= ", cfg.context));
  }
  if (static_cast<int>(spec.units.size()) != cfg.num_layers + 2) {
    return absl::InvalidArgumentError(absl::StrCat("a GPT with ", cfg.num_layers, " layers has ",
                                                   cfg.num_layers + 2, " units, the spec has ",
                                                   spec.units.size()));
  }
  ASSIGN_OR_RETURN(const bool fused, FusesAttention(cfg, options));
  if (share_workspace != nullptr &&
      (share_workspace->batch_ != batch || share_workspace->seq_len_ != seq_len ||
       share_workspace->device_ != device || share_workspace->recompute_blocks_ != recompute_blocks ||
       share_workspace->fused_attention_ != fused ||
       share_workspace->config_.num_layers != cfg.num_layers ||
       share_workspace->config_.d_model != cfg.d_model ||
       share_workspace->config_.num_heads != cfg.num_heads ||
       share_workspace->config_.vocab != cfg.vocab)) {
    return absl::InvalidArgumentError(
        "a workspace can only be shared by models of the same shape, device and recomputation");
  }
  std::unique_ptr<CudaGpt> model(new CudaGpt());
  model->spec_ = spec;
  model->config_ = cfg;
  model->batch_ = batch;
  model->seq_len_ = seq_len;
  model->device_ = device;
  model->recompute_blocks_ = recompute_blocks;
  model->fused_attention_ = fused;
  RETURN_IF_ERROR(model->CheckLayout());

  CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&model->upload_stream_, cudaStreamNonBlocking));
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&model->done_, cudaEventDisableTiming));
  CUBLAS_RETURN_IF_ERROR(cublasCreate(&model->blas_));
  // No reduced-precision (bf16) reductions inside split-K products.
  CUBLAS_RETURN_IF_ERROR(cublasSetMathMode(
      model->blas_, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                              CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));

  Carver measure_lane(nullptr), measure_workspace(nullptr);
  model->CarveLane(measure_lane);
  model->CarveWorkspace(measure_workspace);
  model->arena_bytes_ = measure_lane.bytes();
  CUDA_RETURN_IF_ERROR(cudaMalloc(&model->arena_, model->arena_bytes_));
  // Zero-filled so that no output ever depends on uninitialised memory; the
  // device sync orders it before work on any (non-blocking) stream.
  CUDA_RETURN_IF_ERROR(cudaMemset(model->arena_, 0, model->arena_bytes_));
  if (share_workspace == nullptr) {
    model->workspace_bytes_ = measure_workspace.bytes();
    CUDA_RETURN_IF_ERROR(cudaMalloc(&model->workspace_, model->workspace_bytes_));
    CUDA_RETURN_IF_ERROR(cudaMemset(model->workspace_, 0, model->workspace_bytes_));
  }
  CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  Carver carve_lane(model->arena_);
  model->CarveLane(carve_lane);
  Carver carve_workspace(share_workspace == nullptr ? model->workspace_ : share_workspace->workspace_);
  model->CarveWorkspace(carve_workspace);
  return model;
}

CudaGpt::~CudaGpt() {
  if (upload_stream_ == nullptr) return;  // Create failed before touching the device
  // Errors cannot be reported from here; each release is attempted anyway.
  cudaSetDevice(device_);
  if (done_ != nullptr) cudaEventSynchronize(done_);
  if (arena_ != nullptr) cudaFree(arena_);
  if (workspace_ != nullptr) cudaFree(workspace_);
  if (blas_ != nullptr) cublasDestroy(blas_);
  if (upload_stream_ != nullptr) cudaStreamDestroy(upload_stream_);
  if (done_ != nullptr) cudaEventDestroy(done_);
}

absl::Status CudaGpt::CheckLayout() {
  ASSIGN_OR_RETURN(GptLayout layout, MakeGptLayout(spec_));
  embed_ = layout.embed;
  block_layouts_ = std::move(layout.blocks);
  head_ = layout.head;
  return absl::OkStatus();
}

void CudaGpt::CarveLane(Carver& carver) {
  const GptConfig& cfg = config_;
  const int64_t n = rows();
  const int64_t c = cfg.d_model;
  tokens_ = carver.Take<int32_t>(n);
  targets_ = carver.Take<int32_t>(n);
  row_tokens_ = carver.Take<int32_t>(n);
  row_begin_ = carver.Take<int32_t>(n + 1);
  row_position_ = carver.Take<int32_t>(n);
  residuals_.resize(cfg.num_layers + 1);
  for (bf16*& r : residuals_) r = carver.Take<bf16>(n * c);
  // With recomputation every block shares one set, in the workspace: the
  // block's forward rerun at the start of its backward refills it.
  if (!recompute_blocks_) {
    blocks_.resize(cfg.num_layers);
    for (BlockActivations& a : blocks_) CarveBlock(carver, a);
  }
  lnf_ = carver.Take<bf16>(n * c);
  lnf_mean_ = carver.Take<float>(n);
  lnf_rstd_ = carver.Take<float>(n);
  logits_ = carver.Take<bf16>(n * cfg.vocab);
  losses_ = carver.Take<float>(n);
  dresidual_ = carver.Take<bf16>(n * c);  // carried from unit to unit in backward
}

void CudaGpt::CarveWorkspace(Carver& carver) {
  const GptConfig& cfg = config_;
  const int64_t n = rows();
  const int64_t c = cfg.d_model;
  const int64_t att_size = int64_t{batch_} * cfg.num_heads * seq_len_ * seq_len_;
  if (recompute_blocks_) {
    blocks_.resize(1);
    CarveBlock(carver, blocks_[0]);
    blocks_.resize(cfg.num_layers, blocks_[0]);
  }
  if (fused_attention_) {
    delta_ = carver.Take<float>(int64_t{batch_} * cfg.num_heads * seq_len_);
  } else {
    scores_ = carver.Take<float>(att_size);
    dscores_ = carver.Take<bf16>(att_size);
  }
  dln_ = carver.Take<bf16>(n * c);
  datty_ = carver.Take<bf16>(n * c);
  dqkv_ = carver.Take<bf16>(n * 3 * c);
  dfch_gelu_ = carver.Take<bf16>(n * 4 * c);
  dfch_ = carver.Take<bf16>(n * 4 * c);
  blas_workspace_bytes_ = kBlasWorkspaceBytes;
  blas_workspace_ = carver.Take<char>(blas_workspace_bytes_);
}

void CudaGpt::CarveBlock(Carver& carver, BlockActivations& a) {
  const int64_t n = rows();
  const int64_t c = config_.d_model;
  a.ln1 = carver.Take<bf16>(n * c);
  a.ln1_mean = carver.Take<float>(n);
  a.ln1_rstd = carver.Take<float>(n);
  a.qkv = carver.Take<bf16>(n * 3 * c);
  const int64_t heads_rows = int64_t{batch_} * config_.num_heads * seq_len_;
  if (fused_attention_) {
    a.lse = carver.Take<float>(heads_rows);
  } else {
    a.att = carver.Take<bf16>(heads_rows * seq_len_);
  }
  a.atty = carver.Take<bf16>(n * c);
  a.residual2 = carver.Take<bf16>(n * c);
  a.ln2 = carver.Take<bf16>(n * c);
  a.ln2_mean = carver.Take<float>(n);
  a.ln2_rstd = carver.Take<float>(n);
  a.fch = carver.Take<bf16>(n * 4 * c);
  a.fch_gelu = carver.Take<bf16>(n * 4 * c);
}

// ---------------------------------------------------------------- batch

absl::Status CudaGpt::SetBatch(std::span<const int32_t> tokens, std::span<const int32_t> targets) {
  const size_t n = static_cast<size_t>(rows());
  if (tokens.size() != n || targets.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("expected ", n, " tokens and targets, got ",
                                                   tokens.size(), " and ", targets.size()));
  }
  const int vocab = config_.vocab;
  for (size_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab || targets[i] < 0 || targets[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("token ", tokens[i], " or target ", targets[i],
                                                     " at position ", i, " is outside [0, ", vocab,
                                                     ")"));
    }
  }
  // Group the positions by token (a counting sort, stable: positions stay
  // ascending) for the wte backward, which then needs no atomics.
  std::vector<int32_t> count(vocab, 0);
  for (int32_t t : tokens) ++count[t];
  std::vector<int32_t> row_tokens;       // distinct tokens, ascending
  std::vector<int32_t> row_begin = {0};  // where each one's positions start
  std::vector<int32_t> row_position(n);  // positions, grouped by token
  std::vector<int32_t> next(vocab, 0);   // next free slot of each token's run
  for (int32_t t = 0; t < vocab; ++t) {
    if (count[t] == 0) continue;
    next[t] = row_begin.back();
    row_tokens.push_back(t);
    row_begin.push_back(row_begin.back() + count[t]);
  }
  for (size_t i = 0; i < n; ++i) row_position[next[tokens[i]]++] = static_cast<int32_t>(i);

  next_forward_ = 0;
  next_backward_ = -1;
  loss_ready_ = false;
  batch_set_ = false;
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  // Earlier calls' work may still read the device copy of the previous batch.
  CUDA_RETURN_IF_ERROR(cudaEventSynchronize(done_));
  const auto upload = [this](int32_t* dst, std::span<const int32_t> src) {
    return cudaMemcpyAsync(dst, src.data(), src.size_bytes(), cudaMemcpyHostToDevice,
                           upload_stream_);
  };
  CUDA_RETURN_IF_ERROR(upload(tokens_, tokens));
  CUDA_RETURN_IF_ERROR(upload(targets_, targets));
  CUDA_RETURN_IF_ERROR(upload(row_tokens_, row_tokens));
  CUDA_RETURN_IF_ERROR(upload(row_begin_, row_begin));
  CUDA_RETURN_IF_ERROR(upload(row_position_, row_position));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(upload_stream_));
  distinct_tokens_ = static_cast<int>(row_tokens.size());
  batch_set_ = true;
  return absl::OkStatus();
}

// ---------------------------------------------------------------- unit calls

absl::Status CudaGpt::BeginCall(cudaStream_t stream) {
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, done_, 0));
  CUBLAS_RETURN_IF_ERROR(cublasSetStream(blas_, stream));
  // cublasSetStream resets the workspace to cuBLAS's own pool.
  CUBLAS_RETURN_IF_ERROR(cublasSetWorkspace(blas_, blas_workspace_, blas_workspace_bytes_));
  return absl::OkStatus();
}

absl::Status CudaGpt::EndCall(cudaStream_t stream) {
  CUDA_RETURN_IF_ERROR(cudaEventRecord(done_, stream));
  return absl::OkStatus();
}

absl::Status CudaGpt::ForwardUnit(int unit, const bf16* weights, cudaStream_t stream) {
  if (!batch_set_) return absl::FailedPreconditionError("ForwardUnit before SetBatch");
  if (unit < 0 || unit >= num_units() || (unit != 0 && unit != next_forward_)) {
    return absl::FailedPreconditionError(
        absl::StrCat("ForwardUnit(", unit, ") out of order; expected unit ", next_forward_));
  }
  if (weights == nullptr) return absl::InvalidArgumentError("ForwardUnit: null weights");
  // Until this unit succeeds, only a new pass from unit 0 is valid.
  next_forward_ = 0;
  next_backward_ = -1;
  loss_ready_ = false;
  const int last = num_units() - 1;
  RETURN_IF_ERROR(BeginCall(stream));
  if (unit == 0) {
    RETURN_IF_ERROR(EmbedForward(weights, stream));
  } else if (unit == last) {
    RETURN_IF_ERROR(HeadForward(weights, stream));
  } else {
    RETURN_IF_ERROR(BlockForward(unit - 1, weights, stream));
  }
  RETURN_IF_ERROR(EndCall(stream));
  next_forward_ = unit + 1;
  next_backward_ = unit == last ? last : -1;
  loss_ready_ = unit == last;
  return absl::OkStatus();
}

absl::Status CudaGpt::BackwardUnit(int unit, const bf16* weights, float* grads,
                                   cudaStream_t stream) {
  if (unit < 0 || unit != next_backward_) {
    return absl::FailedPreconditionError(
        absl::StrCat("BackwardUnit(", unit, ") out of order; expected unit ", next_backward_,
                     " (-1: run a full forward first)"));
  }
  if (weights == nullptr || grads == nullptr) {
    return absl::InvalidArgumentError("BackwardUnit: null weights or gradients");
  }
  next_backward_ = -1;  // until this unit succeeds
  RETURN_IF_ERROR(BeginCall(stream));
  // Zeroed first, so tensors (or rows) that no op writes come out 0.
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(grads, 0, spec_.units[unit].numel * sizeof(float), stream));
  if (unit == 0) {
    RETURN_IF_ERROR(EmbedBackward(grads, stream));
  } else if (unit == num_units() - 1) {
    RETURN_IF_ERROR(HeadBackward(weights, grads, stream));
  } else {
    RETURN_IF_ERROR(BlockBackward(unit - 1, weights, grads, stream));
  }
  RETURN_IF_ERROR(EndCall(stream));
  next_backward_ = unit - 1;
  return absl::OkStatus();
}

absl::StatusOr<float> CudaGpt::Loss(cudaStream_t stream) {
  if (!loss_ready_) return absl::FailedPreconditionError("Loss before a full forward");
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, done_, 0));
  host_losses_.resize(rows());
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_losses_.data(), losses_, rows() * sizeof(float),
                                       cudaMemcpyDeviceToHost, stream));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  double sum = 0;  // in double, like the CPU model, so the mean does not drift with N
  for (float loss : host_losses_) sum += loss;
  return static_cast<float>(sum / rows());
}

// ---------------------------------------------------------------- forward

absl::Status CudaGpt::EmbedForward(const bf16* w, cudaStream_t stream) {
  CUDA_RETURN_IF_ERROR(internal::EncoderForward(residuals_[0], tokens_, w + embed_.wte,
                                                w + embed_.wpe, batch_, seq_len_,
                                                config_.d_model, stream));
  return absl::OkStatus();
}

absl::Status CudaGpt::BlockForward(int layer, const bf16* w, cudaStream_t stream,
                                   bool write_output) {
  const BlockLayout& p = block_layouts_[layer];
  const BlockActivations& a = blocks_[layer];
  const int n = rows();
  const int c = config_.d_model;
  const bf16* in = residuals_[layer];
  bf16* out = residuals_[layer + 1];
  // Attention branch: residual2 = in + proj(attention(qkv(ln1(in)))).
  CUDA_RETURN_IF_ERROR(internal::LayerNormForward(a.ln1, a.ln1_mean, a.ln1_rstd, in, w + p.ln1_w,
                                                  w + p.ln1_b, n, c, stream));
  RETURN_IF_ERROR(LinearForward(a.qkv, a.ln1, w + p.qkv_w, w + p.qkv_b, c, 3 * c, stream));
  RETURN_IF_ERROR(AttentionForward(a, stream));
  RETURN_IF_ERROR(
      LinearForward(a.residual2, a.atty, w + p.attn_proj_w, w + p.attn_proj_b, c, c, stream));
  CUDA_RETURN_IF_ERROR(
      internal::ResidualForward(a.residual2, a.residual2, in, int64_t{n} * c, stream));
  // MLP branch: out = residual2 + proj(gelu(fc(ln2(residual2)))).
  CUDA_RETURN_IF_ERROR(internal::LayerNormForward(a.ln2, a.ln2_mean, a.ln2_rstd, a.residual2,
                                                  w + p.ln2_w, w + p.ln2_b, n, c, stream));
  RETURN_IF_ERROR(LinearForward(a.fch, a.ln2, w + p.fc_w, w + p.fc_b, c, 4 * c, stream));
  CUDA_RETURN_IF_ERROR(internal::GeluForward(a.fch_gelu, a.fch, int64_t{n} * 4 * c, stream));
  if (!write_output) return absl::OkStatus();  // backward needs everything up to here only
  RETURN_IF_ERROR(
      LinearForward(out, a.fch_gelu, w + p.mlp_proj_w, w + p.mlp_proj_b, 4 * c, c, stream));
  CUDA_RETURN_IF_ERROR(internal::ResidualForward(out, out, a.residual2, int64_t{n} * c, stream));
  return absl::OkStatus();
}

absl::Status CudaGpt::HeadForward(const bf16* w, cudaStream_t stream) {
  const int n = rows();
  const int c = config_.d_model;
  const int v = config_.vocab;
  CUDA_RETURN_IF_ERROR(internal::LayerNormForward(lnf_, lnf_mean_, lnf_rstd_, residuals_.back(),
                                                  w + head_.lnf_w, w + head_.lnf_b, n, c, stream));
  RETURN_IF_ERROR(LinearForward(logits_, lnf_, w + head_.lm_head_w, nullptr, c, v, stream));
  // The loss and, in place of the logits, their gradient (used by backward).
  CUDA_RETURN_IF_ERROR(internal::SoftmaxCrossEntropy(logits_, losses_, targets_, n, v, stream));
  return absl::OkStatus();
}

// ---------------------------------------------------------------- backward
//
// dresidual_ holds the gradient wrt the current unit's output and is turned,
// in place, into the gradient wrt the unit's input: a residual connection's
// backward is the identity, so each branch's LayerNormBackward simply adds
// its contribution on top.

absl::Status CudaGpt::HeadBackward(const bf16* w, float* dw, cudaStream_t stream) {
  const int n = rows();
  const int c = config_.d_model;
  const int v = config_.vocab;
  RETURN_IF_ERROR(LinearBackward(dln_, dw + head_.lm_head_w, nullptr, logits_, lnf_,
                                 w + head_.lm_head_w, c, v, stream));
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dresidual_, 0, int64_t{n} * c * sizeof(bf16), stream));
  CUDA_RETURN_IF_ERROR(internal::LayerNormBackward(dresidual_, dw + head_.lnf_w, dw + head_.lnf_b,
                                                   dln_, residuals_.back(), w + head_.lnf_w,
                                                   lnf_mean_, lnf_rstd_, n, c, stream));
  return absl::OkStatus();
}

absl::Status CudaGpt::BlockBackward(int layer, const bf16* w, float* dw, cudaStream_t stream) {
  const BlockLayout& p = block_layouts_[layer];
  const BlockActivations& a = blocks_[layer];
  const int n = rows();
  const int c = config_.d_model;
  if (recompute_blocks_) RETURN_IF_ERROR(BlockForward(layer, w, stream, /*write_output=*/false));
  // MLP branch; afterwards dresidual_ holds the gradient wrt residual2.
  RETURN_IF_ERROR(LinearBackward(dfch_gelu_, dw + p.mlp_proj_w, dw + p.mlp_proj_b, dresidual_,
                                 a.fch_gelu, w + p.mlp_proj_w, 4 * c, c, stream));
  CUDA_RETURN_IF_ERROR(
      internal::GeluBackward(dfch_, a.fch, dfch_gelu_, int64_t{n} * 4 * c, stream));
  RETURN_IF_ERROR(
      LinearBackward(dln_, dw + p.fc_w, dw + p.fc_b, dfch_, a.ln2, w + p.fc_w, c, 4 * c, stream));
  CUDA_RETURN_IF_ERROR(internal::LayerNormBackward(dresidual_, dw + p.ln2_w, dw + p.ln2_b, dln_,
                                                   a.residual2, w + p.ln2_w, a.ln2_mean, a.ln2_rstd,
                                                   n, c, stream));
  // Attention branch; afterwards dresidual_ holds the gradient wrt the input.
  RETURN_IF_ERROR(LinearBackward(datty_, dw + p.attn_proj_w, dw + p.attn_proj_b, dresidual_, a.atty,
                                 w + p.attn_proj_w, c, c, stream));
  RETURN_IF_ERROR(AttentionBackward(dqkv_, datty_, a, stream));
  RETURN_IF_ERROR(LinearBackward(dln_, dw + p.qkv_w, dw + p.qkv_b, dqkv_, a.ln1, w + p.qkv_w, c,
                                 3 * c, stream));
  CUDA_RETURN_IF_ERROR(internal::LayerNormBackward(dresidual_, dw + p.ln1_w, dw + p.ln1_b, dln_,
                                                   residuals_[layer], w + p.ln1_w, a.ln1_mean,
                                                   a.ln1_rstd, n, c, stream));
  return absl::OkStatus();
}

absl::Status CudaGpt::EmbedBackward(float* dw, cudaStream_t stream) {
  const internal::TokenRows token_rows{row_tokens_, row_begin_, row_position_, distinct_tokens_};
  CUDA_RETURN_IF_ERROR(internal::EncoderBackward(dw + embed_.wte, dw + embed_.wpe, dresidual_,
                                                 token_rows, batch_, seq_len_, config_.d_model,
                                                 stream));
  return absl::OkStatus();
}

// ---------------------------------------------------------------- linear and attention

// out [N,OC] = inp [N,IC] W^T + bias, W stored [OC,IC]; bias may be null.
absl::Status CudaGpt::LinearForward(bf16* out, const bf16* inp, const bf16* weight,
                                    const bf16* bias, int in_features, int out_features,
                                    cudaStream_t stream) {
  const int n = rows();
  float beta = 0.0f;
  if (bias != nullptr) {
    CUDA_RETURN_IF_ERROR(internal::BroadcastBias(out, bias, n, out_features, stream));
    beta = 1.0f;
  }
  return Gemm(blas_, false, true, n, out_features, in_features, {inp, in_features},
              {weight, in_features}, beta, out, CUDA_R_16BF, out_features);
}

// dinp = dout W (overwritten); dweight = dout^T inp and dbias = column sums of
// dout, in fp32 (overwritten); dbias may be null.
absl::Status CudaGpt::LinearBackward(bf16* dinp, float* dweight, float* dbias, const bf16* dout,
                                     const bf16* inp, const bf16* weight, int in_features,
                                     int out_features, cudaStream_t stream) {
  const int n = rows();
  RETURN_IF_ERROR(Gemm(blas_, false, false, n, in_features, out_features, {dout, out_features},
                       {weight, in_features}, 0.0f, dinp, CUDA_R_16BF, in_features));
  RETURN_IF_ERROR(Gemm(blas_, true, false, out_features, in_features, n, {dout, out_features},
                       {inp, in_features}, 0.0f, dweight, CUDA_R_32F, in_features));
  if (dbias != nullptr) {
    CUDA_RETURN_IF_ERROR(internal::BiasBackward(dbias, dout, n, out_features, stream));
  }
  return absl::OkStatus();
}

// Causal self-attention of qkv [B,T,3C] (q, k, v side by side, each H heads
// of hs = C/H) into out [B,T,C]; att [B,H,T,T] keeps the probabilities. Per
// sequence b, one strided-batched product over the H heads: a head's q, k
// and v are hs-wide column slices of qkv with row stride 3C, and the next
// head starts hs elements further.
absl::Status CudaGpt::AttentionForward(const BlockActivations& a, cudaStream_t stream) {
  if (!fused_attention_) return MaterializedAttentionForward(a.atty, a.att, a.qkv, stream);
  const int h = config_.num_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(config_.d_model / h));
  CUDA_RETURN_IF_ERROR(
      internal::FusedAttentionForward(a.atty, a.lse, a.qkv, batch_, seq_len_, h, scale, stream));
  return absl::OkStatus();
}

absl::Status CudaGpt::AttentionBackward(bf16* dqkv, const bf16* dout, const BlockActivations& a,
                                        cudaStream_t stream) {
  if (!fused_attention_) return MaterializedAttentionBackward(dqkv, dout, a.qkv, a.att, stream);
  const int h = config_.num_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(config_.d_model / h));
  CUDA_RETURN_IF_ERROR(internal::FusedAttentionBackward(dqkv, delta_, dout, a.atty, a.qkv, a.lse, batch_,
                                                        seq_len_, h, scale, stream));
  return absl::OkStatus();
}

absl::Status CudaGpt::MaterializedAttentionForward(bf16* out, bf16* att, const bf16* qkv,
                                                   cudaStream_t stream) {
  const int t = seq_len_;
  const int c = config_.d_model;
  const int h = config_.num_heads;
  const int hs = c / h;
  const int64_t tt = int64_t{t} * t;
  for (int b = 0; b < batch_; ++b) {
    const bf16* q = qkv + int64_t{b} * t * 3 * c;
    const bf16* k = q + c;
    // scores [T,T] = q [T,hs] k^T, per head.
    RETURN_IF_ERROR(Gemm(blas_, false, true, t, t, hs, {q, 3 * c, hs}, {k, 3 * c, hs}, 0.0f,
                         scores_ + b * h * tt, CUDA_R_32F, t, tt, h));
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  CUDA_RETURN_IF_ERROR(internal::CausalSoftmaxForward(att, scores_, scale, batch_ * h, t, stream));
  for (int b = 0; b < batch_; ++b) {
    const bf16* v = qkv + int64_t{b} * t * 3 * c + 2 * c;
    // out [T,hs] = att [T,T] v [T,hs], per head.
    RETURN_IF_ERROR(Gemm(blas_, false, false, t, hs, t, {att + b * h * tt, t, tt}, {v, 3 * c, hs},
                         0.0f, out + int64_t{b} * t * c, CUDA_R_16BF, c, hs, h));
  }
  return absl::OkStatus();
}

// dqkv [B,T,3C] (overwritten) from dout [B,T,C], the saved qkv and att.
absl::Status CudaGpt::MaterializedAttentionBackward(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                                    const bf16* att, cudaStream_t stream) {
  const int t = seq_len_;
  const int c = config_.d_model;
  const int h = config_.num_heads;
  const int hs = c / h;
  const int64_t tt = int64_t{t} * t;
  float* datt = scores_;  // the forward's scratch, free during backward
  for (int b = 0; b < batch_; ++b) {
    const bf16* v = qkv + int64_t{b} * t * 3 * c + 2 * c;
    const bf16* dout_b = dout + int64_t{b} * t * c;
    const bf16* att_b = att + b * h * tt;
    bf16* dv = dqkv + int64_t{b} * t * 3 * c + 2 * c;
    // datt [T,T] = dout [T,hs] v^T;  dv [T,hs] = att^T dout.
    RETURN_IF_ERROR(Gemm(blas_, false, true, t, t, hs, {dout_b, c, hs}, {v, 3 * c, hs}, 0.0f,
                         datt + b * h * tt, CUDA_R_32F, t, tt, h));
    RETURN_IF_ERROR(Gemm(blas_, true, false, t, hs, t, {att_b, t, tt}, {dout_b, c, hs}, 0.0f, dv,
                         CUDA_R_16BF, 3 * c, hs, h));
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  CUDA_RETURN_IF_ERROR(
      internal::CausalSoftmaxBackward(dscores_, att, datt, scale, batch_ * h, t, stream));
  for (int b = 0; b < batch_; ++b) {
    const bf16* q = qkv + int64_t{b} * t * 3 * c;
    const bf16* k = q + c;
    const bf16* dscores_b = dscores_ + b * h * tt;
    bf16* dq = dqkv + int64_t{b} * t * 3 * c;
    bf16* dk = dq + c;
    // scores = q k^T (the scale is inside dscores):  dq = ds k;  dk = ds^T q.
    RETURN_IF_ERROR(Gemm(blas_, false, false, t, hs, t, {dscores_b, t, tt}, {k, 3 * c, hs}, 0.0f,
                         dq, CUDA_R_16BF, 3 * c, hs, h));
    RETURN_IF_ERROR(Gemm(blas_, true, false, t, hs, t, {dscores_b, t, tt}, {q, 3 * c, hs}, 0.0f, dk,
                         CUDA_R_16BF, 3 * c, hs, h));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------- accounting

double CudaGpt::FlopsPerMicroBatch() const {
  return GptModelFlops(config_, batch_, seq_len_);
}

bool CudaDeviceAvailable() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear it: no device is an answer here, not an error
    return false;
  }
  return count > 0;
}

}  // namespace pshard
