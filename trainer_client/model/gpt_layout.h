// Where each tensor of the GPT sits inside its unit's flat vector, and the
// model FLOPs of a pass: shared by the CPU and CUDA models.
#ifndef PSHARD_TRAINER_CLIENT_MODEL_GPT_LAYOUT_H_
#define PSHARD_TRAINER_CLIENT_MODEL_GPT_LAYOUT_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_spec.h"
#include "trainer_client/model/gpt_spec.h"

namespace pshard {

/// Element offsets of every tensor within its unit.
struct GptLayout {
  struct Embed {
    int64_t wte, wpe;
  };
  struct Block {
    int64_t ln1_w, ln1_b, qkv_w, qkv_b, attn_proj_w, attn_proj_b;
    int64_t ln2_w, ln2_b, fc_w, fc_b, mlp_proj_w, mlp_proj_b;
  };
  struct Head {
    int64_t lnf_w, lnf_b, lm_head_w;
  };
  Embed embed{};
  std::vector<Block> blocks;
  Head head{};
};

/// The layout of a spec made by MakeGptSpec; InvalidArgument naming the
/// tensor when one is missing or has the wrong size.
absl::StatusOr<GptLayout> MakeGptLayout(const ModelSpec& spec);

/// Model FLOPs of one forward + backward of `batch` sequences of `seq_len`:
/// 6 × (matrix weights: block linears and the LM head) × tokens, plus
/// 12 × layers × batch × seq_len² × width for the attention products
/// (counted over the full T×T square, as run).
double GptModelFlops(const GptConfig& config, int batch, int seq_len);

/// Bytes the CPU model (CpuGpt<float>) allocates for micro-batches of
/// `batch` sequences of `seq_len`: the residual stream entering every block
/// and the head, each block's saved internals (one shared set with
/// `recompute_blocks`), the head's, the gradient scratch and the batch.
/// What CpuGpt::ActivationBytes() reports, known without building the model.
int64_t GptActivationBytes(const GptConfig& config, int batch, int seq_len, bool recompute_blocks);

/// Device bytes the CUDA model (CudaGpt) allocates for micro-batches of
/// `batch` sequences of `seq_len`, in bf16 with fp32 statistics: a lane's
/// (the batch, the residual stream, each block's saved internals unless
/// recomputed, the head's) and the workspace lanes share (the gradient
/// scratch, the recomputed block, attention scratch, 32 MiB for cuBLAS).
/// `fused_attention`: no attention matrix is kept (a head size of 64).
/// What CudaGpt::ActivationBytes() reports, known without a device.
struct GpuActivationBytes {
  int64_t lane = 0;
  int64_t workspace = 0;
};
GpuActivationBytes GptGpuActivationBytes(const GptConfig& config, int batch, int seq_len, bool recompute_blocks,
                                         bool fused_attention);
/// Whether the CUDA model fuses attention for `config` (its head size is 64).
bool GptGpuFusesAttention(const GptConfig& config);

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_MODEL_GPT_LAYOUT_H_
