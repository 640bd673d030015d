// The safetensors reader (pshard-server --init_from): the input is a
// file's bytes. A file that ParseSafetensors reads is written back by
// EncodeSafetensors to bytes that read back to the same tensors and
// metadata; and the initial weights of a small layout either load from it
// or are refused with a message, never half-loaded, and a shard's slice
// of them is the whole's.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/initial_weights.h"
#include "common/safetensors.h"
#include "fuzz/harness.h"

namespace pshard::fuzz {
namespace {

const ModelSpec& SmallLayout() {
  static const ModelSpec* spec = [] {
    ModelSpecBuilder b("fuzz");
    b.AddUnit("u");
    b.AddTensor("w", {2, 3}, InitKind::kGiven, 0.0, true);
    b.AddTensor("b", {3}, InitKind::kGiven, 0.0, false);
    return new ModelSpec(*std::move(b).Build());
  }();
  return *spec;
}

void FuzzSafetensors(std::string_view bytes) {
  const absl::StatusOr<SafetensorsFile> file = ParseSafetensors(bytes);
  if (!file.ok()) return;
  std::vector<SafetensorsTensorView> views;
  for (const SafetensorsTensor& t : file->tensors) {
    views.push_back({t.name, t.dtype, t.shape,
                     std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(t.data.data()), t.data.size())});
  }
  const absl::StatusOr<std::string> written = EncodeSafetensors(views, file->metadata);
  Require(written.ok(), absl::StrCat("a file that reads does not write back: ", written.status().message()));
  const absl::StatusOr<SafetensorsFile> again = ParseSafetensors(*written);
  Require(again.ok() && again->tensors.size() == file->tensors.size() && again->metadata == file->metadata,
          "a safetensors file changed on its way back");
  for (size_t i = 0; i < file->tensors.size(); ++i) {
    const SafetensorsTensor& a = file->tensors[i];
    const SafetensorsTensor& b = again->tensors[i];
    Require(a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.data == b.data,
            absl::StrCat("tensor ", a.name, " changed on its way back"));
  }
  const std::string path = ScratchFolder() + "/weights.safetensors";
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  const absl::StatusOr<InitialWeights> weights = InitialWeights::Load(path, SmallLayout());
  if (!weights.ok()) {
    Require(!weights.status().message().empty(), "initial weights refused without a message");
    return;
  }
  Require(weights->fingerprint() != 0, "initial weights with fingerprint 0 (none)");
  std::vector<float> unit(16, -1.0f);
  Require(weights->ReadUnitRange(SmallLayout().units[0], 0, unit).ok(), "a loaded file's unit cannot be read");
  for (int i = 9; i < 16; ++i) Require(unit[i] == 0.0f, "padding filled from a file");
  // A shard's slice, read on its own, is the same part of the whole.
  std::vector<float> slice(8, -1.0f);
  Require(weights->ReadUnitRange(SmallLayout().units[0], 4, slice).ok(), "a loaded file's slice cannot be read");
  Require(std::memcmp(slice.data(), unit.data() + 4, slice.size() * sizeof(float)) == 0,  // bits: NaNs too
          "a shard's slice of initial weights differs from the whole's");
}

}  // namespace
}  // namespace pshard::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pshard::fuzz::FuzzSafetensors(std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
