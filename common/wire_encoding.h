// Element encodings used on the wire for fetched weights and pushed
// gradients: fp32 and bf16 element by element, int8 and int4 as symmetric
// block quantization (common/block_quant.h) with one fp32 scale per block.
// Blocks start at the first element of each slice (a server's part of a
// unit), so a slice's encoding is a function of its values and the block
// size only; the last block of a slice may be shorter.
#ifndef PSHARD_COMMON_WIRE_ENCODING_H_
#define PSHARD_COMMON_WIRE_ENCODING_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pshard {

enum class WireEncoding { kFp32 = 1, kBf16 = 2, kInt8 = 3, kInt4 = 4 };

/// Elements per scale of the block-quantized encodings (`--quant_block`):
/// a multiple of 16 in [kMinQuantBlock, kMaxQuantBlock]. The default is the
/// measured choice of bench/README.md ("Quantization block").
inline constexpr int kMinQuantBlock = 16;
inline constexpr int kMaxQuantBlock = 16384;
inline constexpr int kDefaultQuantBlock = 64;

/// True for int8 and int4.
bool IsQuantized(WireEncoding encoding);
std::string_view WireEncodingName(WireEncoding encoding);
absl::StatusOr<WireEncoding> ParseWireEncoding(std::string_view name);
/// OK, or InvalidArgument saying what a block size must be.
absl::Status CheckQuantBlock(int64_t block);

/// An encoding as it travels: with the block size when it is quantized.
class WireFormat {
 public:
  /// fp32 and bf16 ignore `block`; int8 and int4 need a valid one
  /// (CheckQuantBlock, checked by whoever reads it from outside).
  WireFormat(WireEncoding encoding = WireEncoding::kFp32, int block = kDefaultQuantBlock);

  WireEncoding encoding() const { return encoding_; }
  /// Elements per scale; 0 when not quantized.
  int block() const { return block_; }
  bool quantized() const { return block_ > 0; }
  bool operator==(const WireFormat&) const = default;
  /// "bf16", "int8 (blocks of 256)".
  std::string ToString() const;

  /// Bytes that the first `elements` elements of a slice take (a slice of
  /// `elements` elements when it is all of them).
  size_t EncodedBytes(size_t elements) const;
  /// The unit a slice's bytes can be cut into pieces of without splitting
  /// a scale from its codes: 1 element, or one block.
  size_t GrainElements() const { return quantized() ? static_cast<size_t>(block_) : 1; }
  size_t GrainBytes() const { return EncodedBytes(GrainElements()); }
  /// Elements per piece of at most `max_bytes` bytes: whole grains, at least one.
  size_t ElementsPerPiece(size_t max_bytes) const;
  /// The elements that `bytes` bytes starting at a grain boundary carry,
  /// when `remaining` elements of the slice are left: whole grains fewer
  /// than `remaining`, or exactly the rest. nullopt when they are neither.
  std::optional<size_t> ElementsIn(size_t bytes, size_t remaining) const;

 private:
  WireEncoding encoding_;
  int block_;
};

/// A trainer's encoding per direction: of the weights it fetches and of the
/// gradients it pushes, and the block size of the quantized ones. One
/// encoding converts to both, as `--encoding` is the shorthand for
/// `--weight_encoding` and `--grad_encoding`.
struct WireEncodings {
  WireEncodings() = default;
  WireEncodings(WireEncoding both) : weights(both), grads(both) {}  // implicit: the shorthand
  WireEncodings(WireEncoding w, WireEncoding g, int block = kDefaultQuantBlock)
      : weights(w), grads(g), quant_block(block) {}
  bool operator==(const WireEncodings&) const = default;
  WireFormat weight_format() const { return WireFormat(weights, quant_block); }
  WireFormat grad_format() const { return WireFormat(grads, quant_block); }
  /// "bf16" when both are the same, else "weights int8, gradients int4";
  /// with ", blocks of 256" when either is quantized.
  std::string ToString() const;

  WireEncoding weights = WireEncoding::kFp32;
  WireEncoding grads = WireEncoding::kFp32;
  int quant_block = kDefaultQuantBlock;
};

/// The command lines' `--encoding` (both directions) with the overrides
/// `--weight_encoding` and `--grad_encoding` (empty: as `both`) and
/// `--quant_block`. An error names the flag whose value is wrong; weights
/// travel as fp32, bf16 or int8 only.
absl::StatusOr<WireEncodings> ParseWireEncodings(std::string_view both, std::string_view weights,
                                                 std::string_view grads, int64_t quant_block = kDefaultQuantBlock);

/// Encodes a slice's first values.size() values into `out`
/// (EncodedBytes(values.size()) bytes).
void EncodeElements(const WireFormat& format, std::span<const float> values, std::byte* out);
/// Encodes values that are a decode of this format's bytes (a slice's first
/// values.size() elements) so that decoding gives back their bits: fp32
/// always; bf16 when every value is a bf16; int8 and int4 when each block
/// is a decoded block (RecodeDecodedBlock). False when they are not.
bool EncodeDecodedExactly(const WireFormat& format, std::span<const float> values, std::byte* out);
/// Decodes out.size() elements from `in`, which starts at a grain boundary.
void DecodeElements(const WireFormat& format, const std::byte* in, std::span<float> out);
/// Elements [offset, offset + out.size()) of a slice of `slice_elements`
/// elements encoded at `slice` (any offset).
void DecodeRange(const WireFormat& format, const std::byte* slice, size_t slice_elements, size_t offset,
                 std::span<float> out);
/// Decodes `out.size()` elements from `in` into `out` and returns the CRC-32C
/// of the encoded bytes continued from `crc`, in one pass over them.
uint32_t DecodeAndChecksum(const WireFormat& format, const std::byte* in, std::span<float> out, uint32_t crc);
/// The same for a slice whose encoded bytes were received into the tail of
/// its own fp32 buffer (the last EncodedBytes(buffer.size()) bytes, which
/// must fit: see FitsInFloats): decodes them forward, in place, into the
/// whole buffer.
uint32_t DecodeTailInPlaceAndChecksum(const WireFormat& format, std::span<float> buffer, uint32_t crc);
/// True when a slice of `elements` elements takes no more bytes encoded
/// than as fp32 (false only for the tiniest quantized slices).
bool FitsInFloats(const WireFormat& format, size_t elements);

/// Replaces each value of a slice by what an encode/decode round trip yields.
void RoundTripInPlace(const WireFormat& format, std::span<float> values);

/// Error feedback for one slice about to be pushed in `format`: adds
/// `residual` (when not empty) to `values`, element by element, and sets
/// `residual` to what encoding the sum takes off it (the sum minus its
/// round trip). Returns false when the values (after adding) are not all
/// finite; their residual is then zero. `scratch` is working memory.
bool QuantizeWithFeedback(const WireFormat& format, std::span<float> values, std::span<float> residual,
                          std::vector<float>* scratch);

/// For received quantized bytes (elements [0, elements) of a slice): OK
/// when every block's scale is finite and not negative, else InvalidArgument
/// naming the first bad block. Always OK for fp32 and bf16.
absl::Status CheckScales(const WireFormat& format, const std::byte* slice, size_t elements);

}  // namespace pshard

#endif  // PSHARD_COMMON_WIRE_ENCODING_H_
