// The GPT model as pshard sees it: a list of units (the unit of fetch), each a
// list of named tensors laid out back to back in one flat fp32 vector.
//
// Units: 0 = "embed" (token and position embeddings), 1..L = transformer
// blocks, L+1 = "head" (final LayerNorm and LM head, not tied to the token
// embedding). Linear weights are stored [out_features, in_features] and
// applied as y = x W^T + b.
#ifndef PSHARD_COMMON_MODEL_SPEC_H_
#define PSHARD_COMMON_MODEL_SPEC_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

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

enum class InitKind { kNormal, kZeros, kOnes };

/// One tensor of a unit.
struct TensorSpec {
  std::string name;             ///< e.g. "block3.attn.qkv.w"
  std::vector<int64_t> shape;
  int64_t offset = 0;           ///< first element within the unit's flat vector
  int64_t numel = 0;
  InitKind init = InitKind::kZeros;
  double init_std = 0.0;        ///< for kNormal
  bool weight_decay = false;    ///< AdamW decay applies (matrices yes, vectors no)
  uint64_t rng_stream = 0;      ///< model-wide tensor id used by the initializer
};

/// One unit (layer): the unit of fetch and of the partition.
struct UnitSpec {
  std::string name;
  std::vector<TensorSpec> tensors;
  int64_t numel = 0;
  const TensorSpec* Find(const std::string& name_suffix) const;
};

/// A whole model: plain value, cheap enough to copy.
struct ModelSpec {
  GptConfig config;
  std::vector<UnitSpec> units;

  int64_t TotalParameters() const;
  std::vector<int64_t> UnitNumels() const;
};

/// Builds the unit list of a GPT with the given sizes.
absl::StatusOr<ModelSpec> MakeGptSpec(const GptConfig& config);

/// Writes the initial values of elements [begin, begin + out.size()) of a
/// unit's flat vector; positions at or past unit.numel (padding) get 0.
/// A pure function of (seed, tensor, element): independent of the partition.
void InitializeUnitRange(const UnitSpec& unit, uint64_t seed, int64_t begin,
                         std::span<float> out);

/// A run of elements [begin, end), relative to the start of a queried range.
struct ElementRun {
  int64_t begin = 0;
  int64_t end = 0;
};

/// The runs of elements [begin, begin + length) of the unit's flat vector
/// where AdamW weight decay applies, relative to `begin`, in order.
std::vector<ElementRun> WeightDecayRuns(const UnitSpec& unit, int64_t begin, int64_t length);

}  // namespace pshard

#endif  // PSHARD_COMMON_MODEL_SPEC_H_
