// A job's layout: the model as pshard sees it, with no idea what the model
// computes. A list of units (the unit of fetch and of the partition), each
// a list of named tensors laid out back to back in one flat fp32 vector,
// each with the rule that gives its initial values and whether AdamW's
// weight decay applies to it. Producers make layouts (the trainer's GPT,
// the PyTorch bridge, a layout file); servers only store, reduce, update
// and checkpoint them.
#ifndef PSHARD_COMMON_MODEL_SPEC_H_
#define PSHARD_COMMON_MODEL_SPEC_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pshard {

/// How a tensor's initial values are made. kGiven: they come from the
/// job's initial-weights file (the servers' --init_from), which every
/// layout with such a tensor needs.
enum class InitKind { kNormal, kZeros, kOnes, kGiven };

/// "normal", "zeros", "ones", "given".
std::string_view InitKindName(InitKind kind);
absl::StatusOr<InitKind> InitKindFromName(std::string_view name);

/// One tensor of a unit.
struct TensorSpec {
  std::string name;             ///< unique in the model, e.g. "block3.attn.qkv.w"
  std::vector<int64_t> shape;   ///< row-major; [] is a scalar
  int64_t offset = 0;           ///< first element within the unit's flat vector
  int64_t numel = 0;
  InitKind init = InitKind::kZeros;
  double init_std = 0.0;        ///< for kNormal
  bool weight_decay = false;    ///< AdamW's decoupled decay applies
  /// The tensor's position in the whole model (units in order, tensors in
  /// order): the stream the initializer draws from.
  uint64_t rng_stream = 0;
};

/// One unit (layer): the unit of fetch and of the partition.
struct UnitSpec {
  std::string name;
  std::vector<TensorSpec> tensors;
  int64_t numel = 0;
  /// The first tensor whose name ends in `name_suffix`, or nullptr.
  const TensorSpec* Find(const std::string& name_suffix) const;
};

/// A whole layout: a plain value, cheap enough to copy.
struct ModelSpec {
  /// What produced the layout, in its producer's words ("gpt layers=4
  /// d_model=128 ..."; "torch MyModel"): the trainer's model code reads
  /// it, the servers only store and compare it.
  std::string model;
  std::vector<UnitSpec> units;

  int64_t TotalParameters() const;
  std::vector<int64_t> UnitNumels() const;
  int num_tensors() const;
  /// Whether some tensor's initial values come from an initial-weights file.
  bool HasGivenValues() const;
};

/// Bounds on a layout, so that a hostile or broken one is refused before
/// anything is allocated for it.
inline constexpr int kMaxLayoutTensors = 1 << 20;
inline constexpr int kMaxLayoutUnits = 1 << 16;
inline constexpr size_t kMaxTensorNameBytes = 1024;
inline constexpr int kMaxTensorRank = 8;
inline constexpr int64_t kMaxLayoutElements = int64_t{1} << 44;

/// Builds a layout unit by unit and tensor by tensor, computing offsets,
/// element counts and initializer streams; Build() validates the whole.
class ModelSpecBuilder {
 public:
  explicit ModelSpecBuilder(std::string model);
  /// Starts a unit; the tensors added next belong to it.
  void AddUnit(std::string name);
  /// Adds a tensor to the current unit (an error at Build() if none).
  void AddTensor(std::string name, std::vector<int64_t> shape, InitKind init, double init_std,
                 bool weight_decay);
  /// The layout, or InvalidArgument naming the first thing wrong (see
  /// ValidateModelSpec).
  absl::StatusOr<ModelSpec> Build() &&;

 private:
  ModelSpec spec_;
  int tensors_ = 0;
  std::string error_;
};

/// Checks a layout: at least one unit; every unit named, unique and
/// holding at least one tensor; tensor names unique in the model, non-empty,
/// printable and not "__metadata__"; dimensions >= 1, at most
/// kMaxTensorRank of them; normal standard deviations finite and >= 0;
/// offsets, element counts and streams as the builder makes them; and the
/// kMax* bounds above. InvalidArgument naming the unit or tensor.
absl::Status ValidateModelSpec(const ModelSpec& spec);

/// Writes the initial values of elements [begin, begin + out.size()) of a
/// unit's flat vector from the tensors' rules; positions at or past
/// unit.numel (padding) get 0, and so do kGiven tensors (whose values the
/// caller takes from the initial-weights file). A pure function of (seed,
/// tensor, element): independent of the partition.
void InitializeUnitRange(const UnitSpec& unit, uint64_t seed, int64_t begin, std::span<float> out);

/// A run of elements [begin, end), relative to the start of a queried range.
struct ElementRun {
  int64_t begin = 0;
  int64_t end = 0;
};

/// The runs of elements [begin, begin + length) of the unit's flat vector
/// where AdamW weight decay applies, relative to `begin`, in order.
std::vector<ElementRun> WeightDecayRuns(const UnitSpec& unit, int64_t begin, int64_t length);

/// One piece of a tensor that a range of a unit's flat vector covers.
struct TensorPiece {
  const TensorSpec* tensor = nullptr;
  int64_t first = 0;  ///< first element within the tensor
  int64_t at = 0;     ///< where it starts, relative to the queried range
  int64_t count = 0;
};

/// The pieces of tensors in elements [begin, begin + length) of the unit,
/// in order (padding belongs to no tensor).
std::vector<TensorPiece> TensorPieces(const UnitSpec& unit, int64_t begin, int64_t length);

}  // namespace pshard

#endif  // PSHARD_COMMON_MODEL_SPEC_H_
