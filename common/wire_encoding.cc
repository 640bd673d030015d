#include "common/wire_encoding.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "common/checksum.h"
#include "common/copy.h"
#include "common/status_macros.h"

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

absl::StatusOr<WireEncodings> ParseWireEncodings(std::string_view both, std::string_view weights,
                                                 std::string_view grads) {
  auto parse = [](std::string_view flag, std::string_view value) -> absl::StatusOr<WireEncoding> {
    absl::StatusOr<WireEncoding> e = ParseWireEncoding(value);
    if (!e.ok()) return absl::InvalidArgumentError(absl::StrCat("--", std::string(flag), ": ", e.status().message()));
    return e;
  };
  ASSIGN_OR_RETURN(const WireEncoding shorthand, parse("encoding", both));
  WireEncodings out(shorthand);
  if (!weights.empty()) {
    ASSIGN_OR_RETURN(out.weights, parse("weight_encoding", weights));
  }
  if (!grads.empty()) {
    ASSIGN_OR_RETURN(out.grads, parse("grad_encoding", grads));
  }
  return out;
}

std::string WireEncodings::ToString() const {
  if (weights == grads) return std::string(WireEncodingName(weights));
  return absl::StrCat("weights ", std::string(WireEncodingName(weights)), ", gradients ",
                      std::string(WireEncodingName(grads)));
}

void EncodeElements(WireEncoding encoding, std::span<const float> values, std::byte* out) {
  if (encoding == WireEncoding::kFp32) {
    CopyBytes(out, values.data(), values.size_bytes());
    return;
  }
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t b = FloatToBf16(values[i]);
    std::memcpy(out + 2 * i, &b, 2);
  }
}

void DecodeElements(WireEncoding encoding, const std::byte* in, std::span<float> out) {
  if (encoding == WireEncoding::kFp32) {
    CopyBytes(out.data(), in, out.size_bytes());
    return;
  }
  for (size_t i = 0; i < out.size(); ++i) {
    uint16_t b;
    std::memcpy(&b, in + 2 * i, 2);
    out[i] = Bf16ToFloat(b);
  }
}

uint32_t DecodeAndChecksum(WireEncoding encoding, const std::byte* in, std::span<float> out, uint32_t crc) {
  const size_t width = BytesPerElement(encoding);
  // Block by block: each block is checksummed and decoded while in cache.
  constexpr size_t kBlock = 8192;
  for (size_t at = 0; at < out.size(); at += kBlock) {
    const size_t n = std::min(kBlock, out.size() - at);
    crc = Crc32c(in + at * width, n * width, crc);
    if (reinterpret_cast<const std::byte*>(out.data() + at) != in + at * width) {
      DecodeElements(encoding, in + at * width, out.subspan(at, n));
    }
  }
  return crc;
}

uint32_t DecodeTailInPlaceAndChecksum(WireEncoding encoding, std::span<float> buffer, uint32_t crc) {
  const size_t width = BytesPerElement(encoding);
  if (width == sizeof(float)) return Crc32c(buffer.data(), buffer.size_bytes(), crc);
  const std::byte* tail = reinterpret_cast<const std::byte*>(buffer.data()) + buffer.size_bytes() -
                          buffer.size() * width;
  // Forward: element i's fp32 bytes end at 4(i+1), before the encoded bytes
  // of every later element begin (at tail + width(i+1)). Each block is
  // copied out before its decoded values overwrite it.
  constexpr size_t kBlock = 4096;
  std::byte block[kBlock * sizeof(float)];
  for (size_t at = 0; at < buffer.size(); at += kBlock) {
    const size_t n = std::min(kBlock, buffer.size() - at);
    CopyBytes(block, tail + at * width, n * width);
    crc = Crc32c(block, n * width, crc);
    DecodeElements(encoding, block, buffer.subspan(at, n));
  }
  return crc;
}

void RoundTripInPlace(WireEncoding encoding, std::span<float> values) {
  if (encoding == WireEncoding::kBf16) RoundToBf16InPlace(values);
}

}  // namespace pshard
