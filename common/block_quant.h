// Symmetric block quantization: int8 and int4 codes with one fp32 scale per
// block of elements. A block of n values x is stored as its scale
// s = max|x| / Q (Q = 127 for int8, 7 for int4) followed by its codes
// q = clamp(round(x * Q / max|x|), -Q, Q), rounded half to even, so the
// codes are a pure function of the values; it decodes to q * s. int4 codes
// are packed two to a byte, the earlier element in the low nibble. A block
// whose values are all zero, or that holds an infinity or a NaN, has scale
// 0 and all codes 0 (a caller that must tell a non-finite block apart checks
// the values first: the codes cannot say).
#ifndef PSHARD_COMMON_BLOCK_QUANT_H_
#define PSHARD_COMMON_BLOCK_QUANT_H_

#include <cstddef>
#include <cstdint>
#include <span>

namespace pshard {

/// Bits per code: 8 or 4.
enum class CodeBits { k8 = 8, k4 = 4 };

/// Bytes of one block of `n` elements: the scale and the codes.
inline size_t QuantBlockBytes(CodeBits bits, size_t n) {
  return sizeof(float) + (bits == CodeBits::k8 ? n : (n + 1) / 2);
}

/// Quantizes one block (values.size() elements) into `out`
/// (QuantBlockBytes(bits, values.size()) bytes).
void QuantizeBlock(CodeBits bits, std::span<const float> values, std::byte* out);
/// Decodes one block of out.size() elements from `in`.
void DequantizeBlock(CodeBits bits, const std::byte* in, std::span<float> out);
/// The scale a block's bytes start with.
float BlockScale(const std::byte* block);

/// Codes again values that are a decoded block (every x = q * s for one
/// scale s and codes |q| <= Q): writes a block (a scale and codes) that
/// DequantizeBlock turns into exactly these bits, which QuantizeBlock of the
/// decoded values does not promise (their max / Q need not give back s).
/// Returns false, with `out` unspecified, when no such block exists: the
/// values were not decoded from this many bits.
bool RecodeDecodedBlock(CodeBits bits, std::span<const float> decoded, std::byte* out);

}  // namespace pshard

#endif  // PSHARD_COMMON_BLOCK_QUANT_H_
