#include "common/block_quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace pshard {
namespace {

// Adding and subtracting 1.5 * 2^23 rounds a float of magnitude below 2^22
// to an integer, half to even (the default rounding mode), in a way that
// vectorises without SSE4.1's round instruction.
constexpr float kRoundingBias = 12582912.0f;

inline float RoundHalfEven(float r) { return (r + kRoundingBias) - kRoundingBias; }

// The largest code magnitude.
inline float MaxCode(CodeBits bits) { return bits == CodeBits::k8 ? 127.0f : 7.0f; }

// max |x| over `values`, or infinity when some value is not finite. No exit
// inside the loop, so that it vectorises.
float AbsMax(std::span<const float> values) {
  float amax = 0.0f;
  bool finite = true;
  for (float x : values) {
    const float a = std::fabs(x);
    amax = a > amax ? a : amax;
    finite &= a <= std::numeric_limits<float>::max();  // false for inf and NaN
  }
  return finite ? amax : std::numeric_limits<float>::infinity();
}

}  // namespace

float BlockScale(const std::byte* block) {
  float s;
  std::memcpy(&s, block, sizeof(s));
  return s;
}

void QuantizeBlock(CodeBits bits, std::span<const float> values, std::byte* out) {
  const float q = MaxCode(bits);
  const float amax = AbsMax(values);
  const bool codable = amax > 0.0f && amax <= std::numeric_limits<float>::max();
  const float scale = codable ? amax / q : 0.0f;
  // q / amax overflows to infinity for a block whose largest magnitude is
  // below about 1e-36 (every code would then be +-Q): such a block is coded
  // as its values times 2^100 would be, which is exact (a power of two) and
  // gives the codes of x * Q / max|x|. Other blocks multiply by 1.
  const float lift = amax < 0x1p-100f ? 0x1p100f : 1.0f;
  const float inverse = codable ? q / (amax * lift) : 0.0f;
  std::memcpy(out, &scale, sizeof(scale));
  std::byte* codes = out + sizeof(float);
  const size_t n = values.size();
  if (!codable) {
    std::memset(codes, 0, QuantBlockBytes(bits, n) - sizeof(float));
    return;
  }
  auto code = [&](float x) {
    const float r = RoundHalfEven((x * lift) * inverse);
    return static_cast<int>(std::clamp(r, -q, q));
  };
  if (bits == CodeBits::k8) {
    for (size_t i = 0; i < n; ++i) codes[i] = static_cast<std::byte>(static_cast<int8_t>(code(values[i])));
    return;
  }
  for (size_t i = 0; i + 1 < n; i += 2) {
    const unsigned lo = static_cast<unsigned>(code(values[i])) & 0xfu;
    const unsigned hi = static_cast<unsigned>(code(values[i + 1])) & 0xfu;
    codes[i / 2] = static_cast<std::byte>(lo | (hi << 4));
  }
  if (n % 2 == 1) codes[n / 2] = static_cast<std::byte>(static_cast<unsigned>(code(values[n - 1])) & 0xfu);
}

void DequantizeBlock(CodeBits bits, const std::byte* in, std::span<float> out) {
  const float scale = BlockScale(in);
  const std::byte* codes = in + sizeof(float);
  const size_t n = out.size();
  if (bits == CodeBits::k8) {
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(static_cast<int8_t>(codes[i])) * scale;
    return;
  }
  // A nibble's sign extends from bit 3: (c << 4) as int8, shifted back.
  auto nibble = [](unsigned c) { return static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(c << 4)) >> 4); };
  for (size_t i = 0; i + 1 < n; i += 2) {
    const unsigned c = static_cast<unsigned>(codes[i / 2]);
    out[i] = nibble(c & 0xfu) * scale;
    out[i + 1] = nibble(c >> 4) * scale;
  }
  if (n % 2 == 1) out[n - 1] = nibble(static_cast<unsigned>(codes[n / 2]) & 0xfu) * scale;
}

bool RecodeDecodedBlock(CodeBits bits, std::span<const float> decoded, std::byte* out) {
  const float q = MaxCode(bits);
  const float amax = AbsMax(decoded);
  if (!(amax <= std::numeric_limits<float>::max())) return false;
  const size_t n = decoded.size();
  std::byte* codes = out + sizeof(float);
  // Codes `decoded` with `scale` and checks that each decodes to its bits.
  auto recode = [&](float scale) {
    std::memset(codes, 0, QuantBlockBytes(bits, n) - sizeof(float));
    for (size_t i = 0; i < n; ++i) {
      const float c = scale > 0.0f ? RoundHalfEven(decoded[i] / scale) : 0.0f;
      const float back = c * scale;
      if (std::fabs(c) > q || std::memcmp(&back, &decoded[i], sizeof(float)) != 0) return false;
      const unsigned code = static_cast<unsigned>(static_cast<int>(c));
      if (bits == CodeBits::k8) {
        codes[i] = static_cast<std::byte>(code & 0xffu);
      } else {
        codes[i / 2] |= static_cast<std::byte>((code & 0xfu) << (i % 2 == 0 ? 0 : 4));
      }
    }
    std::memcpy(out, &scale, sizeof(scale));
    return true;
  };
  if (amax == 0.0f) return recode(0.0f);  // all +0 (a decode never gives -0)
  // The largest magnitude is Q * s rounded, so s is amax / Q to within an
  // ulp or two of float rounding each way: try the nearest first.
  const float guess = amax / q;
  float up = guess, down = guess;
  if (recode(guess)) return true;
  for (int step = 0; step < 4; ++step) {
    up = std::nextafter(up, std::numeric_limits<float>::infinity());
    down = std::nextafter(down, 0.0f);
    if (recode(up) || (down > 0.0f && recode(down))) return true;
  }
  return false;
}

}  // namespace pshard
