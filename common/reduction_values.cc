#include "common/reduction_values.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/bf16.h"
#include "common/copy.h"

namespace pshard {
namespace {

// Elements decoded at once when an encoded side is read.
constexpr size_t kBlock = 4096;

// True when no element of `values` (elements of type Bits) has an exponent
// of all ones (an infinity or a NaN). Block by block with no exit inside a
// block, so that the test vectorises.
template <typename Bits>
bool NoneAllOnes(const std::byte* values, size_t count, Bits exponent) {
  for (size_t at = 0; at < count; at += kBlock) {
    const size_t end = std::min(count, at + kBlock);
    Bits bad = 0;
    for (size_t i = at; i < end; ++i) {
      Bits b;
      std::memcpy(&b, values + i * sizeof(Bits), sizeof(Bits));
      bad |= static_cast<Bits>((b & exponent) == exponent);
    }
    if (bad != 0) return false;
  }
  return true;
}

}  // namespace

ReductionValues ReductionValues::Allocate(const WireFormat& format, size_t elements) {
  ReductionValues v;
  v.format_ = format;
  v.size_ = elements;
  if (format.encoding() == WireEncoding::kFp32) {
    v.fp32_.resize(elements);
  } else {
    v.encoded_.resize(format.EncodedBytes(elements));
  }
  return v;
}

namespace {

template <typename T>
void GrowWithin(std::vector<T>& v, size_t size, size_t limit) {
  if (size > v.capacity()) v.reserve(std::min(std::max(size, 2 * v.capacity()), std::max(size, limit)));
  v.resize(size);
}

}  // namespace

void ReductionValues::Resize(size_t elements, size_t capacity_limit) {
  size_ = elements;
  if (!encoded()) {
    GrowWithin(fp32_, elements, capacity_limit);
  } else {
    GrowWithin(encoded_, format_.EncodedBytes(elements), format_.EncodedBytes(capacity_limit));
  }
}

std::span<std::byte> ReductionValues::mutable_bytes() {
  if (!encoded()) return {reinterpret_cast<std::byte*>(fp32_.data()), fp32_.size() * sizeof(float)};
  return encoded_;
}

std::span<const std::byte> ReductionValues::bytes() const {
  if (!encoded()) return {reinterpret_cast<const std::byte*>(fp32_.data()), fp32_.size() * sizeof(float)};
  return encoded_;
}

int64_t ReductionValues::memory_bytes() const {
  return static_cast<int64_t>(encoded() ? encoded_.size() : fp32_.size() * sizeof(float));
}

bool ReductionValues::AllFinite() const {
  if (!encoded()) {
    return NoneAllOnes<uint32_t>(reinterpret_cast<const std::byte*>(fp32_.data()), size_, 0x7f800000u);
  }
  if (format_.encoding() == WireEncoding::kBf16) return NoneAllOnes<uint16_t>(encoded_.data(), size_, 0x7f80u);
  // Quantized: a finite scale times a code can still overflow; decode.
  float block[kBlock];
  for (size_t at = 0; at < size_; at += kBlock) {
    const size_t n = std::min(kBlock, size_ - at);
    Read(at, std::span<float>(block, n));
    if (!NoneAllOnes<uint32_t>(reinterpret_cast<const std::byte*>(block), n, 0x7f800000u)) return false;
  }
  return true;
}

void ReductionValues::Zero() {
  std::fill(fp32_.begin(), fp32_.end(), 0.0f);
  // All zero bits: bf16 +0; a quantized block of scale 0 and codes 0.
  std::fill(encoded_.begin(), encoded_.end(), std::byte{0});
}

void ReductionValues::Read(size_t offset, std::span<float> out) const {
  if (!encoded()) {
    CopyBytes(out.data(), fp32_.data() + offset, out.size_bytes());
    return;
  }
  DecodeRange(format_, encoded_.data(), size_, offset, out);
}

void ReductionValues::Add(const ReductionValues& other) {
  if (encoded()) *this = ReductionValues(std::move(*this).TakeFloats());
  if (!other.encoded()) {
    for (size_t i = 0; i < size_; ++i) fp32_[i] = fp32_[i] + other.fp32_[i];
    return;
  }
  float block[kBlock];
  for (size_t at = 0; at < size_; at += kBlock) {
    const size_t n = std::min(kBlock, size_ - at);
    other.Read(at, std::span<float>(block, n));
    for (size_t i = 0; i < n; ++i) fp32_[at + i] = fp32_[at + i] + block[i];
  }
}

std::vector<float> ReductionValues::TakeFloats() && {
  if (!encoded()) return std::move(fp32_);
  std::vector<float> out(size_);
  Read(0, out);
  encoded_ = {};
  format_ = WireFormat(WireEncoding::kFp32);
  return out;
}

void AddSquares(const ReductionValues& values, SquareSum* sum) {
  float block[kBlock];
  for (size_t at = 0; at < values.size(); at += kBlock) {
    const size_t n = std::min(kBlock, values.size() - at);
    values.Read(at, std::span<float>(block, n));
    sum->AddSquares(std::span<const float>(block, n));
  }
}

}  // namespace pshard
