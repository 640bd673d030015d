// Block quantization: the bytes of a block, rounding, the bound on the
// error, non-finite blocks, scales the servers refuse, ranges, and error
// feedback.
#include "common/block_quant.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/wire_encoding.h"
#include "gtest/gtest.h"

namespace pshard {
namespace {

std::vector<float> Wavy(size_t n, float amplitude) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = amplitude * std::sin(0.37f * static_cast<float>(i) + 0.1f);
  return v;
}

TEST(BlockQuantTest, Int8BlockIsItsScaleThenOneCodePerElementRoundedHalfToEven) {
  // max |x| = 127: scale 1, so the codes are the values rounded.
  const std::vector<float> values = {127.0f, -63.5f, 0.5f, 1.5f, 0.0f, -127.0f};
  std::vector<std::byte> block(QuantBlockBytes(CodeBits::k8, values.size()));
  ASSERT_EQ(block.size(), 4 + 6u);
  QuantizeBlock(CodeBits::k8, values, block.data());
  EXPECT_EQ(BlockScale(block.data()), 1.0f);
  std::vector<int> codes;
  for (size_t i = 0; i < values.size(); ++i) codes.push_back(static_cast<int8_t>(block[4 + i]));
  // -63.5, 0.5 and 1.5 are ties: to even.
  EXPECT_EQ(codes, (std::vector<int>{127, -64, 0, 2, 0, -127}));
  std::vector<float> decoded(values.size());
  DequantizeBlock(CodeBits::k8, block.data(), decoded);
  for (size_t i = 0; i < values.size(); ++i) EXPECT_EQ(decoded[i], codes[i] * BlockScale(block.data())) << i;
}

TEST(BlockQuantTest, Int4PacksTwoCodesPerByteLowNibbleFirst) {
  // max |x| = 7: scale 1.
  const std::vector<float> values = {7.0f, -7.0f, 3.5f, -1.0f, 2.0f};
  std::vector<std::byte> block(QuantBlockBytes(CodeBits::k4, values.size()));
  ASSERT_EQ(block.size(), 4 + 3u);
  QuantizeBlock(CodeBits::k4, values, block.data());
  EXPECT_EQ(BlockScale(block.data()), 1.0f);
  EXPECT_EQ(block[4], std::byte{0x97});  // 7, then -7 (0x9)
  EXPECT_EQ(block[5], std::byte{0xf4});  // 3.5 rounds to 4, then -1 (0xf)
  EXPECT_EQ(block[6], std::byte{0x02});  // the odd last code, high nibble zero
  std::vector<float> decoded(values.size());
  DequantizeBlock(CodeBits::k4, block.data(), decoded);
  EXPECT_EQ(decoded, (std::vector<float>{7.0f, -7.0f, 4.0f, -1.0f, 2.0f}));
}

TEST(BlockQuantTest, TheErrorIsAtMostHalfAScalePerElement) {
  for (WireEncoding e : {WireEncoding::kInt8, WireEncoding::kInt4}) {
    for (int block : {16, 64, 256}) {
      const WireFormat format(e, block);
      SCOPED_TRACE(format.ToString());
      std::vector<float> values = Wavy(1000, 3.0f);
      values[17] = 40.0f;  // one outlier: its block gets a coarse scale
      std::vector<float> rt = values;
      RoundTripInPlace(format, rt);
      const float q = e == WireEncoding::kInt8 ? 127.0f : 7.0f;
      for (size_t at = 0; at < values.size(); at += block) {
        const size_t end = std::min(values.size(), at + block);
        float amax = 0.0f;
        for (size_t i = at; i < end; ++i) amax = std::max(amax, std::fabs(values[i]));
        const float scale = amax / q;
        for (size_t i = at; i < end; ++i) {
          ASSERT_LE(std::fabs(rt[i] - values[i]), scale * 0.5f * (1.0f + 1e-5f)) << i;
        }
      }
    }
  }
}

TEST(BlockQuantTest, ANonFiniteBlockBecomesZerosAndLeavesTheOthersAlone) {
  const WireFormat format(WireEncoding::kInt8, 16);
  for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<float> values = Wavy(48, 1.0f);
    std::vector<float> clean = values;
    values[20] = bad;  // in block 1
    std::vector<std::byte> wire(format.EncodedBytes(48));
    EncodeElements(format, values, wire.data());
    EXPECT_EQ(BlockScale(wire.data() + format.EncodedBytes(16)), 0.0f);
    std::vector<float> decoded(48);
    DecodeElements(format, wire.data(), decoded);
    RoundTripInPlace(format, clean);
    for (size_t i = 0; i < 48; ++i) {
      if (i >= 16 && i < 32) {
        EXPECT_EQ(decoded[i], 0.0f) << i;
      } else {
        EXPECT_EQ(decoded[i], clean[i]) << i;
      }
    }
    // All-zero blocks have scale 0 too, and decode to zeros.
    std::vector<float> zeros(16, 0.0f);
    EncodeElements(format, zeros, wire.data());
    EXPECT_EQ(BlockScale(wire.data()), 0.0f);
  }
}

TEST(BlockQuantTest, ScalesThatAreNotFiniteOrNegativeAreRefusedByBlock) {
  const WireFormat format(WireEncoding::kInt4, 32);
  const std::vector<float> values = Wavy(100, 2.0f);
  std::vector<std::byte> wire(format.EncodedBytes(values.size()));
  EncodeElements(format, values, wire.data());
  ASSERT_TRUE(CheckScales(format, wire.data(), values.size()).ok());
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(), -0.5f}) {
    std::vector<std::byte> broken = wire;
    std::memcpy(broken.data() + format.EncodedBytes(64), &bad, sizeof(bad));  // block 2's scale
    const absl::Status s = CheckScales(format, broken.data(), values.size());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(std::string(s.message()).find("block 2 "), std::string::npos) << s;
  }
  EXPECT_TRUE(CheckScales(WireFormat(WireEncoding::kBf16), wire.data(), 10).ok());
}

TEST(BlockQuantTest, DecodeRangeMatchesTheWholeSliceAtAnyOffset) {
  for (const WireFormat& format : {WireFormat(WireEncoding::kInt8, 16), WireFormat(WireEncoding::kInt4, 48),
                                   WireFormat(WireEncoding::kBf16)}) {
    SCOPED_TRACE(format.ToString());
    const std::vector<float> values = Wavy(203, 5.0f);
    std::vector<std::byte> wire(format.EncodedBytes(values.size()));
    EncodeElements(format, values, wire.data());
    std::vector<float> whole(values.size());
    DecodeElements(format, wire.data(), whole);
    for (size_t offset : {0, 1, 15, 16, 17, 47, 48, 100, 190, 202}) {
      for (size_t n : {1, 2, 16, 33, 96}) {
        if (offset + n > values.size()) continue;
        std::vector<float> part(n, -9.0f);
        DecodeRange(format, wire.data(), values.size(), offset, part);
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(part[i], whole[offset + i]) << offset << " + " << i;
      }
    }
  }
}

TEST(BlockQuantTest, ErrorFeedbackDeliversWhatQuantizationAloneLoses) {
  // One large value sets an int4 block's scale to 1/7; the small ones, 0.01
  // each, round to zero every time without feedback. With it, the residual
  // grows until it crosses half a scale, so the sum of what was sent tracks
  // the sum of the gradients to within one residual.
  const WireFormat format(WireEncoding::kInt4, 16);
  std::vector<float> gradient(16, 0.01f);
  gradient[0] = 1.0f;
  std::vector<float> residual(16, 0.0f), scratch;
  std::vector<double> sent_with(16, 0.0), sent_without(16, 0.0);
  const int pushes = 200;
  for (int k = 0; k < pushes; ++k) {
    std::vector<float> with = gradient;
    ASSERT_TRUE(QuantizeWithFeedback(format, with, residual, &scratch));
    RoundTripInPlace(format, with);  // what the wire delivers
    std::vector<float> without = gradient;
    ASSERT_TRUE(QuantizeWithFeedback(format, without, {}, &scratch));
    RoundTripInPlace(format, without);
    for (int i = 0; i < 16; ++i) {
      sent_with[i] += with[i];
      sent_without[i] += without[i];
    }
  }
  for (int i = 1; i < 16; ++i) {
    EXPECT_EQ(sent_without[i], 0.0) << i;
    EXPECT_NEAR(sent_with[i], pushes * 0.01, 1.0 / 7.0) << i;
    EXPECT_LE(std::fabs(residual[i]), 0.5f / 7.0f * 1.0001f + 0.01f) << i;
  }
}

TEST(BlockQuantTest, ErrorFeedbackOfANonFiniteSliceLeavesAZeroResidual) {
  const WireFormat format(WireEncoding::kInt8, 16);
  std::vector<float> residual(32, 0.25f), scratch;
  std::vector<float> values = Wavy(32, 1.0f);
  values[3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(QuantizeWithFeedback(format, values, residual, &scratch));
  for (float r : residual) EXPECT_EQ(r, 0.0f);
  // Without feedback the check is the same.
  EXPECT_FALSE(QuantizeWithFeedback(format, values, {}, &scratch));
}

TEST(BlockQuantTest, FlagsChooseQuantizedEncodingsAndTheirBlock) {
  auto zeropp = ParseWireEncodings("bf16", "int8", "int4", 128);
  ASSERT_TRUE(zeropp.ok()) << zeropp.status();
  EXPECT_EQ(zeropp->weight_format(), WireFormat(WireEncoding::kInt8, 128));
  EXPECT_EQ(zeropp->grad_format(), WireFormat(WireEncoding::kInt4, 128));
  EXPECT_EQ(zeropp->ToString(), "weights int8, gradients int4, blocks of 128");
  // Weights are never int4, whichever flag says so.
  for (const auto& [both, weights, flag] : {std::tuple{"int4", "", "--encoding"},
                                            std::tuple{"bf16", "int4", "--weight_encoding"}}) {
    auto bad = ParseWireEncodings(both, weights, "", 256);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(std::string(bad.status().message()).find(flag), std::string::npos) << bad.status();
  }
  for (int64_t block : {0, 8, 100, 20000, -16}) {
    auto bad = ParseWireEncodings("int8", "", "", block);
    ASSERT_FALSE(bad.ok()) << block;
    EXPECT_NE(std::string(bad.status().message()).find("--quant_block"), std::string::npos) << bad.status();
  }
}

}  // namespace
}  // namespace pshard
