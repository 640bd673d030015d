// A job's initial weights taken from a safetensors file (the servers'
// --init_from): fine-tuning a trained model, or starting from weights a
// producer gave (a layout's "given" tensors). The file must hold exactly
// the layout's tensors, by name, with their shapes, in F32 or BF16.
#ifndef PSHARD_COMMON_INITIAL_WEIGHTS_H_
#define PSHARD_COMMON_INITIAL_WEIGHTS_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_spec.h"

namespace pshard {

/// The values of every tensor of a layout, as fp32. A plain value; holds
/// the whole model.
class InitialWeights {
 public:
  /// Reads `path` and matches it to `spec`. InvalidArgument naming the
  /// first tensor of the layout that the file lacks or holds in another
  /// shape, or a tensor of the file that the layout does not have;
  /// NotFound when the file cannot be read.
  static absl::StatusOr<InitialWeights> Load(const std::string& path, const ModelSpec& spec);

  /// A non-zero hash of the values (and names and shapes), the same for the
  /// same weights whether stored as F32 or BF16 (BF16 widens exactly).
  uint64_t fingerprint() const { return fingerprint_; }

  /// Writes elements [begin, begin + out.size()) of unit `unit`'s flat
  /// vector (padding gets 0).
  void FillUnitRange(const UnitSpec& unit, int64_t begin, std::span<float> out) const;

 private:
  /// By the tensor's rng_stream (its position in the layout).
  std::vector<std::vector<float>> values_;
  uint64_t fingerprint_ = 0;
};

}  // namespace pshard

#endif  // PSHARD_COMMON_INITIAL_WEIGHTS_H_
