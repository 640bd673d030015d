// Reduction values: a contribution kept in bf16 until it is added gives the
// same sums, bit for bit, as one decoded on arrival, at half the memory.
#include "common/reduction_values.h"

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "common/optimizer.h"
#include "common/reduction_tree.h"
#include "gtest/gtest.h"

namespace pshard {
namespace {

// `n` values, already bf16-exact (what a bf16 push carries).
std::vector<float> Bf16Values(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.01f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  RoundTripInPlace(WireEncoding::kBf16, v);
  return v;
}

ReductionValues Encoded(const std::vector<float>& values) {
  ReductionValues r = ReductionValues::Allocate(WireEncoding::kBf16, values.size());
  EncodeElements(WireEncoding::kBf16, values, r.mutable_bytes().data());
  return r;
}

TEST(ReductionValuesTest, AnEncodedContributionTakesHalfTheMemoryAndDecodesExactly) {
  const std::vector<float> v = Bf16Values(10001, 1);
  ReductionValues r = Encoded(v);
  EXPECT_TRUE(r.encoded());
  EXPECT_EQ(r.size(), v.size());
  EXPECT_EQ(r.memory_bytes(), static_cast<int64_t>(2 * v.size()));
  SquareSum encoded, decoded;
  AddSquares(r, &encoded);
  decoded.AddSquares(v);
  EXPECT_TRUE(encoded == decoded);
  std::vector<float> part(100);
  r.Read(5000, part);
  EXPECT_EQ(part, std::vector<float>(v.begin() + 5000, v.begin() + 5100));
  EXPECT_EQ(std::move(r).TakeFloats(), v);
}

TEST(ReductionValuesTest, TreeSumsOfEncodedLeavesEqualThoseOfDecodedOnesBitForBit) {
  for (int n : {1, 2, 3, 5, 8}) {
    std::vector<std::vector<float>> leaves;
    for (int i = 0; i < n; ++i) leaves.push_back(Bf16Values(9000, 10 + i));
    const std::vector<float> want = TreeSum(leaves);
    // Last to first, every other leaf encoded.
    TreeReducer reducer(n);
    std::vector<int> order(n);
    for (int i = 0; i < n; ++i) order[i] = n - 1 - i;
    for (int i : order) {
      ReductionValues leaf = i % 2 == 0 ? Encoded(leaves[i]) : ReductionValues(leaves[i]);
      ASSERT_TRUE(reducer.Add(i, 1, std::move(leaf)).ok());
    }
    ASSERT_TRUE(reducer.complete());
    ReductionValues total = reducer.TakeTotalValues();
    EXPECT_EQ(total.encoded(), n == 1) << "only a lone leaf stays encoded";
    EXPECT_EQ(std::move(total).TakeFloats(), want) << n << " leaves";
  }
}

TEST(ReductionValuesTest, NonFiniteEncodedValuesAreSeenAndZeroKeepsTheEncoding) {
  std::vector<float> v = Bf16Values(300, 3);
  EXPECT_TRUE(Encoded(v).AllFinite());
  for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<float> w = v;
    w[123] = bad;
    ReductionValues r = Encoded(w);
    EXPECT_FALSE(r.AllFinite());
    r.Zero();
    EXPECT_TRUE(r.encoded());
    EXPECT_TRUE(r.AllFinite());
    SquareSum zero;
    AddSquares(r, &zero);
    EXPECT_EQ(zero.ToDouble(), 0.0);
  }
  ReductionValues fp32(v);
  fp32.Zero();
  EXPECT_EQ(std::move(fp32).TakeFloats(), std::vector<float>(300, 0.0f));
}

// A receiver checks each part for infinities and NaNs as it arrives; a
// value written later, over a part already checked, is still seen.
TEST(ReductionValuesTest, FiniteChecksOfArrivedPartsAreForgottenWhereRewritten) {
  for (WireEncoding encoding : {WireEncoding::kFp32, WireEncoding::kBf16}) {
    const WireFormat format(encoding);
    const std::vector<float> v = Bf16Values(1000, 4);
    ReductionValues r = ReductionValues::Allocate(format, v.size());
    auto write = [&](size_t from, std::vector<float> part) {
      EncodeElements(encoding, part, r.mutable_bytes(from).data());
    };
    write(0, std::vector<float>(v.begin(), v.begin() + 500));
    r.CheckFiniteUpTo(500);
    std::vector<float> rest(v.begin() + 500, v.end());
    rest[200] = std::numeric_limits<float>::quiet_NaN();  // element 700
    write(500, rest);
    r.CheckFiniteUpTo(1000);
    EXPECT_FALSE(r.AllFinite()) << format.ToString() << ": a NaN in the second part";
    rest[200] = 1.0f;
    write(500, rest);
    EXPECT_TRUE(r.AllFinite()) << format.ToString();
    r.CheckFiniteUpTo(1000);
    std::vector<float> first(v.begin(), v.begin() + 500);
    first[10] = std::numeric_limits<float>::infinity();
    write(0, first);  // over the checked part, not checked again
    EXPECT_FALSE(r.AllFinite()) << format.ToString() << ": an infinity written over a checked part";
  }
}

TEST(ReductionValuesTest, AddingDecodesEitherSide) {
  const std::vector<float> a = Bf16Values(5000, 7), b = Bf16Values(5000, 8);
  std::vector<float> want(a.size());
  for (size_t i = 0; i < a.size(); ++i) want[i] = a[i] + b[i];
  for (int left = 0; left < 2; ++left) {
    for (int right = 0; right < 2; ++right) {
      ReductionValues l = left ? Encoded(a) : ReductionValues(a);
      const ReductionValues r = right ? Encoded(b) : ReductionValues(b);
      l.Add(r);
      EXPECT_FALSE(l.encoded());
      EXPECT_EQ(std::move(l).TakeFloats(), want) << left << right;
    }
  }
}

}  // namespace
}  // namespace pshard
