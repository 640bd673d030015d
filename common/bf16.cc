#include "common/bf16.h"

namespace pshard {

void EncodeBf16(std::span<const float> in, std::span<uint16_t> out) {
  for (size_t i = 0; i < in.size(); ++i) out[i] = FloatToBf16(in[i]);
}

void DecodeBf16(std::span<const uint16_t> in, std::span<float> out) {
  for (size_t i = 0; i < in.size(); ++i) out[i] = Bf16ToFloat(in[i]);
}

void RoundToBf16InPlace(std::span<float> values) {
  for (float& v : values) v = Bf16ToFloat(FloatToBf16(v));
}

}  // namespace pshard
