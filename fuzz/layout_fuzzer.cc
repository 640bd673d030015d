// The layout file (pshard-server --layout, checkpoints' recorded layout):
// the input is the document's text. A layout that ParseLayoutJson reads
// is valid, writes back (indented and on one line) to a document that
// reads back to the same layout and fingerprint, partitions over a few N,
// and initialises any range of a unit with its padding zero.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/layout_file.h"
#include "common/partition.h"
#include "fuzz/harness.h"

namespace pshard::fuzz {
namespace {

void FuzzLayout(std::string_view text) {
  const absl::StatusOr<ModelSpec> spec = ParseLayoutJson(text);
  if (!spec.ok()) return;
  Require(ValidateModelSpec(*spec).ok(), "ParseLayoutJson returned a layout that does not validate");
  const uint64_t fingerprint = LayoutFingerprint(*spec);
  for (bool one_line : {false, true}) {
    const std::string written = FormatLayoutJson(*spec, one_line);
    const absl::StatusOr<ModelSpec> again = ParseLayoutJson(written);
    Require(again.ok(), absl::StrCat("FormatLayoutJson wrote what ParseLayoutJson refuses (",
                                     again.status().message(), ")"));
    Require(LayoutFingerprint(*again) == fingerprint, "a layout changed on its way back through its document");
    Require(FormatLayoutJson(*again, one_line) == written, "a layout document changed on its way back");
  }
  // Initialising is bounded by what a fuzz input may allocate.
  for (const UnitSpec& unit : spec->units) {
    for (int shards : {1, 3, 7}) {
      const absl::StatusOr<UnitPartition> p = PartitionUnit(unit.numel, shards, 16);
      Require(p.ok(), absl::StrCat("unit ", unit.name, " of a valid layout does not partition"));
      const SliceRange last = p->Slice(shards - 1);
      const int64_t length = std::min<int64_t>(last.length, 4096);
      std::vector<float> values(length, -1.0f);
      InitializeUnitRange(unit, 1, last.begin, values);
      for (int64_t i = std::max<int64_t>(0, last.valid); i < length; ++i) {
        Require(values[i] == 0.0f, absl::StrCat("padding of unit ", unit.name, " initialised to ", values[i]));
      }
    }
  }
}

}  // namespace
}  // namespace pshard::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pshard::fuzz::FuzzLayout(std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
