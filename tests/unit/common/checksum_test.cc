#include "common/checksum.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <vector>

#include "gtest/gtest.h"

namespace pshard {
namespace {

// CRC-32C one bit at a time, straight from the definition: reflected
// Castagnoli polynomial, initial value and final xor 0xffffffff.
uint32_t ReferenceCrc32c(const unsigned char* data, size_t size) {
  uint32_t crc = 0xffffffffu;
  for (size_t i = 0; i < size; ++i) {
    crc ^= data[i];
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (0x82f63b78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

std::vector<unsigned char> PseudoRandomBytes(size_t n, uint32_t seed) {
  std::vector<unsigned char> out(n);
  uint32_t state = seed;
  for (unsigned char& b : out) {
    state = state * 1664525u + 1013904223u;
    b = static_cast<unsigned char>(state >> 24);
  }
  return out;
}

TEST(Crc32cTest, KnownVectors) {
  constexpr std::string_view kCheck = "123456789";
  EXPECT_EQ(Crc32c(kCheck.data(), kCheck.size()), 0xe3069283u);
  EXPECT_EQ(Crc32c(nullptr, 0), 0u);

  // RFC 3720 (iSCSI) appendix B.4.
  std::array<unsigned char, 32> bytes{};
  EXPECT_EQ(Crc32c(bytes.data(), bytes.size()), 0x8a9136aau);
  bytes.fill(0xff);
  EXPECT_EQ(Crc32c(bytes.data(), bytes.size()), 0x62a8ab43u);
  for (int i = 0; i < 32; ++i) bytes[i] = static_cast<unsigned char>(i);
  EXPECT_EQ(Crc32c(bytes.data(), bytes.size()), 0x46dd794eu);
  for (int i = 0; i < 32; ++i) bytes[i] = static_cast<unsigned char>(31 - i);
  EXPECT_EQ(Crc32c(bytes.data(), bytes.size()), 0x113fdb5cu);
}

TEST(Crc32cTest, ReferenceAgreesWithKnownVector) {
  constexpr std::string_view kCheck = "123456789";
  EXPECT_EQ(ReferenceCrc32c(reinterpret_cast<const unsigned char*>(kCheck.data()), kCheck.size()),
            0xe3069283u);
}

TEST(Crc32cTest, AllShortLengthsAtAllAlignments) {
  const std::vector<unsigned char> source = PseudoRandomBytes(64, 7);
  // Copy into a 16-byte aligned buffer at every offset so that the 8-byte
  // word loop meets every misalignment and every tail length.
  alignas(16) unsigned char buffer[64 + 16];
  for (size_t offset = 0; offset < 16; ++offset) {
    for (size_t length = 0; length <= 64; ++length) {
      std::memset(buffer, 0xa5, sizeof(buffer));
      std::memcpy(buffer + offset, source.data(), length);
      ASSERT_EQ(Crc32c(buffer + offset, length), ReferenceCrc32c(source.data(), length))
          << "offset " << offset << " length " << length;
    }
  }
}

TEST(Crc32cTest, LongBufferMatchesReference) {
  const std::vector<unsigned char> data = PseudoRandomBytes(100003, 11);
  EXPECT_EQ(Crc32c(data.data(), data.size()), ReferenceCrc32c(data.data(), data.size()));
}

TEST(Crc32cTest, InterleavedRangesMatchReferenceAtEveryBoundary) {
  // Lengths around multiples of the 3 x 2 KiB interleaved block, from a
  // fresh checksum and continued from another.
  const std::vector<unsigned char> data = PseudoRandomBytes(4 * 6144 + 64, 13);
  for (size_t length : {6143, 6144, 6145, 6151, 6152, 12288, 12289, 18431, 24576 + 63}) {
    ASSERT_EQ(Crc32c(data.data(), length), ReferenceCrc32c(data.data(), length)) << "length " << length;
    const uint32_t head = Crc32c(data.data(), 5);
    ASSERT_EQ(Crc32c(data.data() + 5, length, head), ReferenceCrc32c(data.data(), length + 5))
        << "length " << length << " after 5 bytes";
  }
}

TEST(Crc32cTest, IncrementalEqualsOneShot) {
  const std::vector<unsigned char> data = PseudoRandomBytes(200, 3);
  const uint32_t whole = Crc32c(data.data(), data.size());
  for (size_t split = 0; split <= data.size(); ++split) {
    const uint32_t first = Crc32c(data.data(), split);
    ASSERT_EQ(Crc32c(data.data() + split, data.size() - split, first), whole) << "split " << split;
  }
  // Many uneven pieces.
  uint32_t crc = 0;
  size_t at = 0;
  for (size_t piece = 1; at < data.size(); piece = piece % 13 + 1) {
    const size_t n = std::min(piece, data.size() - at);
    crc = Crc32c(data.data() + at, n, crc);
    at += n;
  }
  EXPECT_EQ(crc, whole);
  // Extending by nothing changes nothing.
  EXPECT_EQ(Crc32c(data.data(), 0, whole), whole);
}

// Pieces checksummed apart join into the whole's checksum, against the
// bit-at-a-time reference over the whole range.
TEST(Crc32cTest, CombinedPiecesEqualTheWhole) {
  const std::vector<unsigned char> data = PseudoRandomBytes(3000, 11);
  const uint32_t whole = ReferenceCrc32c(data.data(), data.size());
  for (size_t split = 0; split <= data.size(); split += split < 40 ? 1 : 97) {
    const uint32_t a = ReferenceCrc32c(data.data(), split);
    const uint32_t b = ReferenceCrc32c(data.data() + split, data.size() - split);
    ASSERT_EQ(Crc32cCombine(a, b, data.size() - split), whole) << "split " << split;
  }
  // Uneven pieces joined left to right, each checksummed from zero.
  uint32_t crc = 0;
  size_t at = 0;
  for (size_t piece = 1; at < data.size(); piece = piece * 3 % 401 + 1) {
    const size_t n = std::min(piece, data.size() - at);
    crc = Crc32cCombine(crc, ReferenceCrc32c(data.data() + at, n), n);
    at += n;
  }
  EXPECT_EQ(crc, whole);
  // A long second piece (the shift's high powers): 3 MiB of one byte value.
  const std::vector<unsigned char> ones(3 << 20, 0xa5);
  const std::vector<unsigned char> head = PseudoRandomBytes(5, 2);
  std::vector<unsigned char> joined(head);
  joined.insert(joined.end(), ones.begin(), ones.end());
  EXPECT_EQ(Crc32cCombine(ReferenceCrc32c(head.data(), head.size()), ReferenceCrc32c(ones.data(), ones.size()),
                          ones.size()),
            ReferenceCrc32c(joined.data(), joined.size()));
}

TEST(Crc32cTest, DetectsSingleBitFlips) {
  std::vector<unsigned char> data = PseudoRandomBytes(256, 5);
  const uint32_t clean = Crc32c(data.data(), data.size());
  for (size_t i = 0; i < data.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      data[i] ^= static_cast<unsigned char>(1u << bit);
      ASSERT_NE(Crc32c(data.data(), data.size()), clean) << "byte " << i << " bit " << bit;
      data[i] ^= static_cast<unsigned char>(1u << bit);
    }
  }
}

}  // namespace
}  // namespace pshard
