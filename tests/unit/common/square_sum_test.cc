// The exact sum of squares: the same bits however the values are split and
// ordered, close to the true sum, and carried between shards as bytes.
#include "common/square_sum.h"

#include <algorithm>
#include <cstring>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace pshard {
namespace {

// Values over the whole float range: subnormals, tiny, ordinary, huge.
std::vector<float> WideValues(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mantissa(-2.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-149, 120);
  std::vector<float> v(n);
  for (float& x : v) x = std::ldexp(mantissa(rng), exponent(rng));
  v[0] = std::numeric_limits<float>::denorm_min();
  v[1] = std::numeric_limits<float>::max();
  v[2] = -std::numeric_limits<float>::min();
  return v;
}

TEST(SquareSumTest, SmallSumsAreExact) {
  SquareSum s;
  const std::vector<float> v = {1, -2, 3, 0.5f, -0.0f};
  s.AddSquares(v);
  EXPECT_EQ(s.ToDouble(), 14.25);
  SquareSum tiny;
  const float d = std::numeric_limits<float>::denorm_min();  // 2^-149
  tiny.AddSquares(std::span<const float>(&d, 1));
  EXPECT_EQ(tiny.ToDouble(), std::ldexp(1.0, -298));
  SquareSum ones;
  ones.AddSquares(std::vector<float>(1000003, 1.0f));
  EXPECT_EQ(ones.ToDouble(), 1000003.0);
  EXPECT_EQ(SquareSum().ToDouble(), 0.0);
  // Where doubles lose the small terms: (1e8)^2 + 1 + 1.
  SquareSum big;
  big.AddSquares(std::vector<float>{1.0f, 1e8f, 1.0f});
  EXPECT_EQ(big.ToDouble(), 1e16 + 2);
}

TEST(SquareSumTest, TheSameBitsHoweverSplitAndOrdered) {
  const std::vector<float> values = WideValues(20000, 1);
  SquareSum whole;
  whole.AddSquares(values);
  std::mt19937 rng(2);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<float> shuffled = values;
    std::shuffle(shuffled.begin(), shuffled.end(), rng);
    // Split into uneven parts (as shards' slices are), summed separately,
    // then added in a shuffled order.
    std::vector<SquareSum> parts;
    size_t at = 0;
    while (at < shuffled.size()) {
      const size_t n = std::min<size_t>(1 + rng() % 3000, shuffled.size() - at);
      SquareSum part;
      part.AddSquares(std::span<const float>(shuffled.data() + at, n));
      parts.push_back(part);
      at += n;
    }
    std::shuffle(parts.begin(), parts.end(), rng);
    SquareSum total;
    for (const SquareSum& p : parts) total.Add(p);
    EXPECT_TRUE(total == whole) << "trial " << trial;
    EXPECT_EQ(total.ToBytes(), whole.ToBytes());
    const double a = total.ToDouble(), b = whole.ToDouble();
    EXPECT_EQ(std::memcmp(&a, &b, sizeof(double)), 0);
  }
}

TEST(SquareSumTest, CloseToTheTrueSum) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1e-3f);
  std::vector<float> v(100000);
  for (float& x : v) x = normal(rng);
  long double want = 0;
  for (float x : v) want += static_cast<long double>(x) * x;
  SquareSum s;
  s.AddSquares(v);
  EXPECT_NEAR(s.ToDouble(), static_cast<double>(want), 1e-14 * static_cast<double>(want));
  // The largest float, squared, is still a number.
  SquareSum max;
  const float m = std::numeric_limits<float>::max();
  max.AddSquares(std::vector<float>{m, m});
  const double m2 = static_cast<double>(m) * m;
  EXPECT_NEAR(max.ToDouble(), 2 * m2, 1e-15 * 2 * m2);
}

TEST(SquareSumTest, NonFiniteValuesMakeTheSumNonFinite) {
  for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    SquareSum s;
    s.AddSquares(std::vector<float>{1.0f, bad});
    EXPECT_FALSE(s.finite());
    EXPECT_TRUE(std::isinf(s.ToDouble()));
    SquareSum clean;
    clean.AddSquares(std::vector<float>{2.0f});
    clean.Add(s);
    EXPECT_FALSE(clean.finite());
    absl::StatusOr<SquareSum> back = SquareSum::FromBytes(s.ToBytes());
    ASSERT_TRUE(back.ok());
    EXPECT_FALSE(back->finite());
  }
}

TEST(SquareSumTest, BytesRoundTripAndMalformedBytesAreRefused) {
  SquareSum s;
  s.AddSquares(WideValues(500, 4));
  absl::StatusOr<SquareSum> back = SquareSum::FromBytes(s.ToBytes());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == s);
  EXPECT_EQ(SquareSum().ToBytes(), std::string(1, '\0'));  // zero: the flags byte alone
  for (const std::string& bad : {std::string(), std::string(2, '\0'), std::string(1 + 8 * 11, '\0'),
                                 std::string(1, '\x02'), std::string(9, '\x01') + std::string(1, 'x')}) {
    EXPECT_EQ(SquareSum::FromBytes(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad.size();
  }
}

}  // namespace
}  // namespace pshard
