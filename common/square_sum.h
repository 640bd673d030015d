// The sum of the squares of fp32 values, held exactly. The square of a
// float is a whole multiple of 2^-298 below 2^256, so a sum of them fits a
// fixed-point number of 640 bits, and adding to it is exact: associative
// and commutative. However a gradient is split (over shards, units,
// slices) and in whatever order the parts are added, the total is the same
// bits, so the global gradient norm, and with it clipping, does not depend
// on the number of shard servers.
#ifndef PSHARD_COMMON_SQUARE_SUM_H_
#define PSHARD_COMMON_SQUARE_SUM_H_

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace pshard {

/// A plain value; not thread-safe. Sums of up to 2^63 squares are exact.
class SquareSum {
 public:
  /// Adds x * x for every x; a NaN or infinity makes the sum non-finite.
  void AddSquares(std::span<const float> values);
  /// Adds another sum.
  void Add(const SquareSum& other);

  /// Whether no NaN or infinity was added.
  bool finite() const { return !non_finite_; }
  /// The sum rounded to a double (deterministic: a function of the exact
  /// sum alone); +infinity when not finite.
  double ToDouble() const;

  /// A compact encoding: a flags byte (bit 0: not finite), then the
  /// non-zero low part of the number as 64-bit little-endian words.
  std::string ToBytes() const;
  /// InvalidArgument for anything ToBytes cannot have written.
  static absl::StatusOr<SquareSum> FromBytes(std::string_view bytes);

  bool operator==(const SquareSum& other) const;

 private:
  static constexpr int kWords = 10;  // 640 bits
  // The squares not yet folded into `words_`: per float exponent, the sum
  // of the squared significands (each < 2^48), exact for 2^80 values.
  void Fold() const;

  mutable std::array<unsigned __int128, 256> pending_{};
  mutable bool has_pending_ = false;
  mutable std::array<uint64_t, kWords> words_{};  // units of 2^-298
  bool non_finite_ = false;
};

}  // namespace pshard

#endif  // PSHARD_COMMON_SQUARE_SUM_H_
