// Element encodings used on the wire for fetched weights and pushed gradients.
#ifndef PSHARD_COMMON_WIRE_ENCODING_H_
#define PSHARD_COMMON_WIRE_ENCODING_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace pshard {

enum class WireEncoding { kFp32 = 1, kBf16 = 2 };

/// Bytes one element takes in `encoding`.
size_t BytesPerElement(WireEncoding encoding);
std::string_view WireEncodingName(WireEncoding encoding);
absl::StatusOr<WireEncoding> ParseWireEncoding(std::string_view name);

/// A trainer's encoding per direction: of the weights it fetches and of the
/// gradients it pushes. One encoding converts to both, as `--encoding` is
/// the shorthand for `--weight_encoding` and `--grad_encoding`.
struct WireEncodings {
  WireEncodings() = default;
  WireEncodings(WireEncoding both) : weights(both), grads(both) {}  // implicit: the shorthand
  WireEncodings(WireEncoding w, WireEncoding g) : weights(w), grads(g) {}
  bool operator==(const WireEncodings&) const = default;
  /// "bf16" when both are the same, else "weights bf16, gradients fp32".
  std::string ToString() const;

  WireEncoding weights = WireEncoding::kFp32;
  WireEncoding grads = WireEncoding::kFp32;
};

/// The command lines' `--encoding` (both directions) with the overrides
/// `--weight_encoding` and `--grad_encoding` (empty: as `both`). An error
/// names the flag whose value is not an encoding.
absl::StatusOr<WireEncodings> ParseWireEncodings(std::string_view both, std::string_view weights,
                                                 std::string_view grads);

/// Encodes `values` into `out` (values.size() * BytesPerElement bytes).
void EncodeElements(WireEncoding encoding, std::span<const float> values, std::byte* out);
/// Decodes `count` elements from `in` into `out`.
void DecodeElements(WireEncoding encoding, const std::byte* in, std::span<float> out);
/// Decodes `out.size()` elements from `in` into `out` and returns the CRC-32C
/// of the encoded bytes continued from `crc`, in one pass over them.
uint32_t DecodeAndChecksum(WireEncoding encoding, const std::byte* in, std::span<float> out, uint32_t crc);
/// The same for a slice whose encoded bytes were received into the tail of
/// its own fp32 buffer (the last buffer.size() * BytesPerElement bytes):
/// decodes them forward, in place, into the whole buffer.
uint32_t DecodeTailInPlaceAndChecksum(WireEncoding encoding, std::span<float> buffer, uint32_t crc);

/// Replaces each value by what an encode/decode round trip yields.
void RoundTripInPlace(WireEncoding encoding, std::span<float> values);

}  // namespace pshard

#endif  // PSHARD_COMMON_WIRE_ENCODING_H_
