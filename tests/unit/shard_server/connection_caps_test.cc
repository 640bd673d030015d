// The caps on what callers make a server hold: per connection and in all,
// amounts given back when a place is dropped, a place that grows within the
// caps, the gauge following the total.
#include "shard_server/connection_caps.h"

#include <memory>
#include <vector>

#include "gtest/gtest.h"

namespace pshard {
namespace {

using Place = std::shared_ptr<ConnectionCaps::Place>;

TEST(ConnectionCapsTest, CapsEachConnectionAndTheTotalAndGivesPlacesBack) {
  metrics::Gauge gauge;
  ConnectionCaps caps("fetches waiting", ConnectionCaps::Limits{.per_connection = 3, .total = 5}, &gauge);
  std::vector<Place> a, b;
  for (int i = 0; i < 3; ++i) a.push_back(*caps.Take("a", 1));
  absl::StatusOr<Place> fourth = caps.Take("a", 1);
  ASSERT_FALSE(fourth.ok());
  EXPECT_EQ(fourth.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(fourth.status().message(), "this connection holds 3 fetches waiting of at most 3 a connection");
  for (int i = 0; i < 2; ++i) b.push_back(*caps.Take("b", 1));
  EXPECT_EQ(caps.total(), 5);
  EXPECT_EQ(gauge.Value(), 5);
  absl::StatusOr<Place> sixth = caps.Take("c", 1);
  ASSERT_FALSE(sixth.ok());
  EXPECT_EQ(sixth.status().message(), "this shard holds 5 fetches waiting of at most 5: try again later");
  // A refusal holds nothing; a dropped place is given back.
  a.pop_back();
  EXPECT_EQ(caps.total(), 4);
  EXPECT_EQ(gauge.Value(), 4);
  EXPECT_TRUE(caps.Take("c", 1).ok());  // taken and dropped at once
  EXPECT_TRUE(caps.Take("a", 1).ok());
  a.clear();
  b.clear();
  EXPECT_EQ(caps.total(), 0);
  EXPECT_EQ(gauge.Value(), 0);
}

TEST(ConnectionCapsTest, APlaceGrowsWithinTheCapsAndKeepsWhatItHadWhenRefused) {
  metrics::Gauge gauge;
  ConnectionCaps caps("bytes", ConnectionCaps::Limits{.per_connection = 100, .total = 150}, &gauge);
  Place push = *caps.Take("a", 0);
  EXPECT_TRUE(push->Grow(60).ok());
  EXPECT_TRUE(push->Grow(40).ok());
  const absl::Status over = push->Grow(1);
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(over.message(), "this connection holds 100 bytes of at most 100 a connection");
  EXPECT_EQ(caps.total(), 100);
  Place other = *caps.Take("b", 50);
  EXPECT_EQ(caps.Take("c", 1).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(caps.Take("c", 0).ok());  // nothing held, nothing refused
  push.reset();
  EXPECT_EQ(caps.total(), 50);
  EXPECT_EQ(gauge.Value(), 50);
  EXPECT_TRUE(caps.Take("c", 100).ok());
}

TEST(ConnectionCapsTest, PlacesMayOutliveTheCaps) {
  metrics::Gauge gauge;
  Place kept;
  {
    ConnectionCaps caps("fetches", ConnectionCaps::Limits{.per_connection = 1, .total = 1}, &gauge);
    kept = *caps.Take("a", 1);
  }
  EXPECT_EQ(gauge.Value(), 1);
  kept.reset();
  EXPECT_EQ(gauge.Value(), 0);
}

}  // namespace
}  // namespace pshard
