// The GPT as a producer of layouts: its sizes, the units and tensors they
// make (MakeGptSpec), and the sizes read back from a layout that the GPT
// made (GptConfigFromSpec), which is how a trainer knows what to compute
// from the layout the servers hold.
//
// Units: 0 = "embed" (token and position embeddings), 1..L = transformer
// blocks, L+1 = "head" (final LayerNorm and LM head, not tied to the token
// embedding). Linear weights are stored [out_features, in_features] and
// applied as y = x W^T + b; weight decay applies to the matrices.
#ifndef PSHARD_TRAINER_CLIENT_MODEL_GPT_SPEC_H_
#define PSHARD_TRAINER_CLIENT_MODEL_GPT_SPEC_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model_spec.h"

namespace pshard {

/// Sizes of a GPT-2-style decoder-only transformer.
struct GptConfig {
  int num_layers = 4;
  int d_model = 128;
  int num_heads = 4;
  int context = 64;  ///< maximum sequence length (rows of the position embedding)
  int vocab = 256;   ///< byte-level tokens by default

  /// Checks that every size is positive and d_model divides into heads.
  absl::Status Validate() const;
};

/// The layout's `model` words for a GPT of these sizes:
/// "gpt layers=4 d_model=128 heads=4 context=64 vocab=256".
std::string GptModelName(const GptConfig& config);

/// The sizes a GPT's model words (GptModelName's) give; InvalidArgument
/// when the words are not a GPT's.
absl::StatusOr<GptConfig> ParseGptModelName(const std::string& model);

/// What the GPT computes, in words (docs/gpt.md says it at length): the
/// "architecture" of its exported weights, for readers outside pshard.
inline constexpr char kGptArchitecture[] =
    "pshard GPT: decoder-only transformer with pre-norm blocks; embed: x = wte[token] + wpe[position] (learned "
    "positions); block: x = x + attn.proj(attention(attn.qkv(ln1(x)))), x = x + mlp.proj(gelu(mlp.fc(ln2(x)))); "
    "head: logits = lm_head(lnf(x)), untied from wte, no bias. LayerNorm eps 1e-5 (biased variance); gelu is the "
    "tanh approximation; mlp.fc is 4 * d_model wide. attn.qkv packs q, k, v as rows [q; k; v] of d_model each, "
    "head h taking rows h * d_model / heads .. (h + 1) * d_model / heads of each; causal softmax attention "
    "scaled by 1 / sqrt(d_model / heads). Linear weights are [out, in]: y = x W^T + b.";

/// Builds the layout of a GPT with the given sizes.
absl::StatusOr<ModelSpec> MakeGptSpec(const GptConfig& config);

/// The sizes of the GPT whose layout `spec` is: its model words parsed,
/// and every unit and tensor checked against MakeGptSpec's (names, shapes
/// and order; initialisation rules may differ). InvalidArgument saying
/// what differs, or that the layout is not a GPT's (naming its model).
absl::StatusOr<GptConfig> GptConfigFromSpec(const ModelSpec& spec);

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_MODEL_GPT_SPEC_H_
