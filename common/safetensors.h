// The safetensors file format, written and read: how pshard's weights go to
// and come from the rest of the ecosystem (export, --init_from).
//
// A file is an 8-byte little-endian header length H, H bytes of UTF-8 JSON,
// then the data. The JSON maps each tensor's name to its "dtype", "shape"
// and "data_offsets" [begin, end) within the data, and may hold
// "__metadata__", a map of strings to strings. Tensors are little-endian,
// row-major, back to back with no gaps. This writer pads the header with
// spaces so that the data starts 8-byte aligned, as the reference writer
// does; the reader takes any padding.
#ifndef PSHARD_COMMON_SAFETENSORS_H_
#define PSHARD_COMMON_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pshard {

/// The element types pshard writes and reads.
enum class SafetensorsDtype { kF32, kBF16 };

/// "F32" or "BF16", as the header spells them.
std::string_view SafetensorsDtypeName(SafetensorsDtype dtype);
int SafetensorsDtypeBytes(SafetensorsDtype dtype);

/// One tensor to write: its bytes are borrowed.
struct SafetensorsTensorView {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  std::vector<int64_t> shape;
  std::span<const uint8_t> data;  ///< product(shape) elements of dtype, little-endian
};

/// The largest header this reader takes (the reference reader's bound).
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

/// The file's bytes: the header, then the tensors in the order given.
/// InvalidArgument (and nothing returned) for an empty or repeated name, a
/// name "__metadata__", a negative dimension, or data whose size is not the
/// shape's.
absl::StatusOr<std::string> EncodeSafetensors(std::span<const SafetensorsTensorView> tensors,
                                              const std::map<std::string, std::string>& metadata);

/// Writes EncodeSafetensors' bytes to `path` whole or not at all: a
/// temporary file beside it, flushed to disk, renamed into place.
absl::Status WriteSafetensors(const std::string& path, std::span<const SafetensorsTensorView> tensors,
                              const std::map<std::string, std::string>& metadata);

/// One tensor of a read file.
struct SafetensorsTensor {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  std::string data;  ///< numel elements of dtype, little-endian

  /// The elements as fp32 (bf16 widened exactly).
  std::vector<float> ToFloat() const;
};

struct SafetensorsFile {
  std::vector<SafetensorsTensor> tensors;  ///< in the order of their data
  std::map<std::string, std::string> metadata;

  /// The tensor named `name`, or nullptr.
  const SafetensorsTensor* Find(std::string_view name) const;
};

/// Where one tensor of a file lies, from its header: read the bytes
/// [offset, offset + bytes) of the file for its data.
struct SafetensorsEntry {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  uint64_t offset = 0;  ///< from the start of the file
  uint64_t bytes = 0;
};

/// A file's header, checked against the file's size: what a reader needs
/// to take one tensor, or a part of one, without holding the rest.
struct SafetensorsIndex {
  std::vector<SafetensorsEntry> tensors;  ///< in the order of their data
  std::map<std::string, std::string> metadata;

  /// The entry named `name`, or nullptr.
  const SafetensorsEntry* Find(std::string_view name) const;
};

/// Parses the header of a file of `file_size` bytes that starts with
/// `head` (the 8-byte length and the header, at least). The same checks,
/// and refusals, as ParseSafetensors.
absl::StatusOr<SafetensorsIndex> ParseSafetensorsIndex(std::string_view head, uint64_t file_size);

/// Reads the header of `path` (and its size), not its data; NotFound when
/// it cannot be read.
absl::StatusOr<SafetensorsIndex> ReadSafetensorsIndex(const std::string& path);

/// Parses a whole file held in memory. InvalidArgument naming what is wrong
/// for anything that is not a well-formed file of F32 and BF16 tensors: a
/// short or oversized header, JSON that is not an object of tensors, an
/// unknown dtype, a shape that does not match the offsets, offsets that
/// overlap, leave gaps or run past the end, data beyond the last tensor.
absl::StatusOr<SafetensorsFile> ParseSafetensors(std::string_view bytes);

/// Reads and parses `path`; NotFound when it cannot be read.
absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path);

}  // namespace pshard

#endif  // PSHARD_COMMON_SAFETENSORS_H_
