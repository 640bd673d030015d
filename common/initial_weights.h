// A job's initial weights taken from a safetensors file (the servers'
// --init_from): fine-tuning a trained model, or starting from weights a
// producer gave (a layout's "given" tensors). The file must hold exactly
// the layout's tensors, by name, with their shapes, in F32 or BF16. A shard
// server reads only its slices of it into memory.
#ifndef PSHARD_COMMON_INITIAL_WEIGHTS_H_
#define PSHARD_COMMON_INITIAL_WEIGHTS_H_

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_spec.h"
#include "common/safetensors.h"

namespace pshard {

/// A layout's initial weights in a safetensors file: the file matched to
/// the layout and its fingerprint, not its values. A shard server reads its
/// slices straight into its master weights, so that none holds the model.
class InitialWeights {
 public:
  /// Opens `path` and matches it to `spec`: every name and shape, before
  /// any data is read; then the whole file, a piece at a time, for the
  /// fingerprint. InvalidArgument naming the first tensor of the layout
  /// that the file lacks or holds in another shape, a tensor of the file
  /// that the layout does not have, or a file shorter than its header says;
  /// NotFound when the file cannot be read.
  static absl::StatusOr<InitialWeights> Load(const std::string& path, const ModelSpec& spec);

  /// A non-zero hash of the values (and names and shapes), the same for the
  /// same weights whether stored as F32 or BF16 (BF16 widens exactly).
  uint64_t fingerprint() const { return fingerprint_; }

  /// Reads elements [begin, begin + out.size()) of unit `unit`'s flat
  /// vector from the file (padding gets 0). DataLoss when the file changed
  /// since Load (its size or modification time) or cannot be read.
  absl::Status ReadUnitRange(const UnitSpec& unit, int64_t begin, std::span<float> out) const;

 private:
  /// Where a tensor's elements are in the file.
  struct Source {
    SafetensorsDtype dtype = SafetensorsDtype::kF32;
    uint64_t offset = 0;
  };
  std::string path_;
  std::vector<Source> sources_;  ///< by the tensor's rng_stream (its position in the layout)
  uint64_t size_ = 0;
  std::filesystem::file_time_type modified_;
  uint64_t fingerprint_ = 0;
};

}  // namespace pshard

#endif  // PSHARD_COMMON_INITIAL_WEIGHTS_H_
