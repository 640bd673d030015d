#include "common/wire_encoding.h"

#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/bf16.h"
#include "gtest/gtest.h"

namespace pshard {
namespace {

constexpr WireEncoding kAllEncodings[] = {WireEncoding::kFp32, WireEncoding::kBf16, WireEncoding::kInt8,
                                          WireEncoding::kInt4};
// Every encoding, the quantized ones at the default block and at small ones
// that do not divide the test sizes.
const WireFormat kAllFormats[] = {WireFormat(WireEncoding::kFp32),       WireFormat(WireEncoding::kBf16),
                                  WireFormat(WireEncoding::kInt8),       WireFormat(WireEncoding::kInt4),
                                  WireFormat(WireEncoding::kInt8, 16),   WireFormat(WireEncoding::kInt4, 48)};

uint32_t Bits(float v) { return std::bit_cast<uint32_t>(v); }

std::vector<float> TestValues() {
  std::vector<float> values = {0.0f,
                               -0.0f,
                               1.0f,
                               -3.25f,
                               1.0f + 0x1.0p-8f,  // a bf16 tie
                               0x1.0p-140f,       // subnormal
                               std::numeric_limits<float>::max(),
                               std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::quiet_NaN(),
                               std::bit_cast<float>(0x7f800001u)};
  uint32_t state = 99;
  for (int i = 0; i < 500; ++i) {
    state = state * 1664525u + 1013904223u;
    values.push_back(std::bit_cast<float>(state));
  }
  return values;
}

TEST(WireEncodingTest, EncodedBytes) {
  EXPECT_EQ(WireFormat(WireEncoding::kFp32).EncodedBytes(300), 1200u);
  EXPECT_EQ(WireFormat(WireEncoding::kBf16).EncodedBytes(300), 600u);
  // One block of 256 and a short one of 44, each with its 4-byte scale.
  EXPECT_EQ(WireFormat(WireEncoding::kInt8, 256).EncodedBytes(300), 4 + 256 + 4 + 44u);
  EXPECT_EQ(WireFormat(WireEncoding::kInt4, 256).EncodedBytes(300), 4 + 128 + 4 + 22u);
  EXPECT_EQ(WireFormat(WireEncoding::kInt4, 16).EncodedBytes(17), 4 + 8 + 4 + 1u);
  EXPECT_EQ(WireFormat(WireEncoding::kInt8, 16).EncodedBytes(0), 0u);
  EXPECT_EQ(WireFormat(WireEncoding::kInt8, 64).GrainBytes(), 68u);
  EXPECT_EQ(WireFormat(WireEncoding::kBf16).GrainBytes(), 2u);
  EXPECT_EQ(WireFormat(WireEncoding::kInt8, 64).ElementsPerPiece(1000), 14u * 64);
  EXPECT_EQ(WireFormat(WireEncoding::kInt8, 64).ElementsPerPiece(10), 64u);  // at least one block
}

TEST(WireEncodingTest, ElementsInAcceptsWholeGrainsOrExactlyTheRest) {
  const WireFormat int8(WireEncoding::kInt8, 16);
  EXPECT_EQ(int8.ElementsIn(2 * 20, 100), 32u);
  EXPECT_EQ(int8.ElementsIn(int8.EncodedBytes(100), 100), 100u);
  EXPECT_EQ(int8.ElementsIn(int8.EncodedBytes(5), 5), 5u);
  EXPECT_FALSE(int8.ElementsIn(41, 100));              // not whole blocks
  EXPECT_FALSE(int8.ElementsIn(7 * 20, 100));           // more blocks than are left
  EXPECT_FALSE(int8.ElementsIn(int8.EncodedBytes(5) + 1, 5));
  const WireFormat bf16(WireEncoding::kBf16);
  EXPECT_EQ(bf16.ElementsIn(8, 100), 4u);
  EXPECT_FALSE(bf16.ElementsIn(7, 100));
  EXPECT_FALSE(bf16.ElementsIn(202, 100));
}

TEST(WireEncodingTest, NamesRoundTrip) {
  EXPECT_EQ(WireEncodingName(WireEncoding::kFp32), "fp32");
  EXPECT_EQ(WireEncodingName(WireEncoding::kBf16), "bf16");
  for (WireEncoding e : kAllEncodings) {
    absl::StatusOr<WireEncoding> parsed = ParseWireEncoding(WireEncodingName(e));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, e);
  }
}

TEST(WireEncodingTest, ParseRejectsUnknownNames) {
  for (const char* name : {"", "fp16", "FP32", "Bf16", "bf16 ", "float32"}) {
    absl::StatusOr<WireEncoding> parsed = ParseWireEncoding(name);
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << "'" << name << "'";
  }
}

TEST(WireEncodingTest, Fp32IsBitExact) {
  const std::vector<float> values = TestValues();
  std::vector<std::byte> wire(values.size() * 4);
  EncodeElements(WireEncoding::kFp32, values, wire.data());
  EXPECT_EQ(std::memcmp(wire.data(), values.data(), wire.size()), 0);
  std::vector<float> decoded(values.size());
  DecodeElements(WireEncoding::kFp32, wire.data(), decoded);
  for (size_t i = 0; i < values.size(); ++i) ASSERT_EQ(Bits(decoded[i]), Bits(values[i])) << i;

  std::vector<float> round_trip = values;
  RoundTripInPlace(WireEncoding::kFp32, round_trip);
  for (size_t i = 0; i < values.size(); ++i) ASSERT_EQ(Bits(round_trip[i]), Bits(values[i])) << i;
}

TEST(WireEncodingTest, Bf16UsesTheBf16Conversion) {
  const std::vector<float> values = TestValues();
  std::vector<std::byte> wire(values.size() * 2);
  EncodeElements(WireEncoding::kBf16, values, wire.data());
  for (size_t i = 0; i < values.size(); ++i) {
    uint16_t b;
    std::memcpy(&b, wire.data() + 2 * i, 2);
    ASSERT_EQ(b, FloatToBf16(values[i])) << i;
  }
  std::vector<float> decoded(values.size());
  DecodeElements(WireEncoding::kBf16, wire.data(), decoded);
  std::vector<float> round_trip = values;
  RoundTripInPlace(WireEncoding::kBf16, round_trip);
  for (size_t i = 0; i < values.size(); ++i) {
    const uint32_t expected = Bits(Bf16ToFloat(FloatToBf16(values[i])));
    ASSERT_EQ(Bits(decoded[i]), expected) << i;
    ASSERT_EQ(Bits(round_trip[i]), expected) << "RoundTripInPlace disagrees with the wire at " << i;
  }
}

TEST(WireEncodingTest, RoundTripMatchesEncodeDecodeForEveryEncoding) {
  const std::vector<float> values = TestValues();
  for (const WireFormat& e : kAllFormats) {
    SCOPED_TRACE(e.ToString());
    std::vector<std::byte> wire(e.EncodedBytes(values.size()));
    EncodeElements(e, values, wire.data());
    std::vector<float> decoded(values.size());
    DecodeElements(e, wire.data(), decoded);
    std::vector<float> round_trip = values;
    RoundTripInPlace(e, round_trip);
    for (size_t i = 0; i < values.size(); ++i)
      ASSERT_EQ(Bits(round_trip[i]), Bits(decoded[i])) << i;
    // Decoded values are fixed points: sending them again changes nothing
    // (not so for quantized ones, whose scale may move by an ulp).
    if (e.quantized()) continue;
    std::vector<float> again = decoded;
    RoundTripInPlace(e, again);
    for (size_t i = 0; i < values.size(); ++i) {
      if (std::isnan(decoded[i])) continue;
      ASSERT_EQ(Bits(again[i]), Bits(decoded[i])) << i;
    }
  }
}

TEST(WireEncodingTest, UnalignedBuffersAndExactSize) {
  const std::vector<float> values = {1.5f, -2.0f, 3.0f, 0.1f, 1e30f};
  for (const WireFormat& e : kAllFormats) {
    SCOPED_TRACE(e.ToString());
    const size_t size = e.EncodedBytes(values.size());
    for (size_t offset = 0; offset < 8; ++offset) {
      std::vector<std::byte> buffer(size + 16, std::byte{0x5a});
      EncodeElements(e, values, buffer.data() + offset);
      for (size_t i = 0; i < offset; ++i) ASSERT_EQ(buffer[i], std::byte{0x5a}) << "before";
      for (size_t i = offset + size; i < buffer.size(); ++i) {
        ASSERT_EQ(buffer[i], std::byte{0x5a}) << "wrote past the encoded size";
      }
      std::vector<float> decoded(values.size());
      DecodeElements(e, buffer.data() + offset, decoded);
      std::vector<float> expected = values;
      RoundTripInPlace(e, expected);
      for (size_t i = 0; i < values.size(); ++i) ASSERT_EQ(decoded[i], expected[i]) << i;
    }
  }
}

// Values of every kind bf16 rounds, for `n` elements.
std::vector<float> MixedValues(size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>((static_cast<double>(i) - n / 3.0) * 1.0001e-3);
  return v;
}

TEST(WireEncodingTest, DecodingWithTheChecksumEqualsDecodingThenChecksumming) {
  for (const WireFormat& e : kAllFormats) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{7}, size_t{4095}, size_t{4096}, size_t{4097},
                     size_t{8193}, size_t{20000}}) {
      SCOPED_TRACE(absl::StrCat(e.ToString(), ", ", n, " elements"));
      const std::vector<float> values = MixedValues(n);
      std::vector<std::byte> wire(e.EncodedBytes(n));
      EncodeElements(e, values, wire.data());
      std::vector<float> want(n);
      DecodeElements(e, wire.data(), want);
      const uint32_t want_crc = Crc32c(wire.data(), wire.size(), 42);

      std::vector<float> got(n, -1.0f);
      EXPECT_EQ(DecodeAndChecksum(e, wire.data(), got, 42), want_crc);
      EXPECT_EQ(got, want);

      // Received into the tail of the slice's own buffer, decoded in place
      // (where it fits: a lone quantized element takes 5 bytes).
      ASSERT_EQ(FitsInFloats(e, n), wire.size() <= n * sizeof(float));
      if (!FitsInFloats(e, n)) continue;
      std::vector<float> buffer(n, -1.0f);
      std::memcpy(reinterpret_cast<std::byte*>(buffer.data()) + buffer.size() * sizeof(float) - wire.size(),
                  wire.data(), wire.size());
      EXPECT_EQ(DecodeTailInPlaceAndChecksum(e, buffer, 42), want_crc);
      EXPECT_EQ(buffer, want);
    }
  }
}

TEST(WireEncodingTest, TheShorthandSetsBothDirectionsAndEachOverrideOne) {
  auto both = ParseWireEncodings("bf16", "", "");
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_EQ(*both, WireEncodings(WireEncoding::kBf16, WireEncoding::kBf16));
  EXPECT_EQ(both->ToString(), "bf16");
  auto split = ParseWireEncodings("bf16", "", "fp32");
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(split->weights, WireEncoding::kBf16);
  EXPECT_EQ(split->grads, WireEncoding::kFp32);
  EXPECT_EQ(split->ToString(), "weights bf16, gradients fp32");
  auto weights = ParseWireEncodings("fp32", "bf16", "");
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_EQ(*weights, WireEncodings(WireEncoding::kBf16, WireEncoding::kFp32));
  // A bad value names its flag.
  for (const auto& [flags, name] : {std::pair{std::array<const char*, 3>{"int3", "", ""}, "--encoding"},
                                    std::pair{std::array<const char*, 3>{"bf16", "fp8", ""}, "--weight_encoding"},
                                    std::pair{std::array<const char*, 3>{"bf16", "", "BF16"}, "--grad_encoding"}}) {
    auto bad = ParseWireEncodings(flags[0], flags[1], flags[2]);
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(bad.status().message()).find(name), std::string::npos) << bad.status();
  }
}

TEST(WireEncodingTest, EmptySpans) {
  for (const WireFormat& e : kAllFormats) {
    std::byte unused{};
    EncodeElements(e, {}, &unused);
    DecodeElements(e, &unused, {});
    RoundTripInPlace(e, {});
  }
}

}  // namespace
}  // namespace pshard
