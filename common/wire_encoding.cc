#include "common/wire_encoding.h"

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/bf16.h"

namespace pshard {

size_t BytesPerElement(WireEncoding encoding) {
  return encoding == WireEncoding::kBf16 ? 2 : 4;
}

std::string_view WireEncodingName(WireEncoding encoding) {
  return encoding == WireEncoding::kBf16 ? "bf16" : "fp32";
}

absl::StatusOr<WireEncoding> ParseWireEncoding(std::string_view name) {
  if (name == "fp32") return WireEncoding::kFp32;
  if (name == "bf16") return WireEncoding::kBf16;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown wire encoding '", std::string(name), "' (expected fp32 or bf16)"));
}

void EncodeElements(WireEncoding encoding, std::span<const float> values, std::byte* out) {
  if (encoding == WireEncoding::kFp32) {
    std::memcpy(out, values.data(), values.size_bytes());
    return;
  }
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t b = FloatToBf16(values[i]);
    std::memcpy(out + 2 * i, &b, 2);
  }
}

void DecodeElements(WireEncoding encoding, const std::byte* in, std::span<float> out) {
  if (encoding == WireEncoding::kFp32) {
    std::memcpy(out.data(), in, out.size_bytes());
    return;
  }
  for (size_t i = 0; i < out.size(); ++i) {
    uint16_t b;
    std::memcpy(&b, in + 2 * i, 2);
    out[i] = Bf16ToFloat(b);
  }
}

void RoundTripInPlace(WireEncoding encoding, std::span<float> values) {
  if (encoding == WireEncoding::kBf16) RoundToBf16InPlace(values);
}

}  // namespace pshard
