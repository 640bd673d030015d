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
  // Uninitialised on purpose: a receiver writes every byte, and zeroing
  // first would touch (and fault in) every page of the slice up front.
  v.received_ = std::make_unique_for_overwrite<std::byte[]>(format.EncodedBytes(elements));
  return v;
}

ReductionValues::ReductionValues(const ReductionValues& other)
    : format_(other.format_),
      size_(other.size_),
      fp32_(other.fp32_),
      finite_prefix_(other.finite_prefix_) {
  if (other.received_ != nullptr) {
    const std::span<const std::byte> theirs = other.bytes();
    received_ = std::make_unique_for_overwrite<std::byte[]>(theirs.size());
    CopyBytes(received_.get(), theirs.data(), theirs.size());
  }
}

ReductionValues& ReductionValues::operator=(const ReductionValues& other) {
  if (this != &other) *this = ReductionValues(other);
  return *this;
}

const float* ReductionValues::fp32_data() const {
  return received_ != nullptr ? reinterpret_cast<const float*>(received_.get()) : fp32_.data();
}

std::span<std::byte> ReductionValues::mutable_bytes(size_t from) {
  finite_prefix_ = std::min(finite_prefix_, from);
  const size_t skip = format_.EncodedBytes(from);
  if (received_ != nullptr) return {received_.get() + skip, format_.EncodedBytes(size_) - skip};
  return {reinterpret_cast<std::byte*>(fp32_.data()) + skip, fp32_.size() * sizeof(float) - skip};
}

std::span<const std::byte> ReductionValues::bytes() const {
  if (received_ != nullptr) return {received_.get(), format_.EncodedBytes(size_)};
  return {reinterpret_cast<const std::byte*>(fp32_.data()), fp32_.size() * sizeof(float)};
}

std::span<const float> ReductionValues::floats() const { return {fp32_data(), encoded() ? 0 : size_}; }

std::span<float> ReductionValues::mutable_floats() {
  finite_prefix_ = 0;
  return {const_cast<float*>(fp32_data()), encoded() ? 0 : size_};
}

int64_t ReductionValues::memory_bytes() const { return static_cast<int64_t>(bytes().size()); }

bool ReductionValues::RangeFinite(size_t begin, size_t end) const {
  const std::byte* at = bytes().data();
  if (!encoded()) return NoneAllOnes<uint32_t>(at + begin * sizeof(float), end - begin, 0x7f800000u);
  if (format_.encoding() == WireEncoding::kBf16) return NoneAllOnes<uint16_t>(at + begin * 2, end - begin, 0x7f80u);
  // Quantized: a finite scale times a code can still overflow; decode.
  float block[kBlock];
  for (size_t i = begin; i < end; i += kBlock) {
    const size_t n = std::min(kBlock, end - i);
    Read(i, std::span<float>(block, n));
    if (!NoneAllOnes<uint32_t>(reinterpret_cast<const std::byte*>(block), n, 0x7f800000u)) return false;
  }
  return true;
}

void ReductionValues::CheckFiniteUpTo(size_t end) {
  end = std::min(end, size_);
  if (finite_prefix_ < end && RangeFinite(finite_prefix_, end)) finite_prefix_ = end;
}

bool ReductionValues::AllFinite() const { return RangeFinite(std::min(finite_prefix_, size_), size_); }

void ReductionValues::Zero() {
  // All zero bits: fp32 and bf16 +0; a quantized block of scale 0 and codes 0.
  const std::span<std::byte> all = mutable_bytes();
  std::fill(all.begin(), all.end(), std::byte{0});
}

void ReductionValues::Read(size_t offset, std::span<float> out) const {
  if (!encoded()) {
    CopyBytes(out.data(), fp32_data() + offset, out.size_bytes());
    return;
  }
  DecodeRange(format_, received_.get(), size_, offset, out);
}

void ReductionValues::Decode() {
  if (encoded()) *this = ReductionValues(std::move(*this).TakeFloats());
}

void ReductionValues::Add(const ReductionValues& other) {
  Decode();
  const std::span<float> mine = mutable_floats();
  if (!other.encoded()) {
    const float* theirs = other.fp32_data();
    for (size_t i = 0; i < size_; ++i) mine[i] = mine[i] + theirs[i];
    return;
  }
  float block[kBlock];
  for (size_t at = 0; at < size_; at += kBlock) {
    const size_t n = std::min(kBlock, size_ - at);
    other.Read(at, std::span<float>(block, n));
    for (size_t i = 0; i < n; ++i) mine[at + i] = mine[at + i] + block[i];
  }
}

std::vector<float> ReductionValues::TakeFloats() && {
  std::vector<float> out;
  if (received_ == nullptr) {
    out = std::move(fp32_);
  } else if (!encoded()) {
    out.assign(fp32_data(), fp32_data() + size_);
  } else {
    out.resize(size_);
    Read(0, out);
  }
  *this = ReductionValues();
  return out;
}

void AddSquares(const ReductionValues& values, SquareSum* sum) {
  if (!values.encoded()) return sum->AddSquares(values.floats());
  float block[kBlock];
  for (size_t at = 0; at < values.size(); at += kBlock) {
    const size_t n = std::min(kBlock, values.size() - at);
    values.Read(at, std::span<float>(block, n));
    sum->AddSquares(std::span<const float>(block, n));
  }
}

}  // namespace pshard
