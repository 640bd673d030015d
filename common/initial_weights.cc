#include "common/initial_weights.h"

#include <algorithm>
#include <map>
#include <set>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/checksum.h"
#include "common/rng.h"
#include "common/safetensors.h"

namespace pshard {

absl::StatusOr<InitialWeights> InitialWeights::Load(const std::string& path, const ModelSpec& spec) {
  absl::StatusOr<SafetensorsFile> file = ReadSafetensors(path);
  if (!file.ok()) return file.status();
  auto bad = [&](auto&&... what) {
    return absl::InvalidArgumentError(absl::StrCat("initial weights ", path, ": ", what...));
  };
  std::map<std::string_view, const SafetensorsTensor*> by_name;
  for (const SafetensorsTensor& t : file->tensors) by_name[t.name] = &t;
  InitialWeights weights;
  weights.values_.resize(spec.num_tensors());
  uint32_t crc = 0;
  int64_t matched = 0;
  for (const UnitSpec& unit : spec.units) {
    for (const TensorSpec& t : unit.tensors) {
      auto it = by_name.find(t.name);
      if (it == by_name.end()) return bad("no tensor ", t.name, " (the layout's ", unit.name, " has it)");
      const SafetensorsTensor& got = *it->second;
      if (got.shape != t.shape) {
        return bad("tensor ", t.name, " has shape [", absl::StrJoin(got.shape, ", "), "]; the layout says [",
                   absl::StrJoin(t.shape, ", "), "]");
      }
      std::vector<float> values = got.ToFloat();
      crc = Crc32c(t.name.data(), t.name.size(), crc);
      crc = Crc32c(t.shape.data(), t.shape.size() * sizeof(int64_t), crc);
      crc = Crc32c(values.data(), values.size() * sizeof(float), crc);
      weights.values_[t.rng_stream] = std::move(values);
      ++matched;
    }
  }
  if (matched != static_cast<int64_t>(file->tensors.size())) {
    std::set<std::string_view> names;
    for (const UnitSpec& unit : spec.units) {
      for (const TensorSpec& t : unit.tensors) names.insert(t.name);
    }
    for (const SafetensorsTensor& t : file->tensors) {
      if (names.count(t.name) == 0) return bad("tensor ", t.name, " is not in the layout (", spec.model, ")");
    }
  }
  // Never 0: 0 means "no initial-weights file" in a job.
  weights.fingerprint_ = Mix64((static_cast<uint64_t>(crc) << 32) ^ static_cast<uint64_t>(spec.TotalParameters())) | 1;
  return weights;
}

void InitialWeights::FillUnitRange(const UnitSpec& unit, int64_t begin, std::span<float> out) const {
  std::fill(out.begin(), out.end(), 0.0f);
  for (const TensorPiece& p : TensorPieces(unit, begin, static_cast<int64_t>(out.size()))) {
    const std::vector<float>& values = values_[p.tensor->rng_stream];
    std::copy_n(values.begin() + p.first, p.count, out.begin() + p.at);
  }
}

}  // namespace pshard
