// The block-quantized encodings against an oracle that shares no code with
// them: tests/data/block_quant_vectors.txt, written by numpy from the
// encoding's description in docs/levers.md (block_quant_oracle.py), holds
// slices and their encoded bytes; every byte must match. Error feedback is
// checked by its property, decoding what was sent with a decoder written here
// from the same description: the residual holds exactly what was not sent,
// and over K pushes what was sent adds up to the gradients minus the last
// residual.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/wire_encoding.h"
#include "gtest/gtest.h"

namespace pshard {
namespace {

struct Case {
  std::string name;
  int bits = 8;
  int block = 64;
  std::vector<float> x;
  std::vector<uint8_t> bytes;
};

std::vector<uint8_t> FromHex(const std::string& hex) {
  std::vector<uint8_t> out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(static_cast<uint8_t>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

std::vector<Case> ReadCases() {
  std::ifstream in(std::string(PSHARD_TEST_DATA_DIR) + "/block_quant_vectors.txt");
  EXPECT_TRUE(in.good()) << "cannot read block_quant_vectors.txt";
  std::vector<Case> cases;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string kind;
    words >> kind;
    if (kind == "case") {
      Case c;
      std::string bits, block;
      words >> c.name >> bits >> block;
      c.bits = std::stoi(bits.substr(bits.find('=') + 1));
      c.block = std::stoi(block.substr(block.find('=') + 1));
      cases.push_back(std::move(c));
    } else if (kind == "x" && !cases.empty()) {
      std::string word;
      while (words >> word) {
        const uint32_t pattern = static_cast<uint32_t>(std::stoul(word, nullptr, 16));
        float v;
        std::memcpy(&v, &pattern, sizeof(v));
        cases.back().x.push_back(v);
      }
    } else if (kind == "bytes" && !cases.empty()) {
      std::string hex;
      words >> hex;
      cases.back().bytes = FromHex(hex);
    }
  }
  return cases;
}

WireFormat Format(int bits, int block) { return WireFormat(bits == 8 ? WireEncoding::kInt8 : WireEncoding::kInt4, block); }

TEST(BlockQuantOracleTest, EncodedBytesEqualTheNumpyOraclesFromTheDocs) {
  const std::vector<Case> cases = ReadCases();
  ASSERT_GE(cases.size(), 18u);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const WireFormat format = Format(c.bits, c.block);
    ASSERT_EQ(format.EncodedBytes(c.x.size()), c.bytes.size());
    std::vector<uint8_t> got(c.bytes.size());
    EncodeElements(format, c.x, reinterpret_cast<std::byte*>(got.data()));
    // Block by block, so that a mismatch names its block.
    const size_t block_bytes = format.EncodedBytes(static_cast<size_t>(c.block));
    for (size_t at = 0, b = 0; at < got.size(); at += block_bytes, ++b) {
      const size_t len = std::min(block_bytes, got.size() - at);
      const std::vector<uint8_t> want_block(c.bytes.begin() + at, c.bytes.begin() + at + len);
      const std::vector<uint8_t> got_block(got.begin() + at, got.begin() + at + len);
      EXPECT_EQ(got_block, want_block) << "block " << b;
    }
  }
}

// Decodes a slice as docs/levers.md describes it: per block, an fp32 scale,
// then one code per element (int8; or int4 two to a byte, low nibble first),
// each worth code * scale.
std::vector<float> Decode(int bits, int block, const std::vector<uint8_t>& bytes, size_t n) {
  std::vector<float> out;
  size_t at = 0;
  for (size_t start = 0; start < n; start += static_cast<size_t>(block)) {
    const size_t len = std::min(static_cast<size_t>(block), n - start);
    float scale;
    std::memcpy(&scale, bytes.data() + at, sizeof(scale));
    at += sizeof(scale);
    for (size_t i = 0; i < len; ++i) {
      int code;
      if (bits == 8) {
        code = static_cast<int8_t>(bytes[at + i]);
      } else {
        const int nibble = (bytes[at + i / 2] >> (i % 2 == 0 ? 0 : 4)) & 0xF;
        code = nibble >= 8 ? nibble - 16 : nibble;
      }
      out.push_back(static_cast<float>(code) * scale);
    }
    at += bits == 8 ? len : (len + 1) / 2;
  }
  return out;
}

TEST(BlockQuantOracleTest, ErrorFeedbackCarriesExactlyWhatWasNotSent) {
  for (int bits : {8, 4}) {
    SCOPED_TRACE(absl::StrCat("int", bits));
    constexpr int kBlock = 64, kSteps = 40;
    constexpr size_t kN = 64 * 7 + 13;
    const WireFormat format = Format(bits, kBlock);
    std::mt19937 rng(bits);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> residual(kN, 0.0f), scratch_floats;
    std::vector<double> sent_sum(kN, 0.0), grad_sum(kN, 0.0);
    for (int step = 0; step < kSteps; ++step) {
      std::vector<float> grad(kN);
      for (size_t i = 0; i < kN; ++i) grad[i] = normal(rng) * (i % 97 == 0 ? 30.0f : 0.05f);  // some outliers
      std::vector<float> values = grad;
      const std::vector<float> carried = residual;
      ASSERT_TRUE(QuantizeWithFeedback(format, values, residual, &scratch_floats));
      std::vector<uint8_t> bytes(format.EncodedBytes(kN));
      EncodeElements(format, values, reinterpret_cast<std::byte*>(bytes.data()));
      const std::vector<float> sent = Decode(bits, kBlock, bytes, kN);
      for (size_t i = 0; i < kN; ++i) {
        // What travelled is the gradient plus what the last push left; the
        // new residual is what quantization took off that sum, to the bit.
        const float with_carry = grad[i] + carried[i];
        ASSERT_EQ(values[i], with_carry) << "element " << i << " step " << step;
        ASSERT_EQ(residual[i], with_carry - sent[i]) << "element " << i << " step " << step;
        sent_sum[i] += sent[i];
        grad_sum[i] += grad[i];
      }
    }
    // Over the K pushes, sent = gradients - final residual (up to the fp32
    // rounding of each step's sum and difference).
    double worst = 0, scale = 0;
    for (size_t i = 0; i < kN; ++i) {
      worst = std::max(worst, std::abs(sent_sum[i] - (grad_sum[i] - residual[i])));
      scale = std::max(scale, std::abs(grad_sum[i]));
    }
    EXPECT_LT(worst, 1e-4 * scale) << "largest gap " << worst;
  }
}

}  // namespace
}  // namespace pshard
