// The emulated links on real servers: what shares a rate, and what a node
// pair's own link changes. Emulation never delivers early, so each check is
// a lower bound on a transfer's time (the ratios are the benchmarks').
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testutil/local_cluster.h"
#include "tests/testutil/tiny_job.h"

namespace pshard::testing {
namespace {

// Seconds to fetch every unit once, one after the other, and the bytes.
struct Fetched {
  double seconds = 0;
  int64_t bytes = 0;
};

absl::StatusOr<Fetched> FetchAll(const LocalCluster& cluster, ShardClient::Options options) {
  options.server_addresses = cluster.addresses();
  options.trainer_rank = -1;
  options.encodings = WireEncoding::kFp32;
  options.transport = "grpc";
  absl::StatusOr<std::unique_ptr<ShardClient>> client = ShardClient::Connect(options);
  if (!client.ok()) return client.status();
  Fetched f;
  const absl::Time start = absl::Now();
  for (size_t u = 0; u < (*client)->layout().partitions.size(); ++u) {
    std::shared_ptr<UnitTransfer> t = (*client)->StartFetch(static_cast<int>(u), 0);
    if (absl::Status s = t->Wait(); !s.ok()) return s;
    f.bytes += t->wire_bytes();
  }
  f.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return f;
}

class LinkEmulationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    JobConfig job = TinyGptJob(4, 1);
    auto cluster = LocalCluster::Start(job);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
  }
  std::unique_ptr<LocalCluster> cluster_;
};

// All of a node's connections share its interface: the four servers'
// slices of a unit queue behind each other on the trainer's side.
TEST_F(LinkEmulationTest, ANodesConnectionsShareItsInterface) {
  ShardClient::Options options;
  options.link.bytes_per_second = 1e6;
  options.link_scope = "node";
  auto f = FetchAll(*cluster_, options);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_GE(f->seconds, static_cast<double>(f->bytes) / 1e6);
}

// A topology's own link to a server's node replaces the default one.
TEST_F(LinkEmulationTest, ANodePairsOwnLinkReplacesTheDefault) {
  ShardClient::Options options;
  options.link.bytes_per_second = 1e9;  // fast, but for one server
  LinkSpec slow;
  slow.bytes_per_second = 2e5;
  slow.latency = absl::Milliseconds(5);
  options.link_to_node["server-2"] = slow;
  auto f = FetchAll(*cluster_, options);
  ASSERT_TRUE(f.ok()) << f.status();
  const int units = 4;  // embed, 2 blocks, head
  // Each unit waits for shard 2's quarter at 200 kB/s and two latencies.
  EXPECT_GE(f->seconds, static_cast<double>(f->bytes) / 4 / 2e5 + units * 2 * 0.005);
}

TEST_F(LinkEmulationTest, AnUnknownScopeIsRefused) {
  ShardClient::Options options;
  options.link_scope = "rack";
  options.server_addresses = cluster_->addresses();
  auto client = ShardClient::Connect(options);
  ASSERT_FALSE(client.ok());
  EXPECT_NE(client.status().message().find("unknown link scope \"rack\""), std::string::npos) << client.status();
}

}  // namespace
}  // namespace pshard::testing
