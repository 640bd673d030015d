#include "common/checksum.h"

#include <array>
#include <cstring>

namespace pshard {
namespace {

constexpr uint32_t kPolynomial = 0x82f63b78u;  // reflected Castagnoli

constexpr std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPolynomial : c >> 1;
    table[i] = c;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kTable = MakeTable();

uint32_t Crc32cPortable(const unsigned char* p, size_t n, uint32_t crc) {
  for (size_t i = 0; i < n; ++i) crc = kTable[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint64_t Crc32cWords(const unsigned char* p, size_t words, uint64_t c) {
  for (size_t i = 0; i < words; ++i) {
    uint64_t word;
    std::memcpy(&word, p + 8 * i, 8);
    c = __builtin_ia32_crc32di(c, word);
  }
  return c;
}

// The crc32 instruction takes 3 cycles and can start one every cycle: one
// stream of words runs at a third of the rate the CPU can. Long ranges go as
// three interleaved streams over consecutive runs of kRun bytes, whose
// registers are then joined. The register is linear in its input, so the
// register after A then B is Shift(register after A, |B|) ^ (B from zero),
// where Shift feeds |B| zero bytes; for |B| = kRun that is a fixed linear map,
// tabulated byte by byte (4 x 256 entries).
constexpr size_t kRun = 2048;

struct RunShift {
  std::array<std::array<uint32_t, 256>, 4> table;
  uint32_t operator()(uint32_t c) const {
    return table[0][c & 0xff] ^ table[1][(c >> 8) & 0xff] ^ table[2][(c >> 16) & 0xff] ^ table[3][c >> 24];
  }
};

const RunShift& TheRunShift() {
  static const RunShift* shift = [] {
    static const std::array<unsigned char, kRun> zeros{};
    uint32_t basis[32];  // the map's image of each single bit
    for (int bit = 0; bit < 32; ++bit) {
      basis[bit] = static_cast<uint32_t>(Crc32cWords(zeros.data(), kRun / 8, uint64_t{1} << bit));
    }
    auto* s = new RunShift;
    for (int byte = 0; byte < 4; ++byte) {
      for (uint32_t v = 0; v < 256; ++v) {
        uint32_t image = 0;
        for (int bit = 0; bit < 8; ++bit) {
          if (v & (1u << bit)) image ^= basis[8 * byte + bit];
        }
        s->table[byte][v] = image;
      }
    }
    return s;
  }();
  return *shift;
}

__attribute__((target("sse4.2"))) uint32_t Crc32cHardware(const unsigned char* p, size_t n, uint32_t crc) {
  uint64_t c = crc;
  if (n >= 3 * kRun) {
    const RunShift& shift = TheRunShift();
    for (; n >= 3 * kRun; p += 3 * kRun, n -= 3 * kRun) {
      uint64_t a = c, b = 0, d = 0;
      for (size_t i = 0; i < kRun; i += 8) {
        uint64_t wa, wb, wd;
        std::memcpy(&wa, p + i, 8);
        std::memcpy(&wb, p + kRun + i, 8);
        std::memcpy(&wd, p + 2 * kRun + i, 8);
        a = __builtin_ia32_crc32di(a, wa);
        b = __builtin_ia32_crc32di(b, wb);
        d = __builtin_ia32_crc32di(d, wd);
      }
      c = shift(shift(static_cast<uint32_t>(a)) ^ static_cast<uint32_t>(b)) ^ static_cast<uint32_t>(d);
    }
  }
  c = Crc32cWords(p, n / 8, c);
  p += n / 8 * 8;
  uint32_t c32 = static_cast<uint32_t>(c);
  for (size_t i = 0; i < n % 8; ++i) c32 = __builtin_ia32_crc32qi(c32, p[i]);
  return c32;
}
#endif

// Polynomials modulo the Castagnoli polynomial P, bit-reflected as the
// register holds them: bit 31 is the coefficient of x^0, bit 0 that of x^31.
constexpr uint32_t kOne = 1u << 31;  // x^0

// a * b mod P.
uint32_t MultiplyModP(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t bit = kOne; bit != 0; bit >>= 1) {
    if (a & bit) product ^= b;
    b = (b & 1) ? (b >> 1) ^ kPolynomial : b >> 1;  // b * x
  }
  return product;
}

// x^(2^k) mod P for k = 0..63.
const std::array<uint32_t, 64>& PowersOfXSquared() {
  static const std::array<uint32_t, 64> powers = [] {
    std::array<uint32_t, 64> p{};
    p[0] = kOne >> 1;  // x^1
    for (size_t k = 1; k < p.size(); ++k) p[k] = MultiplyModP(p[k - 1], p[k - 1]);
    return p;
  }();
  return powers;
}

}  // namespace

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b) {
  // The register is linear in its input: after A then B it is A's register
  // carried through |B| zero bytes (times x^(8|B|) mod P) plus B's own. With
  // Crc32c's inverted start and end the inversions cancel, so the same holds
  // for the finished checksums.
  const std::array<uint32_t, 64>& powers = PowersOfXSquared();
  uint32_t shift = kOne;
  int k = 3;  // 8 |B| = |B| * 2^3
  for (uint64_t n = length_b; n != 0 && k < 64; n >>= 1, ++k) {
    if (n & 1) shift = MultiplyModP(shift, powers[k]);
  }
  return MultiplyModP(crc_a, shift) ^ crc_b;
}

uint32_t Crc32c(const void* data, size_t size, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  static const bool has_sse42 = __builtin_cpu_supports("sse4.2");
  crc = has_sse42 ? Crc32cHardware(p, size, crc) : Crc32cPortable(p, size, crc);
#else
  crc = Crc32cPortable(p, size, crc);
#endif
  return ~crc;
}

}  // namespace pshard
