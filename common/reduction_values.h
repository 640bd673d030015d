// A contribution or partial sum as a gradient reduction holds it: fp32
// values, or a single contribution kept in the wire encoding it arrived in
// until it is added to another or read. Decoding is a function of the bytes
// (bf16 values are fp32 values; a quantized element is its code times its
// block's scale), so the sums are the same bits either way, and a
// contribution that waits encoded takes half the memory or less. Servers
// never add encoded values: both sides of every addition are fp32.
#ifndef PSHARD_COMMON_REDUCTION_VALUES_H_
#define PSHARD_COMMON_REDUCTION_VALUES_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/square_sum.h"
#include "common/wire_encoding.h"

namespace pshard {

/// Not thread-safe.
class ReductionValues {
 public:
  ReductionValues() = default;
  explicit ReductionValues(std::vector<float> values) : size_(values.size()), fp32_(std::move(values)) {}
  /// Room for `elements` values received in `encoding`, to be written
  /// through mutable_bytes() (contents unspecified until then).
  static ReductionValues Allocate(const WireFormat& format, size_t elements);
  /// Makes room for `elements` values (those held are kept), growing the
  /// storage geometrically but never past `capacity_limit` elements: a
  /// buffer that grows as data arrives holds at most twice what arrived.
  void Resize(size_t elements, size_t capacity_limit);
  /// The values' bytes in their encoding, for receiving into.
  std::span<std::byte> mutable_bytes();
  std::span<const std::byte> bytes() const;

  size_t size() const { return size_; }
  /// True while the values are held encoded (not yet added to anything).
  bool encoded() const { return format_.encoding() != WireEncoding::kFp32; }
  const WireFormat& format() const { return format_; }
  /// Bytes the values take.
  int64_t memory_bytes() const;
  bool AllFinite() const;
  /// Sets every value to zero, keeping the representation.
  void Zero();
  /// this = this + other, element by element, in fp32 (this becomes fp32).
  void Add(const ReductionValues& other);
  /// Elements [offset, offset + out.size()) as fp32.
  void Read(size_t offset, std::span<float> out) const;
  /// The fp32 values, decoded once if they are held encoded.
  std::vector<float> TakeFloats() &&;

 private:
  WireFormat format_;
  size_t size_ = 0;
  std::vector<float> fp32_;         // when encoding_ is fp32
  std::vector<std::byte> encoded_;  // otherwise
};

/// Adds the squares of `values` (read block by block) to `sum`, exactly.
void AddSquares(const ReductionValues& values, SquareSum* sum);

}  // namespace pshard

#endif  // PSHARD_COMMON_REDUCTION_VALUES_H_
