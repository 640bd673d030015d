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
#include <memory>
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
  ReductionValues(const ReductionValues& other);
  ReductionValues& operator=(const ReductionValues& other);
  ReductionValues(ReductionValues&&) noexcept = default;
  ReductionValues& operator=(ReductionValues&&) noexcept = default;
  /// Room for `elements` values received in `encoding`, to be written
  /// through mutable_bytes(). The room is not filled: its contents are
  /// unspecified until written, and where the allocator maps a large block
  /// fresh, a page takes memory only once something is written to it (a
  /// push that stops early holds about what arrived).
  static ReductionValues Allocate(const WireFormat& format, size_t elements);
  /// The values' bytes in their encoding from element `from` on (a whole
  /// number of blocks when quantized), for receiving into. Forgets what
  /// CheckFiniteUpTo found at and past `from`.
  std::span<std::byte> mutable_bytes(size_t from = 0);
  std::span<const std::byte> bytes() const;
  /// The values when held as fp32 (!encoded()).
  std::span<const float> floats() const;
  std::span<float> mutable_floats();

  size_t size() const { return size_; }
  /// True while the values are held encoded (not yet added to anything).
  bool encoded() const { return format_.encoding() != WireEncoding::kFp32; }
  const WireFormat& format() const { return format_; }
  /// Bytes the values take.
  int64_t memory_bytes() const;
  /// Checks the elements written since the last check, up to `end`, for
  /// infinities and NaNs: called as each part arrives, it reads the part
  /// while it is still in cache, and AllFinite then reads only what was
  /// not found finite here.
  void CheckFiniteUpTo(size_t end);
  bool AllFinite() const;
  /// Sets every value to zero, keeping the representation.
  void Zero();
  /// Holds the values as fp32 from now on (decoded once if encoded).
  void Decode();
  /// this = this + other, element by element, in fp32 (this becomes fp32).
  void Add(const ReductionValues& other);
  /// Elements [offset, offset + out.size()) as fp32.
  void Read(size_t offset, std::span<float> out) const;
  /// The fp32 values, decoded once if they are held encoded (copied once
  /// if they are fp32 received into room of Allocate's).
  std::vector<float> TakeFloats() &&;

 private:
  bool RangeFinite(size_t begin, size_t end) const;
  const float* fp32_data() const;

  WireFormat format_;
  size_t size_ = 0;
  std::vector<float> fp32_;  // fp32 values made here or handed over
  // Values received (Allocate), in format_; when set, they are the values.
  std::unique_ptr<std::byte[]> received_;
  size_t finite_prefix_ = 0;  // leading elements CheckFiniteUpTo found finite
};

/// Adds the squares of `values` (read block by block) to `sum`, exactly.
void AddSquares(const ReductionValues& values, SquareSum* sum);

}  // namespace pshard

#endif  // PSHARD_COMMON_REDUCTION_VALUES_H_
