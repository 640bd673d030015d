#include "trainer_client/model/gpt_layout.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pshard {
namespace {

absl::StatusOr<int64_t> TensorOffset(const UnitSpec& unit, const std::string& name, int64_t numel) {
  const TensorSpec* tensor = unit.Find(absl::StrCat(".", name));
  if (tensor == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("unit ", unit.name, " has no tensor ", name));
  }
  if (tensor->numel != numel || tensor->offset < 0 || tensor->offset + numel > unit.numel) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", tensor->name, " has ", tensor->numel,
                                                   " elements at offset ", tensor->offset, ", expected ", numel,
                                                   " inside the unit"));
  }
  return tensor->offset;
}

}  // namespace

absl::StatusOr<GptLayout> MakeGptLayout(const ModelSpec& spec) {
  ASSIGN_OR_RETURN(const GptConfig cfg, GptConfigFromSpec(spec));
  if (static_cast<int>(spec.units.size()) != cfg.num_layers + 2) {
    return absl::InvalidArgumentError(absl::StrCat("a GPT of ", cfg.num_layers, " layers has ", cfg.num_layers + 2,
                                                   " units; the spec has ", spec.units.size()));
  }
  const int64_t c = cfg.d_model;
  const int64_t v = cfg.vocab;
  GptLayout layout;
  const UnitSpec& embed = spec.units.front();
  ASSIGN_OR_RETURN(layout.embed.wte, TensorOffset(embed, "wte", v * c));
  ASSIGN_OR_RETURN(layout.embed.wpe, TensorOffset(embed, "wpe", int64_t{cfg.context} * c));
  for (int l = 0; l < cfg.num_layers; ++l) {
    const UnitSpec& unit = spec.units[l + 1];
    GptLayout::Block b;
    ASSIGN_OR_RETURN(b.ln1_w, TensorOffset(unit, "ln1.w", c));
    ASSIGN_OR_RETURN(b.ln1_b, TensorOffset(unit, "ln1.b", c));
    ASSIGN_OR_RETURN(b.qkv_w, TensorOffset(unit, "attn.qkv.w", 3 * c * c));
    ASSIGN_OR_RETURN(b.qkv_b, TensorOffset(unit, "attn.qkv.b", 3 * c));
    ASSIGN_OR_RETURN(b.attn_proj_w, TensorOffset(unit, "attn.proj.w", c * c));
    ASSIGN_OR_RETURN(b.attn_proj_b, TensorOffset(unit, "attn.proj.b", c));
    ASSIGN_OR_RETURN(b.ln2_w, TensorOffset(unit, "ln2.w", c));
    ASSIGN_OR_RETURN(b.ln2_b, TensorOffset(unit, "ln2.b", c));
    ASSIGN_OR_RETURN(b.fc_w, TensorOffset(unit, "mlp.fc.w", 4 * c * c));
    ASSIGN_OR_RETURN(b.fc_b, TensorOffset(unit, "mlp.fc.b", 4 * c));
    ASSIGN_OR_RETURN(b.mlp_proj_w, TensorOffset(unit, "mlp.proj.w", 4 * c * c));
    ASSIGN_OR_RETURN(b.mlp_proj_b, TensorOffset(unit, "mlp.proj.b", c));
    layout.blocks.push_back(b);
  }
  const UnitSpec& head = spec.units.back();
  ASSIGN_OR_RETURN(layout.head.lnf_w, TensorOffset(head, "lnf.w", c));
  ASSIGN_OR_RETURN(layout.head.lnf_b, TensorOffset(head, "lnf.b", c));
  ASSIGN_OR_RETURN(layout.head.lm_head_w, TensorOffset(head, "lm_head.w", v * c));
  return layout;
}

double GptModelFlops(const GptConfig& config, int batch, int seq_len) {
  const double c = config.d_model;
  const double tokens = static_cast<double>(batch) * seq_len;
  // Per block: qkv 3C^2, attention projection C^2, MLP 4C^2 + 4C^2.
  const double matmul_weights = config.num_layers * 12.0 * c * c + static_cast<double>(config.vocab) * c;
  const double attention = 12.0 * config.num_layers * batch * static_cast<double>(seq_len) * seq_len * c;
  return 6.0 * matmul_weights * tokens + attention;
}

int64_t GptActivationBytes(const GptConfig& config, int batch, int seq_len, bool recompute_blocks) {
  const int64_t n = int64_t{batch} * seq_len;  // rows
  const int64_t c = config.d_model;
  const int64_t v = config.vocab;
  const int64_t att = int64_t{batch} * config.num_heads * seq_len * seq_len;
  // Per block: LayerNorm outputs and statistics (2 x (nc + 2n)), qkv 3nc,
  // the attention probabilities, its output and the residual after it
  // (2nc), the MLP's fc and GELU outputs (8nc).
  const int64_t block = 15 * n * c + 4 * n + att;
  const int64_t sets = recompute_blocks ? std::min(config.num_layers, 1) : config.num_layers;
  const int64_t residuals = (int64_t{config.num_layers} + 1) * n * c;
  const int64_t head = n * c + 2 * n + n * v;  // final LayerNorm and the softmax
  // Gradients of the residual, a LayerNorm, the attention output, qkv, the
  // MLP's two activations, one attention row pair, and the logits.
  const int64_t scratch = 14 * n * c + 2 * int64_t{seq_len} * seq_len + n * v;
  const int64_t floats = residuals + sets * block + head + scratch;
  return 4 * floats + 2 * n * static_cast<int64_t>(sizeof(int32_t));
}

namespace {

// Sums pieces the way the CUDA model's allocator lays them out: each one
// starts at a multiple of 256 bytes.
class DeviceBytes {
 public:
  void Take(int64_t count, int64_t element_bytes) {
    bytes_ = (bytes_ + 255) / 256 * 256 + count * element_bytes;
  }
  int64_t bytes() const { return bytes_; }

 private:
  int64_t bytes_ = 0;
};

void TakeGpuBlock(DeviceBytes& d, int64_t n, int64_t c, int64_t heads_rows, int64_t seq_len, bool fused) {
  d.Take(n * c, 2);  // ln1, then its mean and rstd
  d.Take(n, 4);
  d.Take(n, 4);
  d.Take(3 * n * c, 2);  // qkv
  if (fused) {
    d.Take(heads_rows, 4);  // log-sum-exp per row
  } else {
    d.Take(heads_rows * seq_len, 2);  // the probabilities
  }
  d.Take(n * c, 2);  // attention output, residual after it, ln2
  d.Take(n * c, 2);
  d.Take(n * c, 2);
  d.Take(n, 4);
  d.Take(n, 4);
  d.Take(4 * n * c, 2);  // fc, then GELU
  d.Take(4 * n * c, 2);
}

}  // namespace

bool GptGpuFusesAttention(const GptConfig& config) { return config.d_model / config.num_heads == 64; }

GpuActivationBytes GptGpuActivationBytes(const GptConfig& config, int batch, int seq_len, bool recompute_blocks,
                                         bool fused_attention) {
  const int64_t n = int64_t{batch} * seq_len;
  const int64_t c = config.d_model;
  const int64_t heads_rows = int64_t{batch} * config.num_heads * seq_len;
  DeviceBytes lane;
  for (int i = 0; i < 5; ++i) lane.Take(i == 3 ? n + 1 : n, 4);  // tokens, targets, the rows grouped by token
  for (int l = 0; l <= config.num_layers; ++l) lane.Take(n * c, 2);  // the residual stream
  if (!recompute_blocks) {
    for (int l = 0; l < config.num_layers; ++l) TakeGpuBlock(lane, n, c, heads_rows, seq_len, fused_attention);
  }
  lane.Take(n * c, 2);  // final LayerNorm and statistics, logits, losses, the residual's gradient
  lane.Take(n, 4);
  lane.Take(n, 4);
  lane.Take(n * config.vocab, 2);
  lane.Take(n, 4);
  lane.Take(n * c, 2);
  DeviceBytes workspace;
  if (recompute_blocks) {
    TakeGpuBlock(workspace, n, c, heads_rows, seq_len, fused_attention);
  }
  if (fused_attention) {
    workspace.Take(heads_rows, 4);
  } else {
    workspace.Take(heads_rows * seq_len, 4);  // scores, then their gradient
    workspace.Take(heads_rows * seq_len, 2);
  }
  workspace.Take(n * c, 2);  // gradients of a LayerNorm, the attention output, qkv, GELU, fc
  workspace.Take(n * c, 2);
  workspace.Take(3 * n * c, 2);
  workspace.Take(4 * n * c, 2);
  workspace.Take(4 * n * c, 2);
  workspace.Take(int64_t{32} << 20, 1);  // cuBLAS
  return {lane.bytes(), workspace.bytes()};
}

}  // namespace pshard
