// Session tokens: each names the rank it was issued to, and repeated joins
// hold at most kPerRank tokens per rank (the oldest retire).
#include "shard_server/session_tokens.h"

#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace pshard {
namespace {

TEST(SessionTokensTest, TokensNameTheirRankAndUnknownOnesNothing) {
  SessionTokens tokens;
  const uint64_t a = tokens.Issue(0), b = tokens.Issue(1), tool = tokens.Issue(-1);
  EXPECT_EQ(tokens.Lookup(a), 0);
  EXPECT_EQ(tokens.Lookup(b), 1);
  EXPECT_EQ(tokens.Lookup(tool), -1);
  EXPECT_FALSE(tokens.Lookup(0).has_value());
  EXPECT_FALSE(tokens.Lookup(a ^ b ^ tool ^ 1).has_value());
}

TEST(SessionTokensTest, RepeatedJoinsHoldABoundedNumberPerRank) {
  SessionTokens tokens;
  std::vector<uint64_t> issued;
  for (int i = 0; i < 10000; ++i) issued.push_back(tokens.Issue(i % 3 - 1));
  EXPECT_EQ(tokens.size(), 3 * SessionTokens::kPerRank);
  // The newest of each rank still work; the oldest are retired.
  for (size_t i = issued.size() - 3 * SessionTokens::kPerRank; i < issued.size(); ++i) {
    EXPECT_EQ(tokens.Lookup(issued[i]), static_cast<int>(i % 3) - 1);
  }
  EXPECT_FALSE(tokens.Lookup(issued.front()).has_value());
  EXPECT_EQ(std::set<uint64_t>(issued.begin(), issued.end()).size(), issued.size());
}

}  // namespace
}  // namespace pshard
