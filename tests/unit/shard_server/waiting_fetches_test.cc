// The caps on fetches held unanswered: per connection and in all, a place
// given back when dropped, the gauge following the total.
#include "shard_server/waiting_fetches.h"

#include <memory>
#include <vector>

#include "gtest/gtest.h"

namespace pshard {
namespace {

TEST(WaitingFetchesTest, CapsEachConnectionAndTheTotalAndGivesPlacesBack) {
  metrics::Gauge gauge;
  WaitingFetches waiting(WaitingFetches::Limits{.per_connection = 3, .total = 5}, &gauge);
  std::vector<std::shared_ptr<WaitingFetches::Place>> a, b;
  for (int i = 0; i < 3; ++i) a.push_back(*waiting.Take("a"));
  absl::StatusOr<std::shared_ptr<WaitingFetches::Place>> fourth = waiting.Take("a");
  ASSERT_FALSE(fourth.ok());
  EXPECT_EQ(fourth.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(fourth.status().message().find("the cap of one connection"), std::string::npos) << fourth.status();
  for (int i = 0; i < 2; ++i) b.push_back(*waiting.Take("b"));
  EXPECT_EQ(waiting.total(), 5);
  EXPECT_EQ(gauge.Value(), 5);
  absl::StatusOr<std::shared_ptr<WaitingFetches::Place>> sixth = waiting.Take("c");
  ASSERT_FALSE(sixth.ok());
  EXPECT_NE(sixth.status().message().find("this shard holds 5 fetches waiting"), std::string::npos) << sixth.status();
  // A refusal holds nothing; a dropped place is given back.
  a.pop_back();
  EXPECT_EQ(waiting.total(), 4);
  EXPECT_EQ(gauge.Value(), 4);
  EXPECT_TRUE(waiting.Take("c").ok());  // taken and dropped at once
  EXPECT_TRUE(waiting.Take("a").ok());
  a.clear();
  b.clear();
  EXPECT_EQ(waiting.total(), 0);
  EXPECT_EQ(gauge.Value(), 0);
}

TEST(WaitingFetchesTest, PlacesMayOutliveTheCaps) {
  metrics::Gauge gauge;
  std::shared_ptr<WaitingFetches::Place> kept;
  {
    WaitingFetches waiting(WaitingFetches::Limits{}, &gauge);
    kept = *waiting.Take("a");
  }
  kept.reset();
  EXPECT_EQ(gauge.Value(), 0);
}

}  // namespace
}  // namespace pshard
