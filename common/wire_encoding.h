// Element encodings used on the wire for fetched weights and pushed gradients.
#ifndef PSHARD_COMMON_WIRE_ENCODING_H_
#define PSHARD_COMMON_WIRE_ENCODING_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "absl/status/statusor.h"

namespace pshard {

enum class WireEncoding { kFp32 = 1, kBf16 = 2 };

/// Bytes one element takes in `encoding`.
size_t BytesPerElement(WireEncoding encoding);
std::string_view WireEncodingName(WireEncoding encoding);
absl::StatusOr<WireEncoding> ParseWireEncoding(std::string_view name);

/// Encodes `values` into `out` (values.size() * BytesPerElement bytes).
void EncodeElements(WireEncoding encoding, std::span<const float> values, std::byte* out);
/// Decodes `count` elements from `in` into `out`.
void DecodeElements(WireEncoding encoding, const std::byte* in, std::span<float> out);
/// Replaces each value by what an encode/decode round trip yields.
void RoundTripInPlace(WireEncoding encoding, std::span<float> values);

}  // namespace pshard

#endif  // PSHARD_COMMON_WIRE_ENCODING_H_
