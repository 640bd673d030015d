// The GPT model on one CUDA device, unit by unit like CpuGpt
// (trainer_client/model/gpt.h): the trainer hands each unit's bf16 weights
// to the device just before the unit runs and takes its fp32 gradient right
// after. The unit and tensor layout is common/model_spec.h's.
//
// Numerics: weights and activations are bf16; matrix products accumulate in
// fp32 (cuBLAS, CUBLAS_COMPUTE_32F, and the fused attention's tensor-core
// tiles); LayerNorm, softmax and cross-entropy statistics are fp32; weight
// gradients are computed and returned in fp32.
//
// Attention is fused (attention.h: tiles, online softmax, nothing of size
// T×T kept) for head size 64, or materialized (cuBLAS products around a
// softmax kernel, the [B,H,T,T] probabilities kept for backward).
#ifndef PSHARD_TRAINER_CLIENT_MODEL_CUDA_CUDA_GPT_H_
#define PSHARD_TRAINER_CLIENT_MODEL_CUDA_CUDA_GPT_H_

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model_spec.h"
#include "trainer_client/model/gpt_layout.h"

struct cublasContext;  // cublasHandle_t, without including cuBLAS here

namespace pshard {

enum class CudaAttention {
  kAuto,          ///< kFused where it applies (head size 64), else kMaterialized
  kFused,         ///< tiled, no T×T matrices (attention.h); head size 64 only
  kMaterialized,  ///< cuBLAS products around a softmax kernel, T×T probabilities kept
};

/// "auto", "fused" or "materialized"; InvalidArgument for anything else.
absl::StatusOr<CudaAttention> ParseCudaAttention(const std::string& name);

struct CudaGptOptions {
  int batch = 1;    ///< sequences per micro-batch
  int seq_len = 1;  ///< tokens per sequence (<= context)
  int device = 0;
  /// Keep only each block's input between forward and backward; a block's
  /// backward first reruns its forward (bit-identically) into activations
  /// all blocks share, so activation memory no longer grows with the layers
  /// but for one [N,C] per layer.
  bool recompute_blocks = false;
  CudaAttention attention = CudaAttention::kAuto;
};

/// Forward and backward of a GPT on micro-batches of fixed shape on one CUDA
/// device. The model owns activations, gradient scratch and a cuBLAS handle,
/// never weights.
///
/// Streams: every call enqueues its work on the caller's `stream` and
/// returns without waiting for it (except SetBatch and Loss, which say so).
/// Calls may use different streams: each one first waits (on the device) for
/// the work of the previous call, so the model's own work always runs in call
/// order. The caller keeps `weights` valid and unchanged, and reads `grads`
/// only, after that call's work on `stream` is done (e.g. record an event).
///
/// Determinism: the same batch and weights give bit-identical losses and
/// gradients on every run on the same GPU model and CUDA version (fixed-order
/// reductions, no atomics, cuBLAS with a fixed workspace).
///
/// Not thread-safe: one caller at a time. Each call makes `device` current on
/// the calling thread.
class CudaGpt {
 public:
  /// Allocates everything on the options' device for micro-batches of
  /// `batch` sequences of `seq_len` (<= context) tokens. InvalidArgument on
  /// bad sizes, a spec that does not follow MakeGptSpec's layout, or fused
  /// attention asked for a head size it does not support;
  /// FailedPrecondition when the device is not usable; ResourceExhausted
  /// when it is too small.
  ///
  /// With `share_workspace` (a model made with the same options, which must
  /// outlive this one), the two share their scratch (and the recomputed
  /// block's activations) and keep only their own batch and saved
  /// activations: several micro-batches resident at once for little more
  /// than their activations. Models sharing a workspace must not run at the
  /// same time: call them on one stream.
  static absl::StatusOr<std::unique_ptr<CudaGpt>> Create(const ModelSpec& spec,
                                                         const CudaGptOptions& options,
                                                         const CudaGpt* share_workspace = nullptr);
  /// The device bytes Create would allocate for `spec` and `options`: a
  /// lane's (its batch and saved activations) and the workspace's. Touches
  /// no device.
  struct Allocation {
    int64_t lane = 0;
    int64_t workspace = 0;
  };
  static absl::StatusOr<Allocation> PlanAllocation(const ModelSpec& spec, const CudaGptOptions& options);
  /// Whether this model's attention is the fused kernel.
  bool fused_attention() const { return fused_attention_; }
  ~CudaGpt();
  CudaGpt(const CudaGpt&) = delete;
  CudaGpt& operator=(const CudaGpt&) = delete;

  /// Sets the micro-batch: tokens and next-token targets, batch*seq_len ints
  /// each in [0, vocab), in host memory. InvalidArgument on bad sizes or ids.
  /// Blocks until the model's earlier work is done (it may read the previous
  /// batch) and the new batch is on the device. A full forward must run
  /// before the next BackwardUnit.
  absl::Status SetBatch(std::span<const int32_t> tokens, std::span<const int32_t> targets);

  /// Runs unit `unit`'s forward with `weights`: a device pointer to the
  /// unit's flat bf16 weights (spec.units[unit].numel elements; padding
  /// after them allowed and ignored). Units run 0..K-1 in order (unit 0
  /// starts a new pass); the last one also computes the loss and the
  /// gradient of the logits. FailedPrecondition when out of order.
  absl::Status ForwardUnit(int unit, const __nv_bfloat16* weights, cudaStream_t stream);

  /// Backward of `unit` (K-1..0 after a full forward) with the same weights;
  /// writes the fp32 gradient of the mean loss wrt the unit's flat weights
  /// to the device pointer `grads` (numel elements, overwritten; padding
  /// untouched). FailedPrecondition when out of order.
  absl::Status BackwardUnit(int unit, const __nv_bfloat16* weights, float* grads,
                            cudaStream_t stream);

  /// Mean cross-entropy of the last forward, in nats (per-row losses summed
  /// in double on the host, in row order). Blocks until it is computed.
  /// FailedPrecondition before a full forward.
  absl::StatusOr<float> Loss(cudaStream_t stream);

  /// Device bytes this model allocated: the batch and saved activations,
  /// and unless it shares another's, the workspace (gradient scratch, the
  /// recomputed block, the cuBLAS workspace).
  int64_t ActivationBytes() const { return arena_bytes_ + workspace_bytes_; }

  /// FLOPs of one forward+backward of a micro-batch, counted exactly as
  /// CpuGpt::FlopsPerMicroBatch does.
  double FlopsPerMicroBatch() const;

  int num_units() const { return static_cast<int>(spec_.units.size()); }

 private:
  using bf16 = __nv_bfloat16;

  // Offsets of each tensor inside its unit's flat vector.
  using EmbedLayout = GptLayout::Embed;
  using BlockLayout = GptLayout::Block;
  using HeadLayout = GptLayout::Head;
  // What one block's forward saves for its backward (device pointers).
  struct BlockActivations {
    bf16* ln1;                   // [N,C]
    float *ln1_mean, *ln1_rstd;  // [N]
    bf16* qkv;                   // [N,3C]
    bf16* att = nullptr;         // [B,H,T,T] softmax probabilities (materialized attention)
    float* lse = nullptr;        // [B,H,T] log-sum-exp of each query's scores (fused attention)
    bf16* atty;                  // [N,C] attention output, heads concatenated
    bf16* residual2;             // [N,C] block input + attention branch
    bf16* ln2;                   // [N,C]
    float *ln2_mean, *ln2_rstd;  // [N]
    bf16* fch;                   // [N,4C]
    bf16* fch_gelu;              // [N,4C]
  };
  class Carver;
  static absl::StatusOr<bool> FusesAttention(const GptConfig& cfg, const CudaGptOptions& options);

  CudaGpt() = default;

  absl::Status CheckLayout();
  // Assign the device pointers below from `carver` (sizes only when it
  // measures): this model's own (the batch, saved activations, the residual
  // gradient carried between units), and the shareable workspace.
  void CarveLane(Carver& carver);
  void CarveWorkspace(Carver& carver);
  void CarveBlock(Carver& carver, BlockActivations& a);
  absl::Status BuildBatch(std::span<const int32_t> tokens, std::span<const int32_t> targets);

  // Every enqueuing call starts with BeginCall (device, wait for the previous
  // call's work, cuBLAS on `stream`) and ends with EndCall (records that).
  absl::Status BeginCall(cudaStream_t stream);
  absl::Status EndCall(cudaStream_t stream);

  absl::Status EmbedForward(const bf16* w, cudaStream_t stream);
  // Without `write_output` it stops before the MLP's projection: what a
  // recomputing backward needs is saved by then.
  absl::Status BlockForward(int layer, const bf16* w, cudaStream_t stream,
                            bool write_output = true);
  absl::Status HeadForward(const bf16* w, cudaStream_t stream);
  absl::Status EmbedBackward(float* dw, cudaStream_t stream);
  absl::Status BlockBackward(int layer, const bf16* w, float* dw, cudaStream_t stream);
  absl::Status HeadBackward(const bf16* w, float* dw, cudaStream_t stream);

  // Linear layers and attention: cuBLAS products around the kernels.
  absl::Status LinearForward(bf16* out, const bf16* inp, const bf16* weight, const bf16* bias,
                             int in_features, int out_features, cudaStream_t stream);
  absl::Status LinearBackward(bf16* dinp, float* dweight, float* dbias, const bf16* dout,
                              const bf16* inp, const bf16* weight, int in_features,
                              int out_features, cudaStream_t stream);
  // Attention of block activations `a`: a.qkv -> a.atty (saving a.att or
  // a.lse), and back from dout to dqkv.
  absl::Status AttentionForward(const BlockActivations& a, cudaStream_t stream);
  absl::Status AttentionBackward(bf16* dqkv, const bf16* dout, const BlockActivations& a,
                                 cudaStream_t stream);
  absl::Status MaterializedAttentionForward(bf16* out, bf16* att, const bf16* qkv, cudaStream_t stream);
  absl::Status MaterializedAttentionBackward(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                             const bf16* att, cudaStream_t stream);

  int rows() const { return batch_ * seq_len_; }

  ModelSpec spec_;
  GptConfig config_;
  int batch_ = 0;
  int seq_len_ = 0;
  int device_ = 0;
  bool recompute_blocks_ = false;
  bool fused_attention_ = false;
  EmbedLayout embed_{};
  std::vector<BlockLayout> block_layouts_;
  HeadLayout head_{};

  cublasContext* blas_ = nullptr;
  cudaStream_t upload_stream_ = nullptr;  // SetBatch's copies
  cudaEvent_t done_ = nullptr;            // recorded after each call's work

  // One allocation holds this model's own buffers below, another the
  // workspace (null when shared from another model).
  void* arena_ = nullptr;
  int64_t arena_bytes_ = 0;
  void* workspace_ = nullptr;
  int64_t workspace_bytes_ = 0;

  // The batch, uploaded as one block of ints: tokens, targets and the
  // token-grouped positions for the deterministic wte backward.
  int32_t* batch_ints_ = nullptr;
  int32_t* tokens_ = nullptr;        // [B,T]
  int32_t* targets_ = nullptr;       // [B,T]
  int32_t* row_tokens_ = nullptr;    // [<= N] distinct tokens, ascending
  int32_t* row_begin_ = nullptr;     // [<= N + 1]
  int32_t* row_position_ = nullptr;  // [N]
  int distinct_tokens_ = 0;

  // residuals_[l] is the input of block l; residuals_[L] is the head's input.
  std::vector<bf16*> residuals_;
  std::vector<BlockActivations> blocks_;  // per layer; all alike when recomputing
  bf16* lnf_ = nullptr;  // [N,C]
  float* lnf_mean_ = nullptr;
  float* lnf_rstd_ = nullptr;
  bf16* logits_ = nullptr;   // [N,V]; after the head's forward, d loss / d logits
  float* losses_ = nullptr;  // [N] per-row cross-entropy

  bf16* dresidual_ = nullptr;  // [N,C] gradient wrt the current unit's output

  // Workspace, reused by every layer.
  float* scores_ = nullptr;    // [B,H,T,T] attention scores (forward), d att (backward); materialized
  bf16* dscores_ = nullptr;    // [B,H,T,T]; materialized
  float* delta_ = nullptr;     // [B,H,T] rowsum(d atty * atty); fused
  bf16* dln_ = nullptr;        // [N,C]
  bf16* datty_ = nullptr;      // [N,C]
  bf16* dqkv_ = nullptr;       // [N,3C]
  bf16* dfch_gelu_ = nullptr;  // [N,4C]
  bf16* dfch_ = nullptr;       // [N,4C]
  void* blas_workspace_ = nullptr;
  int64_t blas_workspace_bytes_ = 0;

  // Host staging.
  std::vector<int32_t> host_batch_;
  std::vector<float> host_losses_;

  int next_forward_ = 0;    // unit the next ForwardUnit must run (0 restarts)
  int next_backward_ = -1;  // unit the next BackwardUnit must run; -1: none
  bool batch_set_ = false;
  bool loss_ready_ = false;
};

/// Whether a CUDA device is usable here: false on machines without a GPU or
/// driver, never an error.
bool CudaDeviceAvailable();

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_MODEL_CUDA_CUDA_GPT_H_
