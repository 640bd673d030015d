// What every harness uses: how it reads libFuzzer's bytes (one byte of
// choices, then records, each a 16-bit little-endian length and that many
// bytes; the last record takes whatever is left when its length runs past
// the end), how it fails, and where it may write files. The seed generator
// (make_seeds.cc) writes inputs with FuzzRecords.
#ifndef PSHARD_FUZZ_HARNESS_H_
#define PSHARD_FUZZ_HARNESS_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace pshard::fuzz {

/// Reads an input from the front. Does not own the bytes.
class FuzzInput {
 public:
  FuzzInput(const uint8_t* data, size_t size)
      : bytes_(reinterpret_cast<const char*>(data), size) {}
  explicit FuzzInput(std::string_view bytes) : bytes_(bytes) {}

  /// The first byte (0 for an empty input); the records start after it.
  uint8_t choices() const { return bytes_.empty() ? 0 : static_cast<uint8_t>(bytes_[0]); }
  bool done() const { return at_ >= bytes_.size(); }
  /// The next record; empty once done().
  std::string_view NextRecord();
  /// Every record left, at most `limit` of them.
  std::vector<std::string_view> Records(size_t limit);

 private:
  std::string_view bytes_;
  size_t at_ = 1;
};

/// An input that FuzzInput reads back as `choices` and `records`.
std::string FuzzRecords(uint8_t choices, const std::vector<std::string>& records);

/// Stops the process with `what` when an invariant does not hold: libFuzzer
/// reports the input as a crash.
void Require(bool holds, std::string_view what);

/// A folder of this process's own, made on first use under $TMPDIR (or
/// /tmp) and left there for the process's life.
const std::string& ScratchFolder();

}  // namespace pshard::fuzz

#endif  // PSHARD_FUZZ_HARNESS_H_
