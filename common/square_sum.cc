#include "common/square_sum.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"

namespace pshard {
namespace {

// Adds `value` << `shift` bits into `words` (little-endian, fixed width).
template <size_t N>
void AddShifted(std::array<uint64_t, N>& words, unsigned __int128 value, int shift) {
  size_t at = static_cast<size_t>(shift / 64);
  const int bits = shift % 64;
  // value << bits spans three words at most.
  const uint64_t lo = static_cast<uint64_t>(value);
  const uint64_t hi = static_cast<uint64_t>(value >> 64);
  uint64_t parts[3] = {lo << bits, bits == 0 ? hi : (hi << bits) | (lo >> (64 - bits)),
                       bits == 0 ? 0 : hi >> (64 - bits)};
  unsigned __int128 carry = 0;
  for (int i = 0; at < N && (i < 3 || carry != 0); ++i, ++at) {
    const unsigned __int128 sum = static_cast<unsigned __int128>(words[at]) + (i < 3 ? parts[i] : 0) + carry;
    words[at] = static_cast<uint64_t>(sum);
    carry = sum >> 64;
  }
}

}  // namespace

void SquareSum::AddSquares(std::span<const float> values) {
  // Per float exponent, 64-bit bins, two sets taking alternate values (so
  // that neighbours, whose exponents are often equal, do not wait on one
  // bin), folded into pending_ every kRun values: a square's significand
  // part is below 2^48, so kRun = 2^16 of them cannot overflow a bin.
  constexpr size_t kRun = size_t{1} << 16;
  std::array<uint64_t, 256> even, odd;
  uint32_t non_finite = 0;
  // x = m * 2^(e - 150) with e = max(exponent, 1): subnormals share the
  // smallest normal exponent, without the implicit bit. Bin 0 gathers
  // the subnormals and bin 255 the non-finite values (dropped).
  auto split = [&non_finite](float x, uint32_t& exponent) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    exponent = (bits >> 23) & 0xff;
    non_finite |= static_cast<uint32_t>(exponent == 0xff);
    const uint64_t m = (bits & 0x7fffff) | (exponent == 0 ? 0u : 0x800000u);
    return m * m;
  };
  for (size_t at = 0; at < values.size(); at += kRun) {
    const size_t end = std::min(values.size(), at + kRun);
    even.fill(0);
    odd.fill(0);
    size_t i = at;
    for (; i + 2 <= end; i += 2) {
      uint32_t e0, e1;
      const uint64_t s0 = split(values[i], e0);
      const uint64_t s1 = split(values[i + 1], e1);
      even[e0] += s0;
      odd[e1] += s1;
    }
    if (i < end) {
      uint32_t e;
      const uint64_t s = split(values[i], e);
      even[e] += s;
    }
    pending_[1] += static_cast<unsigned __int128>(even[0]) + odd[0];
    for (int e = 1; e < 255; ++e) pending_[e] += static_cast<unsigned __int128>(even[e]) + odd[e];
  }
  non_finite_ = non_finite_ || non_finite != 0;
  has_pending_ = true;
}

void SquareSum::Fold() const {
  if (!has_pending_) return;
  for (int e = 1; e < 255; ++e) {
    if (pending_[e] == 0) continue;
    // m^2 * 2^(2(e - 150)) in units of 2^-298: shifted by 2e - 2 bits.
    AddShifted(words_, pending_[e], 2 * e - 2);
    pending_[e] = 0;
  }
  has_pending_ = false;
}

void SquareSum::Add(const SquareSum& other) {
  Fold();
  other.Fold();
  for (int i = 0; i < kWords; ++i) AddShifted(words_, other.words_[i], 64 * i);
  non_finite_ = non_finite_ || other.non_finite_;
}

double SquareSum::ToDouble() const {
  if (non_finite_) return std::numeric_limits<double>::infinity();
  Fold();
  int top = kWords - 1;
  while (top >= 0 && words_[top] == 0) --top;
  if (top < 0) return 0.0;
  // The top three words, in long double, then scaled: a function of the
  // words alone.
  long double value = 0;
  const int low = top >= 2 ? top - 2 : 0;
  for (int i = top; i >= low; --i) value = value * 18446744073709551616.0L + static_cast<long double>(words_[i]);
  return static_cast<double>(std::ldexp(value, 64 * low - 298));
}

std::string SquareSum::ToBytes() const {
  Fold();
  int used = kWords;
  while (used > 0 && words_[used - 1] == 0) --used;
  std::string out(1 + 8 * used, '\0');
  out[0] = non_finite_ ? 1 : 0;
  for (int i = 0; i < used; ++i) {
    for (int b = 0; b < 8; ++b) out[1 + 8 * i + b] = static_cast<char>((words_[i] >> (8 * b)) & 0xff);
  }
  return out;
}

absl::StatusOr<SquareSum> SquareSum::FromBytes(std::string_view bytes) {
  if (bytes.empty() || (bytes.size() - 1) % 8 != 0 || bytes.size() > 1 + 8 * kWords ||
      (static_cast<uint8_t>(bytes[0]) & ~1u) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("an exact sum of squares is a flags byte (0 or 1) and at most ", kWords,
                     " 8-byte words; got ", bytes.size(), " bytes"));
  }
  SquareSum sum;
  sum.non_finite_ = bytes[0] == 1;
  for (size_t i = 0; i < (bytes.size() - 1) / 8; ++i) {
    uint64_t w = 0;
    for (int b = 0; b < 8; ++b) w |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[1 + 8 * i + b])) << (8 * b);
    sum.words_[i] = w;
  }
  return sum;
}

bool SquareSum::operator==(const SquareSum& other) const {
  Fold();
  other.Fold();
  return non_finite_ == other.non_finite_ && words_ == other.words_;
}

}  // namespace pshard
