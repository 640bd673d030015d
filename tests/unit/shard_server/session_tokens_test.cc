// Session tokens: each names the rank it was issued to; repeated joins hold
// at most kPerRank tokens per rank; a trainer's live session is never
// retired by another Join of its rank (that Join is refused instead), an
// idle one is, and a rejoin retires the token it names.
#include "shard_server/session_tokens.h"

#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace pshard {
namespace {

// A clock the test moves by hand.
struct FakeClock {
  absl::Time now = absl::FromUnixSeconds(1'000'000);
  std::function<absl::Time()> fn() {
    return [this] { return now; };
  }
};

TEST(SessionTokensTest, TokensNameTheirRankAndUnknownOnesNothing) {
  SessionTokens tokens;
  const uint64_t a = *tokens.Issue(0), b = *tokens.Issue(1), tool = *tokens.Issue(-1);
  EXPECT_EQ(tokens.Lookup(a), 0);
  EXPECT_EQ(tokens.Lookup(b), 1);
  EXPECT_EQ(tokens.Lookup(tool), -1);
  EXPECT_FALSE(tokens.Lookup(0).has_value());
  EXPECT_FALSE(tokens.Lookup(a ^ b ^ tool ^ 1).has_value());
}

TEST(SessionTokensTest, RepeatedJoinsHoldABoundedNumberPerRank) {
  FakeClock clock;
  SessionTokens tokens(clock.fn());
  std::vector<uint64_t> issued;
  for (int i = 0; i < 10000; ++i) {
    absl::StatusOr<uint64_t> token = tokens.Issue(i % 3 - 1);
    ASSERT_TRUE(token.ok()) << i << ": " << token.status();
    issued.push_back(*token);
    clock.now += SessionTokens::kUnusedGrace;  // each unused one falls idle
  }
  EXPECT_EQ(tokens.size(), 3 * SessionTokens::kPerRank);
  // The newest of each rank still work; the oldest are retired.
  for (size_t i = issued.size() - 3 * SessionTokens::kPerRank; i < issued.size(); ++i) {
    EXPECT_EQ(tokens.Lookup(issued[i]), static_cast<int>(i % 3) - 1);
  }
  EXPECT_FALSE(tokens.Lookup(issued.front()).has_value());
  EXPECT_EQ(std::set<uint64_t>(issued.begin(), issued.end()).size(), issued.size());
}

TEST(SessionTokensTest, AJoinCannotTakeALiveSessionOfItsRankButAnIdleOne) {
  FakeClock clock;
  SessionTokens tokens(clock.fn());
  const uint64_t victim = *tokens.Issue(0);
  // Others join as rank 0 while the victim uses its session: they fill the
  // rank's other places, and then are refused.
  std::vector<uint64_t> others;
  for (size_t i = 1; i < SessionTokens::kPerRank; ++i) others.push_back(*tokens.Issue(0));
  for (int i = 0; i < 20; ++i) {
    clock.now += absl::Milliseconds(100);
    ASSERT_EQ(tokens.Lookup(victim), 0);
    absl::StatusOr<uint64_t> more = tokens.Issue(0);
    ASSERT_FALSE(more.ok()) << "join " << i << " took a live session";
    EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_NE(more.status().message().find("trainer 0 already holds 8 live sessions"), std::string::npos)
        << more.status();
  }
  EXPECT_EQ(tokens.Lookup(victim), 0);
  // The others were never used: idle after their grace, they are the ones
  // that go, oldest first; the victim, used, stays.
  clock.now += SessionTokens::kUnusedGrace;
  ASSERT_EQ(tokens.Lookup(victim), 0);
  const uint64_t next = *tokens.Issue(0);
  EXPECT_FALSE(tokens.Lookup(others.front()).has_value());
  EXPECT_EQ(tokens.Lookup(others.back()), 0);
  EXPECT_EQ(tokens.Lookup(next), 0);
  EXPECT_EQ(tokens.Lookup(victim), 0);
  // A session unused for kUsedLive is idle too.
  clock.now += SessionTokens::kUsedLive;
  for (size_t i = 0; i < SessionTokens::kPerRank; ++i) ASSERT_TRUE(tokens.Issue(0).ok());
  EXPECT_FALSE(tokens.Lookup(victim).has_value());
  // Other ranks were never touched; readers do not hold on to theirs.
  EXPECT_TRUE(tokens.Issue(1).ok());
  for (size_t i = 0; i < 3 * SessionTokens::kPerRank; ++i) ASSERT_TRUE(tokens.Issue(-1).ok());
}

TEST(SessionTokensTest, ARejoinRetiresTheSessionItNamesAndNoOther) {
  FakeClock clock;
  SessionTokens tokens(clock.fn());
  uint64_t mine = *tokens.Issue(0);
  const uint64_t other_rank = *tokens.Issue(1);
  // Hundreds of rejoins in a second, each naming the last: one place held.
  for (int i = 0; i < 500; ++i) {
    ASSERT_EQ(tokens.Lookup(mine), 0);
    absl::StatusOr<uint64_t> again = tokens.Issue(0, mine);
    ASSERT_TRUE(again.ok()) << i << ": " << again.status();
    EXPECT_FALSE(tokens.Lookup(mine).has_value());
    mine = *again;
  }
  EXPECT_EQ(tokens.size(), 2u);
  // Naming another rank's token retires nothing.
  ASSERT_TRUE(tokens.Issue(0, other_rank).ok());
  EXPECT_EQ(tokens.Lookup(other_rank), 1);
}

}  // namespace
}  // namespace pshard
