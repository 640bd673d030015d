#include "common/bf16.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace pshard {
namespace {

float FromBits(uint32_t bits) { return std::bit_cast<float>(bits); }
uint32_t ToBits(float value) { return std::bit_cast<uint32_t>(value); }

bool IsBf16Nan(uint16_t b) { return (b & 0x7f80u) == 0x7f80u && (b & 0x007fu) != 0; }

// Nearest bf16 by value, ties to even, computed in double without the bit
// trick under test. Not for NaN. Magnitudes past the largest finite bf16
// round against 2^128, the value the exponent-all-ones encoding would have.
uint16_t ReferenceRound(uint32_t bits) {
  const uint32_t sign = bits & 0x80000000u;
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude == 0x7f800000u) return static_cast<uint16_t>((sign | magnitude) >> 16);
  const uint32_t lower = magnitude >> 16;  // truncation toward zero
  const uint32_t upper = lower + 1;
  const double x = static_cast<double>(FromBits(magnitude));
  const double lower_value = static_cast<double>(FromBits(lower << 16));
  const double upper_value =
      upper == 0x7f80u ? std::ldexp(1.0, 128) : static_cast<double>(FromBits(upper << 16));
  const double below = x - lower_value;
  const double above = upper_value - x;
  uint32_t chosen;
  if (below < above) {
    chosen = lower;
  } else if (above < below) {
    chosen = upper;
  } else {
    chosen = (lower & 1u) == 0 ? lower : upper;
  }
  return static_cast<uint16_t>((sign >> 16) | chosen);
}

TEST(Bf16Test, ExactValuesAreUnchanged) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBf16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToBf16(0.5f), 0x3f00);
  EXPECT_EQ(FloatToBf16(1.0078125f), 0x3f81);  // 1 + 2^-7, the bf16 after 1
}

TEST(Bf16Test, RoundsToNearest) {
  EXPECT_EQ(FloatToBf16(FromBits(0x3f807fffu)), 0x3f80);  // just below the tie
  EXPECT_EQ(FloatToBf16(FromBits(0x3f808001u)), 0x3f81);  // just above the tie
  EXPECT_EQ(FloatToBf16(FromBits(0xbf807fffu)), 0xbf80);
  EXPECT_EQ(FloatToBf16(FromBits(0xbf808001u)), 0xbf81);
}

TEST(Bf16Test, ExactTiesGoToEven) {
  // Halfway between an even and an odd bf16: rounds down to the even one.
  EXPECT_EQ(FloatToBf16(FromBits(0x3f808000u)), 0x3f80);  // 1 + 2^-8
  EXPECT_EQ(FloatToBf16(FromBits(0xbf808000u)), 0xbf80);
  // Halfway between an odd and an even bf16: rounds up to the even one.
  EXPECT_EQ(FloatToBf16(FromBits(0x3f818000u)), 0x3f82);
  EXPECT_EQ(FloatToBf16(FromBits(0xbf818000u)), 0xbf82);
  EXPECT_EQ(FloatToBf16(1.0f + 0x1.0p-8f), 0x3f80);
  EXPECT_EQ(FloatToBf16(1.0f + 3 * 0x1.0p-8f), 0x3f82);
}

TEST(Bf16Test, RoundingCarriesIntoExponent) {
  EXPECT_EQ(FloatToBf16(FromBits(0x3fffffffu)), 0x4000);  // just below 2 -> 2
  EXPECT_EQ(FloatToBf16(FromBits(0x3fff8000u)), 0x4000);  // tie, odd below -> 2
  EXPECT_EQ(FloatToBf16(FromBits(0x3fff7fffu)), 0x3fff);
  EXPECT_EQ(FloatToBf16(FromBits(0xbfffffffu)), 0xc000);
  EXPECT_EQ(FloatToBf16(FromBits(0x007fffffu)), 0x0080);  // largest subnormal -> min normal
}

TEST(Bf16Test, OverflowToInfinity) {
  const float max_float = std::numeric_limits<float>::max();  // 0x7f7fffff
  EXPECT_EQ(FloatToBf16(max_float), 0x7f80);
  EXPECT_EQ(FloatToBf16(-max_float), 0xff80);
  EXPECT_EQ(FloatToBf16(FromBits(0x7f7f8000u)), 0x7f80);  // tie above the max bf16 (odd)
  EXPECT_EQ(FloatToBf16(FromBits(0x7f7f7fffu)), 0x7f7f);  // stays the max finite bf16
  EXPECT_TRUE(std::isinf(Bf16ToFloat(FloatToBf16(max_float))));
}

TEST(Bf16Test, Infinities) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(FloatToBf16(inf), 0x7f80);
  EXPECT_EQ(FloatToBf16(-inf), 0xff80);
  EXPECT_EQ(Bf16ToFloat(0x7f80), inf);
  EXPECT_EQ(Bf16ToFloat(0xff80), -inf);
}

TEST(Bf16Test, NanStaysQuietNan) {
  // Quiet NaN, signalling NaNs with payload only in the dropped low bits, and
  // negative NaN: all must stay NaN (never become inf) with the sign kept.
  for (uint32_t bits : {0x7fc00000u, 0x7f800001u, 0x7f80ffffu, 0x7fa00000u, 0xffc00000u,
                        0xff800001u, 0x7fffffffu, 0xffffffffu}) {
    const uint16_t b = FloatToBf16(FromBits(bits));
    EXPECT_TRUE(IsBf16Nan(b)) << std::hex << bits << " -> " << b;
    EXPECT_NE(b & 0x0040u, 0u) << "quiet bit not set for " << std::hex << bits;
    EXPECT_EQ(b & 0x8000u, (bits >> 16) & 0x8000u) << "sign lost for " << std::hex << bits;
    EXPECT_TRUE(std::isnan(Bf16ToFloat(b)));
  }
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(Bf16Test, SignedZeros) {
  EXPECT_EQ(FloatToBf16(0.0f), 0x0000);
  EXPECT_EQ(FloatToBf16(-0.0f), 0x8000);
  EXPECT_EQ(ToBits(Bf16ToFloat(0x8000)), 0x80000000u);
  // Below half the smallest bf16 subnormal: rounds to zero, keeping the sign.
  EXPECT_EQ(FloatToBf16(FromBits(0x00000001u)), 0x0000);
  EXPECT_EQ(FloatToBf16(FromBits(0x80000001u)), 0x8000);
}

TEST(Bf16Test, Subnormals) {
  EXPECT_EQ(Bf16ToFloat(0x0001), 0x1.0p-133f);   // smallest bf16 subnormal
  EXPECT_EQ(Bf16ToFloat(0x007f), 0x7f.0p-133f);  // largest bf16 subnormal
  EXPECT_EQ(FloatToBf16(0x1.0p-133f), 0x0001);
  EXPECT_EQ(FloatToBf16(FromBits(0x00008000u)), 0x0000);  // tie between 0 and 0x0001
  EXPECT_EQ(FloatToBf16(FromBits(0x00018000u)), 0x0002);  // tie between 0x0001 and 0x0002
  EXPECT_EQ(FloatToBf16(FromBits(0x00008001u)), 0x0001);
  EXPECT_EQ(FloatToBf16(FromBits(0x80018000u)), 0x8002);
}

TEST(Bf16Test, Bf16ToFloatIsExactWidening) {
  for (uint32_t b = 0; b <= 0xffffu; ++b) {
    ASSERT_EQ(ToBits(Bf16ToFloat(static_cast<uint16_t>(b))), b << 16) << std::hex << b;
  }
  EXPECT_EQ(Bf16ToFloat(0x7f7f), 0x1.fep127f);  // largest finite bf16
  EXPECT_EQ(Bf16ToFloat(0x4049), 3.140625f);
}

TEST(Bf16Test, DecodeEncodeIsIdentityOverAllBf16) {
  for (uint32_t b = 0; b <= 0xffffu; ++b) {
    const uint16_t in = static_cast<uint16_t>(b);
    const uint16_t out = FloatToBf16(Bf16ToFloat(in));
    if (IsBf16Nan(in)) {
      ASSERT_EQ(out, in | 0x0040u) << "NaN " << std::hex << b << " must only gain the quiet bit";
    } else {
      ASSERT_EQ(out, in) << std::hex << b;
    }
  }
}

TEST(Bf16Test, MatchesReferenceRoundingOnEveryLowHalf) {
  // Every low half for high halves at the interesting places: zero and the
  // subnormals, min normal, around 1 and 2, the largest finite values, and
  // their negatives.
  for (uint32_t high : {0x0000u, 0x0001u, 0x007fu, 0x0080u, 0x3f80u, 0x3f81u, 0x3fffu, 0x4000u,
                        0x7f7eu, 0x7f7fu, 0x8000u, 0x807fu, 0xbf80u, 0xbfffu, 0xff7fu}) {
    for (uint32_t low = 0; low <= 0xffffu; ++low) {
      const uint32_t bits = (high << 16) | low;
      ASSERT_EQ(FloatToBf16(FromBits(bits)), ReferenceRound(bits)) << std::hex << bits;
    }
  }
}

TEST(Bf16Test, MatchesReferenceRoundingAcrossAllFloats) {
  // A stride walk over the whole 32-bit pattern space (about 17M values).
  constexpr uint64_t kStride = 251;
  for (uint64_t bits = 0; bits <= 0xffffffffull; bits += kStride) {
    const uint32_t b = static_cast<uint32_t>(bits);
    if ((b & 0x7fffffffu) > 0x7f800000u) continue;  // NaN is covered above
    ASSERT_EQ(FloatToBf16(FromBits(b)), ReferenceRound(b)) << std::hex << b;
  }
}

std::vector<float> MixedValues() {
  std::vector<float> values = {0.0f,
                               -0.0f,
                               1.0f,
                               -1.5f,
                               FromBits(0x3f808000u),
                               FromBits(0x3f818000u),
                               FromBits(0x3fffffffu),
                               std::numeric_limits<float>::max(),
                               std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::quiet_NaN(),
                               FromBits(0x7f800001u),
                               FromBits(0x00000001u),
                               FromBits(0x00018000u)};
  uint32_t state = 12345;
  for (int i = 0; i < 1000; ++i) {
    state = state * 1664525u + 1013904223u;
    values.push_back(FromBits(state));
  }
  return values;
}

TEST(Bf16BulkTest, EncodeMatchesScalar) {
  const std::vector<float> in = MixedValues();
  std::vector<uint16_t> out(in.size() + 3, 0xabcd);
  EncodeBf16(in, out);
  for (size_t i = 0; i < in.size(); ++i) ASSERT_EQ(out[i], FloatToBf16(in[i])) << i;
  for (size_t i = in.size(); i < out.size(); ++i) EXPECT_EQ(out[i], 0xabcd) << "wrote past input";
}

TEST(Bf16BulkTest, DecodeMatchesScalar) {
  std::vector<uint16_t> in(0x10000);
  for (uint32_t b = 0; b <= 0xffffu; ++b) in[b] = static_cast<uint16_t>(b);
  std::vector<float> out(in.size());
  DecodeBf16(in, out);
  for (size_t i = 0; i < in.size(); ++i) ASSERT_EQ(ToBits(out[i]), ToBits(Bf16ToFloat(in[i])));
}

TEST(Bf16BulkTest, RoundInPlaceMatchesScalarRoundTrip) {
  std::vector<float> values = MixedValues();
  const std::vector<float> original = values;
  RoundToBf16InPlace(values);
  for (size_t i = 0; i < values.size(); ++i) {
    ASSERT_EQ(ToBits(values[i]), ToBits(Bf16ToFloat(FloatToBf16(original[i])))) << i;
    ASSERT_EQ(ToBits(values[i]) & 0xffffu, 0u) << i;
  }
}

TEST(Bf16BulkTest, EmptySpans) {
  EncodeBf16({}, {});
  DecodeBf16({}, {});
  RoundToBf16InPlace({});
}

}  // namespace
}  // namespace pshard
