#include "common/model_spec.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/rng.h"

namespace pshard {

std::string_view InitKindName(InitKind kind) {
  switch (kind) {
    case InitKind::kNormal: return "normal";
    case InitKind::kZeros: return "zeros";
    case InitKind::kOnes: return "ones";
    case InitKind::kGiven: return "given";
  }
  return "unknown";
}

absl::StatusOr<InitKind> InitKindFromName(std::string_view name) {
  for (InitKind kind : {InitKind::kNormal, InitKind::kZeros, InitKind::kOnes, InitKind::kGiven}) {
    if (name == InitKindName(kind)) return kind;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown initialisation \"", std::string(name), "\"; expected normal, zeros, ones or given"));
}

const TensorSpec* UnitSpec::Find(const std::string& name_suffix) const {
  for (const TensorSpec& t : tensors) {
    if (absl::EndsWith(t.name, name_suffix)) return &t;
  }
  return nullptr;
}

int64_t ModelSpec::TotalParameters() const {
  int64_t total = 0;
  for (const UnitSpec& u : units) total += u.numel;
  return total;
}

std::vector<int64_t> ModelSpec::UnitNumels() const {
  std::vector<int64_t> out;
  for (const UnitSpec& u : units) out.push_back(u.numel);
  return out;
}

int ModelSpec::num_tensors() const {
  int n = 0;
  for (const UnitSpec& u : units) n += static_cast<int>(u.tensors.size());
  return n;
}

bool ModelSpec::HasGivenValues() const {
  for (const UnitSpec& u : units) {
    for (const TensorSpec& t : u.tensors) {
      if (t.init == InitKind::kGiven) return true;
    }
  }
  return false;
}

ModelSpecBuilder::ModelSpecBuilder(std::string model) { spec_.model = std::move(model); }

void ModelSpecBuilder::AddUnit(std::string name) {
  UnitSpec unit;
  unit.name = std::move(name);
  spec_.units.push_back(std::move(unit));
}

void ModelSpecBuilder::AddTensor(std::string name, std::vector<int64_t> shape, InitKind init, double init_std,
                                 bool weight_decay) {
  if (spec_.units.empty()) {
    if (error_.empty()) error_ = absl::StrCat("tensor ", name, " comes before any unit");
    return;
  }
  if (tensors_ >= kMaxLayoutTensors) {
    if (error_.empty()) error_ = absl::StrCat("a layout holds at most ", kMaxLayoutTensors, " tensors");
    return;
  }
  UnitSpec& unit = spec_.units.back();
  TensorSpec t;
  t.name = std::move(name);
  t.numel = 1;
  for (int64_t d : shape) {
    // Saturate instead of overflowing: validation refuses the result.
    t.numel = (d < 1 || t.numel > kMaxLayoutElements / d) ? kMaxLayoutElements + 1 : t.numel * d;
  }
  t.shape = std::move(shape);
  t.offset = unit.numel;
  t.init = init;
  t.init_std = init_std;
  t.weight_decay = weight_decay;
  t.rng_stream = static_cast<uint64_t>(tensors_++);
  unit.numel = std::min(unit.numel + t.numel, kMaxLayoutElements + 1);
  unit.tensors.push_back(std::move(t));
}

absl::StatusOr<ModelSpec> ModelSpecBuilder::Build() && {
  if (!error_.empty()) return absl::InvalidArgumentError(error_);
  if (absl::Status s = ValidateModelSpec(spec_); !s.ok()) return s;
  return std::move(spec_);
}

namespace {

bool Printable(std::string_view name) {
  return std::all_of(name.begin(), name.end(), [](char c) { return static_cast<unsigned char>(c) >= 0x20; });
}

absl::Status CheckTensor(const UnitSpec& unit, const TensorSpec& t, int64_t offset, uint64_t stream) {
  auto bad = [&](auto&&... what) {
    return absl::InvalidArgumentError(absl::StrCat("unit ", unit.name, ", tensor \"", t.name, "\": ", what...));
  };
  if (t.name.empty() || t.name.size() > kMaxTensorNameBytes || !Printable(t.name)) {
    return bad("a name is 1 to ", kMaxTensorNameBytes, " printable bytes");
  }
  if (t.name == "__metadata__") return bad("the name is reserved by the safetensors format");
  if (static_cast<int>(t.shape.size()) > kMaxTensorRank) return bad("more than ", kMaxTensorRank, " dimensions");
  int64_t numel = 1;
  for (int64_t d : t.shape) {
    if (d < 1) return bad("dimension ", d, " in shape [", absl::StrJoin(t.shape, ", "), "]: each must be >= 1");
    if (numel > kMaxLayoutElements / d) return bad("more than ", kMaxLayoutElements, " elements");
    numel *= d;
  }
  if (t.numel != numel || t.offset != offset || t.rng_stream != stream) {
    return bad("offset, size or stream inconsistent with the layout (offset ", t.offset, " numel ", t.numel,
               " stream ", t.rng_stream, "; expected ", offset, ", ", numel, ", ", stream, ")");
  }
  if (t.init == InitKind::kNormal && (!std::isfinite(t.init_std) || t.init_std < 0)) {
    return bad("a normal initialisation needs a finite standard deviation >= 0, not ", t.init_std);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateModelSpec(const ModelSpec& spec) {
  if (spec.model.size() > kMaxTensorNameBytes || !Printable(spec.model)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the layout's model words are at most ", kMaxTensorNameBytes, " printable bytes"));
  }
  if (spec.units.empty()) return absl::InvalidArgumentError("the layout has no units");
  if (spec.units.size() > static_cast<size_t>(kMaxLayoutUnits)) {
    return absl::InvalidArgumentError(absl::StrCat("the layout has ", spec.units.size(), " units; at most ",
                                                   kMaxLayoutUnits));
  }
  std::set<std::string_view> unit_names;
  std::set<std::string_view> tensor_names;
  uint64_t stream = 0;
  int64_t total = 0;
  for (const UnitSpec& unit : spec.units) {
    if (unit.name.empty() || unit.name.size() > kMaxTensorNameBytes || !Printable(unit.name)) {
      return absl::InvalidArgumentError(absl::StrCat("unit ", unit_names.size(), " needs a printable name of 1 to ",
                                                     kMaxTensorNameBytes, " bytes"));
    }
    if (!unit_names.insert(unit.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("two units are named ", unit.name));
    }
    if (unit.tensors.empty()) return absl::InvalidArgumentError(absl::StrCat("unit ", unit.name, " has no tensors"));
    int64_t offset = 0;
    for (const TensorSpec& t : unit.tensors) {
      if (absl::Status s = CheckTensor(unit, t, offset, stream++); !s.ok()) return s;
      if (!tensor_names.insert(t.name).second) {
        return absl::InvalidArgumentError(absl::StrCat("two tensors are named ", t.name));
      }
      offset += t.numel;
      if (offset > kMaxLayoutElements) {
        return absl::InvalidArgumentError(
            absl::StrCat("unit ", unit.name, " holds more than ", kMaxLayoutElements, " elements"));
      }
    }
    if (unit.numel != offset) {
      return absl::InvalidArgumentError(
          absl::StrCat("unit ", unit.name, " says ", unit.numel, " elements; its tensors hold ", offset));
    }
    total += offset;
    if (total > kMaxLayoutElements) {
      return absl::InvalidArgumentError(absl::StrCat("the layout holds more than ", kMaxLayoutElements, " elements"));
    }
  }
  return absl::OkStatus();
}

std::vector<TensorPiece> TensorPieces(const UnitSpec& unit, int64_t begin, int64_t length) {
  std::vector<TensorPiece> pieces;
  const int64_t end = begin + length;
  for (const TensorSpec& t : unit.tensors) {
    const int64_t lo = std::max(begin, t.offset);
    const int64_t hi = std::min(end, t.offset + t.numel);
    if (lo < hi) pieces.push_back(TensorPiece{&t, lo - t.offset, lo - begin, hi - lo});
  }
  return pieces;
}

void InitializeUnitRange(const UnitSpec& unit, uint64_t seed, int64_t begin, std::span<float> out) {
  std::fill(out.begin(), out.end(), 0.0f);
  for (const TensorPiece& p : TensorPieces(unit, begin, static_cast<int64_t>(out.size()))) {
    const TensorSpec& t = *p.tensor;
    float* to = out.data() + p.at;
    switch (t.init) {
      case InitKind::kZeros:
      case InitKind::kGiven: break;
      case InitKind::kOnes: std::fill(to, to + p.count, 1.0f); break;
      case InitKind::kNormal:
        for (int64_t i = 0; i < p.count; ++i) {
          to[i] = static_cast<float>(t.init_std * NormalAt(seed, t.rng_stream, p.first + i));
        }
        break;
    }
  }
}

std::vector<ElementRun> WeightDecayRuns(const UnitSpec& unit, int64_t begin, int64_t length) {
  std::vector<ElementRun> runs;
  for (const TensorPiece& p : TensorPieces(unit, begin, length)) {
    if (!p.tensor->weight_decay) continue;
    if (!runs.empty() && runs.back().end == p.at) {
      runs.back().end = p.at + p.count;
    } else {
      runs.push_back({p.at, p.at + p.count});
    }
  }
  return runs;
}

}  // namespace pshard
