// A layout as a JSON document: how a layout travels outside the protocol
// (the servers' --layout file, the PyTorch bridge, checkpoints), and its
// fingerprint.
//
//   {"format": "pshard-layout/1", "model": "gpt layers=2 ...",
//    "units": [{"name": "embed",
//               "tensors": [{"name": "embed.wte", "shape": [256, 16],
//                            "init": "normal", "std": 0.02,
//                            "weight_decay": true}, ...]}, ...]}
//
// "init" is normal (with "std"), zeros, ones or given (values from the
// job's initial-weights file); "weight_decay" defaults to false. Offsets
// follow from the order.
#ifndef PSHARD_COMMON_LAYOUT_FILE_H_
#define PSHARD_COMMON_LAYOUT_FILE_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/model_spec.h"

namespace pshard {

inline constexpr char kLayoutFormat[] = "pshard-layout/1";

/// The layout as a JSON document (members in key order; with `one_line`,
/// one line). ParseLayoutJson reads it back to an equal layout.
std::string FormatLayoutJson(const ModelSpec& spec, bool one_line = false);

/// Parses and validates a layout document; InvalidArgument naming the
/// unit, tensor or member that is wrong (unknown members included).
absl::StatusOr<ModelSpec> ParseLayoutJson(std::string_view text);

/// Reads a layout file; NotFound when it cannot be read, and the path in
/// every error.
absl::StatusOr<ModelSpec> ReadLayoutFile(const std::string& path);

/// A 64-bit hash of everything in the layout (the one-line document):
/// layouts that differ in any name, shape, rule or order differ in it.
uint64_t LayoutFingerprint(const ModelSpec& spec);

/// "0x" and 16 hex digits.
std::string FingerprintHex(uint64_t fingerprint);

}  // namespace pshard

#endif  // PSHARD_COMMON_LAYOUT_FILE_H_
