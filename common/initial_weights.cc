#include "common/initial_weights.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/bf16.h"
#include "common/checksum.h"
#include "common/rng.h"
#include "common/safetensors.h"

namespace pshard {

namespace {

// Elements read and widened at a time.
constexpr int64_t kChunkElements = int64_t{1} << 20;

// Reads `out.size()` elements of `dtype` at byte `offset` of `in` into
// `out`, widened to fp32, through `raw` (a piece at a time).
bool ReadElements(std::ifstream& in, SafetensorsDtype dtype, uint64_t offset, std::span<float> out, std::string& raw) {
  const int element_bytes = SafetensorsDtypeBytes(dtype);
  in.seekg(static_cast<std::streamoff>(offset));
  for (size_t at = 0; at < out.size(); at += kChunkElements) {
    const size_t n = std::min<size_t>(kChunkElements, out.size() - at);
    raw.resize(n * element_bytes);
    if (!in.read(raw.data(), static_cast<std::streamsize>(raw.size()))) return false;
    if (dtype == SafetensorsDtype::kF32) {
      std::memcpy(out.data() + at, raw.data(), raw.size());
    } else {
      for (size_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, raw.data() + 2 * i, 2);
        out[at + i] = Bf16ToFloat(b);
      }
    }
  }
  return true;
}

}  // namespace

absl::StatusOr<InitialWeights> InitialWeights::Load(const std::string& path, const ModelSpec& spec) {
  auto bad = [&](auto&&... what) {
    return absl::InvalidArgumentError(absl::StrCat("initial weights ", path, ": ", what...));
  };
  absl::StatusOr<SafetensorsIndex> index = ReadSafetensorsIndex(path);
  if (!index.ok()) return index.status();
  std::map<std::string_view, const SafetensorsEntry*> by_name;
  for (const SafetensorsEntry& t : index->tensors) by_name[t.name] = &t;
  InitialWeights weights;
  weights.path_ = path;
  weights.sources_.resize(spec.num_tensors());
  // Every name and shape first: a file that does not fit is refused before
  // its data is read.
  for (const UnitSpec& unit : spec.units) {
    for (const TensorSpec& t : unit.tensors) {
      auto it = by_name.find(t.name);
      if (it == by_name.end()) return bad("no tensor ", t.name, " (the layout's ", unit.name, " has it)");
      if (it->second->shape != t.shape) {
        return bad("tensor ", t.name, " has shape [", absl::StrJoin(it->second->shape, ", "), "]; the layout says [",
                   absl::StrJoin(t.shape, ", "), "]");
      }
      weights.sources_[t.rng_stream] = {it->second->dtype, it->second->offset};
    }
  }
  if (static_cast<int64_t>(index->tensors.size()) != spec.num_tensors()) {
    std::set<std::string_view> names;
    for (const UnitSpec& unit : spec.units) {
      for (const TensorSpec& t : unit.tensors) names.insert(t.name);
    }
    for (const SafetensorsEntry& t : index->tensors) {
      if (names.count(t.name) == 0) return bad("tensor ", t.name, " is not in the layout (", spec.model, ")");
    }
  }

  std::error_code error;
  weights.size_ = std::filesystem::file_size(path, error);
  if (!error) weights.modified_ = std::filesystem::last_write_time(path, error);
  std::ifstream in(path, std::ios::binary);
  if (error || !in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::string raw;
  std::vector<float> chunk;
  uint32_t crc = 0;
  for (const UnitSpec& unit : spec.units) {
    for (const TensorSpec& t : unit.tensors) {
      const Source& source = weights.sources_[t.rng_stream];
      crc = Crc32c(t.name.data(), t.name.size(), crc);
      crc = Crc32c(t.shape.data(), t.shape.size() * sizeof(int64_t), crc);
      for (int64_t at = 0; at < t.numel; at += kChunkElements) {
        chunk.resize(std::min(kChunkElements, t.numel - at));
        if (!ReadElements(in, source.dtype, source.offset + at * SafetensorsDtypeBytes(source.dtype), chunk, raw)) {
          return bad("cannot read the data of tensor ", t.name, " (the file is shorter than its header says)");
        }
        crc = Crc32c(chunk.data(), chunk.size() * sizeof(float), crc);
      }
    }
  }
  // Never 0: 0 means "no initial-weights file" in a job.
  weights.fingerprint_ = Mix64((static_cast<uint64_t>(crc) << 32) ^ static_cast<uint64_t>(spec.TotalParameters())) | 1;
  return weights;
}

absl::Status InitialWeights::ReadUnitRange(const UnitSpec& unit, int64_t begin, std::span<float> out) const {
  std::fill(out.begin(), out.end(), 0.0f);
  std::error_code error;
  const uint64_t size = std::filesystem::file_size(path_, error);
  const std::filesystem::file_time_type modified = error ? modified_ : std::filesystem::last_write_time(path_, error);
  if (error) return absl::DataLossError(absl::StrCat("initial weights ", path_, ": cannot read: ", error.message()));
  if (size != size_ || modified != modified_) {
    return absl::DataLossError(absl::StrCat("initial weights ", path_,
                                            ": the file changed after it was checked; start again from a file "
                                            "that stays as it is"));
  }
  std::ifstream in(path_, std::ios::binary);
  std::string raw;
  for (const TensorPiece& p : TensorPieces(unit, begin, static_cast<int64_t>(out.size()))) {
    const Source& source = sources_[p.tensor->rng_stream];
    if (!in || !ReadElements(in, source.dtype, source.offset + p.first * SafetensorsDtypeBytes(source.dtype),
                             out.subspan(p.at, p.count), raw)) {
      return absl::DataLossError(absl::StrCat("initial weights ", path_, ": cannot read tensor ", p.tensor->name));
    }
  }
  return absl::OkStatus();
}

}  // namespace pshard
