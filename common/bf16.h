// bfloat16 conversion: round-to-nearest-even, NaN preserved as a quiet NaN.
#ifndef PSHARD_COMMON_BF16_H_
#define PSHARD_COMMON_BF16_H_

#include <cstdint>
#include <cstring>
#include <span>

namespace pshard {

/// Rounds an fp32 value to the nearest bf16 (ties to even). NaN stays NaN.
/// Branch-free, so that loops over it vectorise.
inline uint16_t FloatToBf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x0040u;  // NaN: keep sign, force quiet bit
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

/// Widens a bf16 value to fp32 exactly.
inline float Bf16ToFloat(uint16_t value) {
  const uint32_t bits = static_cast<uint32_t>(value) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

/// Bulk forms. `out` must be at least as long as `in`.
void EncodeBf16(std::span<const float> in, std::span<uint16_t> out);
void DecodeBf16(std::span<const uint16_t> in, std::span<float> out);
/// Replaces each value by its bf16 rounding (what a bf16 round trip does).
void RoundToBf16InPlace(std::span<float> values);

}  // namespace pshard

#endif  // PSHARD_COMMON_BF16_H_
