#include "common/rng.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace pshard {
namespace {

// Inverse of x ^= x >> shift.
uint64_t UndoXorShiftRight(uint64_t y, int shift) {
  uint64_t x = y;
  for (int i = 0; i < 64 / shift + 1; ++i) x = y ^ (x >> shift);
  return x;
}

// Multiplicative inverse of an odd number modulo 2^64 (Newton iteration).
uint64_t InverseOdd(uint64_t c) {
  uint64_t inv = c;
  for (int i = 0; i < 6; ++i) inv *= 2 - c * inv;
  return inv;
}

// Inverse of Mix64, used to build counters whose hash is a chosen value.
uint64_t InverseMix64(uint64_t y) {
  uint64_t x = UndoXorShiftRight(y, 31);
  x *= InverseOdd(0x94d049bb133111ebull);
  x = UndoXorShiftRight(x, 27);
  x *= InverseOdd(0xbf58476d1ce4e5b9ull);
  x = UndoXorShiftRight(x, 30);
  return x - 0x9e3779b97f4a7c15ull;
}

// The index at which CounterHash(seed, stream, index) == hash.
uint64_t IndexWithHash(uint64_t seed, uint64_t stream, uint64_t hash) {
  return InverseMix64(hash) ^ Mix64(Mix64(seed) ^ stream);
}

TEST(RngTest, Mix64IsTheSplitMix64Finalizer) {
  // The published SplitMix64 sequence from state 0: output k is Mix64(k * gamma).
  EXPECT_EQ(Mix64(0), 0xe220a8397b1dcdafull);
  EXPECT_EQ(Mix64(0x9e3779b97f4a7c15ull), 0x6e789e6aa1b965f4ull);
  EXPECT_EQ(Mix64(2 * 0x9e3779b97f4a7c15ull), 0x06c45d188009454full);
}

TEST(RngTest, InverseMix64RoundTrips) {
  for (uint64_t x : {0ull, 1ull, 0xffffffffffffffffull, 0x0123456789abcdefull}) {
    EXPECT_EQ(Mix64(InverseMix64(x)), x);
    EXPECT_EQ(InverseMix64(Mix64(x)), x);
  }
}

TEST(RngTest, Deterministic) {
  for (uint64_t seed : {0ull, 1ull, 1337ull}) {
    for (uint64_t index : {0ull, 1ull, 999999ull, ~0ull}) {
      EXPECT_EQ(CounterHash(seed, 5, index), CounterHash(seed, 5, index));
      EXPECT_EQ(UniformAt(seed, 5, index), UniformAt(seed, 5, index));
      EXPECT_EQ(NormalAt(seed, 5, index), NormalAt(seed, 5, index));
    }
  }
  EXPECT_EQ(CounterHash(7, 3, 11), Mix64(Mix64(Mix64(7) ^ 3) ^ 11));
}

TEST(RngTest, IndependentOfCallOrder) {
  constexpr int kStreams = 8;
  constexpr int kIndices = 500;
  std::vector<double> forward(kStreams * kIndices);
  for (int s = 0; s < kStreams; ++s) {
    for (int i = 0; i < kIndices; ++i) forward[s * kIndices + i] = NormalAt(42, s, i);
  }
  // Reverse order, streams interleaved, with unrelated calls in between.
  for (int i = kIndices - 1; i >= 0; --i) {
    for (int s = kStreams - 1; s >= 0; --s) {
      (void)UniformAt(43, s + 100, i * 7);
      ASSERT_EQ(NormalAt(42, s, i), forward[s * kIndices + i]) << "stream " << s << " index " << i;
    }
  }
}

TEST(RngTest, DistinctStreamsAndSeedsDiffer) {
  // All 64-bit hashes over 4 seeds x 16 streams x 1000 indices are distinct:
  // no stream is a shifted copy of another. (A chance collision among 64000
  // 64-bit values has probability about 1e-10.)
  std::vector<uint64_t> hashes;
  for (uint64_t seed = 0; seed < 4; ++seed) {
    for (uint64_t stream = 0; stream < 16; ++stream) {
      for (uint64_t index = 0; index < 1000; ++index) {
        hashes.push_back(CounterHash(seed, stream, index));
      }
    }
  }
  std::sort(hashes.begin(), hashes.end());
  EXPECT_EQ(std::adjacent_find(hashes.begin(), hashes.end()), hashes.end());
  // Swapping the roles of seed and stream gives a different value too.
  EXPECT_NE(CounterHash(1, 2, 0), CounterHash(2, 1, 0));
}

TEST(RngTest, UniformIsInHalfOpenUnitInterval) {
  // The extremes, reached by building the counters that hash to them.
  const uint64_t all_ones = IndexWithHash(9, 4, ~0ull);
  ASSERT_EQ(CounterHash(9, 4, all_ones), ~0ull);
  EXPECT_LT(UniformAt(9, 4, all_ones), 1.0);
  EXPECT_EQ(UniformAt(9, 4, all_ones), 1.0 - 0x1.0p-53);
  const uint64_t zero = IndexWithHash(9, 4, 0);
  EXPECT_EQ(UniformAt(9, 4, zero), 0.0);
  // NormalAt takes log(1 - u) of the uniform at counter 2 * index: where that
  // uniform is the largest one, the sample is still finite (and extreme).
  uint64_t stream = 0;
  while (IndexWithHash(9, stream, ~0ull) % 2 != 0) ++stream;
  const double extreme = NormalAt(9, stream, IndexWithHash(9, stream, ~0ull) / 2);
  EXPECT_TRUE(std::isfinite(extreme));
  EXPECT_LE(std::abs(extreme), std::sqrt(2.0 * 53.0 * std::log(2.0)) + 1e-12);

  constexpr int kSamples = 1000000;
  double sum = 0.0;
  double lo = 1.0;
  double hi = 0.0;
  for (int i = 0; i < kSamples; ++i) {
    const double u = UniformAt(2024, 1, i);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
    lo = std::min(lo, u);
    hi = std::max(hi, u);
  }
  // Mean of U(0,1): 1/2, standard error sqrt(1/12/n) = 2.9e-4; allow 5 of them.
  EXPECT_NEAR(sum / kSamples, 0.5, 5 * std::sqrt(1.0 / 12.0 / kSamples));
  EXPECT_LT(lo, 1e-5);
  EXPECT_GT(hi, 1.0 - 1e-5);
}

// Tolerances for n samples of N(0,1), each 5 standard errors: the values are
// a fixed function of the counters, so each check either always passes or
// always fails; a correct generator would fail a 5-sigma bound for a given
// seed with probability below 1e-6.
//   mean:             SE = 1/sqrt(n)                          (0.0022 for n=200k)
//   std:              SE(s) ~ sqrt((mu4 - 1) / n) / 2 = sqrt(2/n)/2   (0.0016)
//   P(|x| < 1)=0.6827: SE = sqrt(p (1 - p) / n)                (0.0010)
//   P(|x| > 2)=0.0455: SE = sqrt(p (1 - p) / n)                (0.00047)
//   lag-1 correlation: SE = 1/sqrt(n)                          (0.0022)
TEST(RngTest, NormalHasStandardMoments) {
  constexpr int kSamples = 200000;
  const double n = kSamples;
  for (uint64_t seed : {1ull, 77ull}) {
    for (uint64_t stream : {0ull, 13ull}) {
      double sum = 0.0;
      double sum_sq = 0.0;
      double lag_product = 0.0;
      int within_one = 0;
      int beyond_two = 0;
      double previous = 0.0;
      for (int i = 0; i < kSamples; ++i) {
        const double x = NormalAt(seed, stream, i);
        ASSERT_TRUE(std::isfinite(x));
        sum += x;
        sum_sq += x * x;
        if (i > 0) lag_product += x * previous;
        previous = x;
        within_one += std::abs(x) < 1.0;
        beyond_two += std::abs(x) > 2.0;
      }
      const double mean = sum / n;
      const double std = std::sqrt(sum_sq / n - mean * mean);
      SCOPED_TRACE(testing::Message() << "seed " << seed << " stream " << stream);
      EXPECT_NEAR(mean, 0.0, 5.0 / std::sqrt(n));
      EXPECT_NEAR(std, 1.0, 5.0 * std::sqrt(2.0 / n) / 2.0);
      const double p1 = 0.682689492;
      EXPECT_NEAR(within_one / n, p1, 5.0 * std::sqrt(p1 * (1 - p1) / n));
      const double p2 = 0.045500264;
      EXPECT_NEAR(beyond_two / n, p2, 5.0 * std::sqrt(p2 * (1 - p2) / n));
      EXPECT_NEAR(lag_product / (n - 1), 0.0, 5.0 / std::sqrt(n));
    }
  }
}

}  // namespace
}  // namespace pshard
