#include "common/reduction_tree.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "gtest/gtest.h"

namespace pshard {
namespace {

// Leaves whose sums depend on the order of addition (mixed magnitudes).
std::vector<std::vector<float>> Leaves(int n, int length, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-20, 20);
  std::vector<std::vector<float>> out(n, std::vector<float>(length));
  for (auto& leaf : out) {
    for (float& x : leaf) x = std::ldexp(mantissa(rng), exponent(rng));
  }
  return out;
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(ReductionTreeTest, NodesOfSmallTrees) {
  EXPECT_TRUE(IsReductionTreeNode(1, 0, 1));
  EXPECT_TRUE(IsReductionTreeNode(3, 0, 3));
  EXPECT_TRUE(IsReductionTreeNode(3, 0, 2));  // 3 splits as [0,2) + [2,3)
  EXPECT_TRUE(IsReductionTreeNode(3, 2, 1));
  EXPECT_FALSE(IsReductionTreeNode(3, 1, 2));
  EXPECT_TRUE(IsReductionTreeNode(8, 4, 4));
  EXPECT_TRUE(IsReductionTreeNode(8, 6, 2));
  EXPECT_FALSE(IsReductionTreeNode(8, 3, 2));
  EXPECT_FALSE(IsReductionTreeNode(8, 0, 3));
  EXPECT_FALSE(IsReductionTreeNode(4, 0, 5));
  EXPECT_FALSE(IsReductionTreeNode(4, -1, 1));
  for (int n = 1; n <= 33; ++n) {
    for (int i = 0; i < n; ++i) EXPECT_TRUE(IsReductionTreeNode(n, i, 1)) << n << " " << i;
    // Aligned power-of-two groups that fit in a power-of-two total are nodes.
    for (int g = 1; g <= n; g *= 2) {
      if ((n & (n - 1)) == 0 && n % g == 0) {
        for (int b = 0; b < n; b += g) EXPECT_TRUE(IsReductionTreeNode(n, b, g)) << n << " " << b << " " << g;
      }
    }
  }
}

TEST(ReductionTreeTest, SplitsAtTheLargestPowerOfTwoBelow) {
  const auto leaves = Leaves(3, 64, 1);
  std::vector<float> expected = leaves[0];
  for (size_t i = 0; i < expected.size(); ++i) expected[i] = (leaves[0][i] + leaves[1][i]) + leaves[2][i];
  EXPECT_TRUE(BitEqual(TreeSum(leaves), expected));
  const auto five = Leaves(5, 64, 2);
  std::vector<float> e5(64);
  for (int i = 0; i < 64; ++i) {
    e5[i] = ((five[0][i] + five[1][i]) + (five[2][i] + five[3][i])) + five[4][i];
  }
  EXPECT_TRUE(BitEqual(TreeSum(five), e5));
  EXPECT_TRUE(BitEqual(TreeSum({leaves[1]}), leaves[1]));
}

// Any arrival order and any pre-summed node give the same bits as TreeSum.
TEST(ReductionTreeTest, ReducerMatchesTreeSumInAnyOrderAndGrouping) {
  for (int n : {1, 2, 3, 4, 5, 7, 8, 12}) {
    const auto leaves = Leaves(n, 32, 100 + n);
    const std::vector<float> expected = TreeSum(leaves);
    std::mt19937 rng(n);
    for (int trial = 0; trial < 20; ++trial) {
      // Pre-sum aligned groups of size g where they are nodes.
      const int g = 1 << (trial % 3);
      std::vector<std::pair<int, int>> parts;
      for (int b = 0; b < n;) {
        const int c = (b + g <= n && IsReductionTreeNode(n, b, g)) ? g : 1;
        parts.emplace_back(b, c);
        b += c;
      }
      std::shuffle(parts.begin(), parts.end(), rng);
      TreeReducer reducer(n);
      for (auto [b, c] : parts) {
        std::vector<std::vector<float>> group(leaves.begin() + b, leaves.begin() + b + c);
        ASSERT_TRUE(reducer.Add(b, c, TreeSum(group)).ok());
        EXPECT_TRUE(reducer.Covers(b, c));
      }
      ASSERT_TRUE(reducer.complete()) << n;
      EXPECT_TRUE(BitEqual(reducer.TakeTotal(), expected)) << "n=" << n << " trial " << trial;
    }
  }
}

// A device sums micro-batch gradients in a few fixed buffers by following
// InOrderTreeSum's merges; the result must be the tree's sum, bit for bit.
TEST(ReductionTreeTest, InOrderStackOfSlotsMatchesTreeSum) {
  for (int n = 1; n <= 17; ++n) {
    const auto leaves = Leaves(n, 16, 300 + n);
    const int needed = InOrderTreeSum::SlotsNeeded(n);
    EXPECT_LE(needed, 1 + static_cast<int>(std::floor(std::log2(n)))) << "n=" << n;
    std::vector<std::vector<float>> slots(needed);
    InOrderTreeSum sum(n);
    for (int i = 0; i < n; ++i) {
      const int slot = sum.NextSlot();
      ASSERT_LT(slot, needed) << "n=" << n << " leaf " << i;
      slots[slot] = leaves[i];
      for (int s : sum.AddLeaf()) {
        ASSERT_GE(s, 1);
        for (size_t k = 0; k < slots[s].size(); ++k) slots[s - 1][k] = slots[s - 1][k] + slots[s][k];
      }
    }
    EXPECT_EQ(sum.NextSlot(), 1) << "n=" << n << ": one partial sum left, the total";
    EXPECT_TRUE(BitEqual(slots[0], TreeSum(leaves))) << "n=" << n;
  }
}

TEST(ReductionTreeTest, RefusesNonNodesAndOverlapsWithoutChange) {
  TreeReducer reducer(4);
  ASSERT_TRUE(reducer.Add(0, 1, {1.0f}).ok());
  EXPECT_FALSE(reducer.Add(1, 2, {1.0f}).ok());  // not a node
  EXPECT_FALSE(reducer.Add(0, 2, {1.0f}).ok());  // overlaps leaf 0
  EXPECT_FALSE(reducer.Add(0, 1, {1.0f}).ok());  // already there
  EXPECT_FALSE(reducer.Add(4, 1, {1.0f}).ok());  // outside
  ASSERT_TRUE(reducer.Add(1, 1, {2.0f}).ok());
  EXPECT_TRUE(reducer.Covers(0, 2));
  EXPECT_FALSE(reducer.Add(0, 1, {1.0f}).ok());  // inside the combined node
  ASSERT_TRUE(reducer.Add(2, 2, {4.0f}).ok());
  ASSERT_TRUE(reducer.complete());
  EXPECT_EQ(reducer.TakeTotal(), std::vector<float>{7.0f});
}

}  // namespace
}  // namespace pshard
