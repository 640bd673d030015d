#include "common/wire_encoding.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "common/block_quant.h"
#include "common/checksum.h"
#include "common/copy.h"
#include "common/status_macros.h"

namespace pshard {
namespace {

CodeBits Bits(WireEncoding encoding) { return encoding == WireEncoding::kInt8 ? CodeBits::k8 : CodeBits::k4; }

// Elements handled at once by the block-by-block loops below, so that each
// piece is checksummed and decoded while it is in cache: about 16 KiB of
// output, in whole grains.
size_t GroupElements(const WireFormat& format) {
  const size_t grain = format.GrainElements();
  return std::max<size_t>(1, 4096 / grain) * grain;
}

}  // namespace

bool IsQuantized(WireEncoding encoding) {
  return encoding == WireEncoding::kInt8 || encoding == WireEncoding::kInt4;
}

std::string_view WireEncodingName(WireEncoding encoding) {
  switch (encoding) {
    case WireEncoding::kFp32:
      return "fp32";
    case WireEncoding::kBf16:
      return "bf16";
    case WireEncoding::kInt8:
      return "int8";
    case WireEncoding::kInt4:
      return "int4";
  }
  return "unknown";
}

absl::StatusOr<WireEncoding> ParseWireEncoding(std::string_view name) {
  for (WireEncoding e : {WireEncoding::kFp32, WireEncoding::kBf16, WireEncoding::kInt8, WireEncoding::kInt4}) {
    if (name == WireEncodingName(e)) return e;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown wire encoding '", std::string(name), "' (expected fp32, bf16, int8 or int4)"));
}

absl::Status CheckQuantBlock(int64_t block) {
  if (block < kMinQuantBlock || block > kMaxQuantBlock || block % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("quantization block ", block, " is not a multiple of 16 in [",
                                                   kMinQuantBlock, ", ", kMaxQuantBlock, "]"));
  }
  return absl::OkStatus();
}

WireFormat::WireFormat(WireEncoding encoding, int block)
    : encoding_(encoding), block_(IsQuantized(encoding) ? std::max(block, 1) : 0) {}

std::string WireFormat::ToString() const {
  if (!quantized()) return std::string(WireEncodingName(encoding_));
  return absl::StrCat(std::string(WireEncodingName(encoding_)), " (blocks of ", block_, ")");
}

size_t WireFormat::EncodedBytes(size_t elements) const {
  switch (encoding_) {
    case WireEncoding::kFp32:
      return elements * 4;
    case WireEncoding::kBf16:
      return elements * 2;
    case WireEncoding::kInt8:
    case WireEncoding::kInt4: {
      const size_t b = static_cast<size_t>(block_);
      const size_t whole = elements / b;
      const size_t rest = elements % b;
      return whole * QuantBlockBytes(Bits(encoding_), b) + (rest > 0 ? QuantBlockBytes(Bits(encoding_), rest) : 0);
    }
  }
  return 0;
}

size_t WireFormat::ElementsPerPiece(size_t max_bytes) const {
  return std::max<size_t>(1, max_bytes / GrainBytes()) * GrainElements();
}

std::optional<size_t> WireFormat::ElementsIn(size_t bytes, size_t remaining) const {
  if (bytes == EncodedBytes(remaining)) return remaining;
  if (bytes % GrainBytes() != 0) return std::nullopt;
  const size_t elements = bytes / GrainBytes() * GrainElements();
  if (elements >= remaining) return std::nullopt;
  return elements;
}

std::string WireEncodings::ToString() const {
  std::string out = weights == grads ? std::string(WireEncodingName(weights))
                                     : absl::StrCat("weights ", std::string(WireEncodingName(weights)),
                                                    ", gradients ", std::string(WireEncodingName(grads)));
  if (IsQuantized(weights) || IsQuantized(grads)) absl::StrAppend(&out, ", blocks of ", quant_block);
  return out;
}

absl::StatusOr<WireEncodings> ParseWireEncodings(std::string_view both, std::string_view weights,
                                                 std::string_view grads, int64_t quant_block) {
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
  if (out.weights == WireEncoding::kInt4) {
    return absl::InvalidArgumentError(absl::StrCat(
        weights.empty() ? "--encoding" : "--weight_encoding",
        ": weights travel as fp32, bf16 or int8 (int4 is for gradients: --grad_encoding=int4)"));
  }
  if (absl::Status s = CheckQuantBlock(quant_block); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--quant_block: ", s.message()));
  }
  out.quant_block = static_cast<int>(quant_block);
  return out;
}

void EncodeElements(const WireFormat& format, std::span<const float> values, std::byte* out) {
  switch (format.encoding()) {
    case WireEncoding::kFp32:
      CopyBytes(out, values.data(), values.size_bytes());
      return;
    case WireEncoding::kBf16:
      for (size_t i = 0; i < values.size(); ++i) {
        const uint16_t b = FloatToBf16(values[i]);
        std::memcpy(out + 2 * i, &b, 2);
      }
      return;
    case WireEncoding::kInt8:
    case WireEncoding::kInt4: {
      const size_t b = static_cast<size_t>(format.block());
      for (size_t at = 0; at < values.size(); at += b) {
        const size_t n = std::min(b, values.size() - at);
        QuantizeBlock(Bits(format.encoding()), values.subspan(at, n), out + format.EncodedBytes(at));
      }
      return;
    }
  }
}

bool EncodeDecodedExactly(const WireFormat& format, std::span<const float> values, std::byte* out) {
  if (!format.quantized()) {
    EncodeElements(format, values, out);
    std::vector<float> back(values.size());
    DecodeElements(format, out, back);
    return std::memcmp(back.data(), values.data(), values.size_bytes()) == 0;
  }
  const size_t b = static_cast<size_t>(format.block());
  for (size_t at = 0; at < values.size(); at += b) {
    const size_t n = std::min(b, values.size() - at);
    if (!RecodeDecodedBlock(Bits(format.encoding()), values.subspan(at, n), out + format.EncodedBytes(at))) {
      return false;
    }
  }
  return true;
}

void DecodeElements(const WireFormat& format, const std::byte* in, std::span<float> out) {
  switch (format.encoding()) {
    case WireEncoding::kFp32:
      CopyBytes(out.data(), in, out.size_bytes());
      return;
    case WireEncoding::kBf16:
      for (size_t i = 0; i < out.size(); ++i) {
        uint16_t b;
        std::memcpy(&b, in + 2 * i, 2);
        out[i] = Bf16ToFloat(b);
      }
      return;
    case WireEncoding::kInt8:
    case WireEncoding::kInt4: {
      const size_t b = static_cast<size_t>(format.block());
      for (size_t at = 0; at < out.size(); at += b) {
        const size_t n = std::min(b, out.size() - at);
        DequantizeBlock(Bits(format.encoding()), in + format.EncodedBytes(at), out.subspan(at, n));
      }
      return;
    }
  }
}

void DecodeRange(const WireFormat& format, const std::byte* slice, size_t slice_elements, size_t offset,
                 std::span<float> out) {
  const size_t grain = format.GrainElements();
  size_t at = offset;
  const size_t end = offset + out.size();
  std::vector<float> partial;
  while (at < end) {
    const size_t first = at / grain * grain;
    if (at == first) {  // whole grains: straight into out
      const size_t n = end == slice_elements ? end - at : (end - at) / grain * grain;
      if (n > 0) {
        DecodeElements(format, slice + format.EncodedBytes(at), out.subspan(at - offset, n));
        at += n;
        continue;
      }
    }
    const size_t length = std::min(grain, slice_elements - first);
    const size_t take = std::min(first + length, end) - at;
    partial.resize(length);
    DecodeElements(format, slice + format.EncodedBytes(first), partial);
    std::copy_n(partial.begin() + (at - first), take, out.begin() + (at - offset));
    at += take;
  }
}

uint32_t DecodeAndChecksum(const WireFormat& format, const std::byte* in, std::span<float> out, uint32_t crc) {
  const size_t group = GroupElements(format);
  for (size_t at = 0; at < out.size(); at += group) {
    const size_t n = std::min(group, out.size() - at);
    const std::byte* from = in + format.EncodedBytes(at);
    crc = Crc32c(from, format.EncodedBytes(at + n) - format.EncodedBytes(at), crc);
    if (reinterpret_cast<const std::byte*>(out.data() + at) != from) {
      DecodeElements(format, from, out.subspan(at, n));
    }
  }
  return crc;
}

bool FitsInFloats(const WireFormat& format, size_t elements) {
  return format.EncodedBytes(elements) <= elements * sizeof(float);
}

uint32_t DecodeTailInPlaceAndChecksum(const WireFormat& format, std::span<float> buffer, uint32_t crc) {
  if (format.encoding() == WireEncoding::kFp32) return Crc32c(buffer.data(), buffer.size_bytes(), crc);
  const size_t total = format.EncodedBytes(buffer.size());
  const std::byte* tail = reinterpret_cast<const std::byte*>(buffer.data()) + buffer.size_bytes() - total;
  // Forward, a group at a time, each copied out before its decoded values
  // overwrite it. Decoding elements [0, e) writes the fp32 bytes [0, 4e);
  // the encoded bytes of the elements after e begin at
  // 4 * size - EncodedBytes(size - e), which is not before 4e as long as the
  // remaining elements take no more bytes encoded than as fp32: true for
  // every remainder but a lone element in a block of its own, which
  // therefore joins the group before it.
  const size_t group = GroupElements(format);
  std::vector<std::byte> scratch(format.EncodedBytes(group + 1));
  for (size_t at = 0; at < buffer.size();) {
    size_t n = std::min(group, buffer.size() - at);
    if (buffer.size() - (at + n) == 1) ++n;
    const size_t from = format.EncodedBytes(at);
    const size_t bytes = format.EncodedBytes(at + n) - from;
    CopyBytes(scratch.data(), tail + from, bytes);
    crc = Crc32c(scratch.data(), bytes, crc);
    DecodeElements(format, scratch.data(), buffer.subspan(at, n));
    at += n;
  }
  return crc;
}

void RoundTripInPlace(const WireFormat& format, std::span<float> values) {
  switch (format.encoding()) {
    case WireEncoding::kFp32:
      return;
    case WireEncoding::kBf16:
      RoundToBf16InPlace(values);
      return;
    case WireEncoding::kInt8:
    case WireEncoding::kInt4: {
      const size_t b = static_cast<size_t>(format.block());
      std::vector<std::byte> block(format.EncodedBytes(b));
      for (size_t at = 0; at < values.size(); at += b) {
        const std::span<float> part = values.subspan(at, std::min(b, values.size() - at));
        QuantizeBlock(Bits(format.encoding()), part, block.data());
        DequantizeBlock(Bits(format.encoding()), block.data(), part);
      }
      return;
    }
  }
}

bool QuantizeWithFeedback(const WireFormat& format, std::span<float> values, std::span<float> residual,
                          std::vector<float>* scratch) {
  const bool feedback = !residual.empty();
  bool finite = true;
  for (size_t i = 0; i < values.size(); ++i) {
    if (feedback) values[i] = values[i] + residual[i];
    finite &= std::fabs(values[i]) <= std::numeric_limits<float>::max();
  }
  if (!feedback) return finite;
  if (!finite) {
    std::fill(residual.begin(), residual.end(), 0.0f);
    return false;
  }
  scratch->assign(values.begin(), values.end());
  RoundTripInPlace(format, *scratch);
  for (size_t i = 0; i < values.size(); ++i) residual[i] = values[i] - (*scratch)[i];
  return true;
}

absl::Status CheckScales(const WireFormat& format, const std::byte* slice, size_t elements) {
  if (!format.quantized()) return absl::OkStatus();
  const size_t b = static_cast<size_t>(format.block());
  for (size_t at = 0; at < elements; at += b) {
    const float scale = BlockScale(slice + format.EncodedBytes(at));
    if (!(scale >= 0.0f && scale <= std::numeric_limits<float>::max())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bad scale: block ", at / b, " of the ", format.ToString(), " slice has scale ", scale,
          " (a block's scale is finite and not negative; a trainer reports a non-finite gradient as such)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace pshard
