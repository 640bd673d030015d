// Joining a job: health, consistency checks between servers, clear errors.
#include <algorithm>

#include "gtest/gtest.h"
#include "grpcpp/grpcpp.h"
#include "proto/health.grpc.pb.h"
#include "proto/rpc_util.h"
#include "absl/strings/str_cat.h"
#include "proto/shard.grpc.pb.h"
#include "pshard/config.h"
#include "trainer_client/route_plan.h"
#include "tests/testutil/local_cluster.h"

namespace pshard::testing {
namespace {

JobConfig SmallJob(int shards, int trainers, uint64_t seed = 1) {
  JobConfig job;
  job.model = GptConfig{.num_layers = 1, .d_model = 16, .num_heads = 2, .context = 8, .vocab = 64};
  job.num_shards = shards;
  job.num_trainers = trainers;
  job.seed = seed;
  return job;
}

absl::StatusOr<std::unique_ptr<ShardClient>> ConnectTo(std::vector<std::string> addresses, int rank,
                                                       absl::Duration join_timeout = absl::Seconds(5)) {
  ShardClient::Options options;
  options.server_addresses = std::move(addresses);
  options.trainer_rank = rank;
  options.join_timeout = join_timeout;
  return ShardClient::Connect(options);
}

TEST(ClientTest, ServersReportServingOnStandardHealthCheck) {
  auto cluster = LocalCluster::Start(SmallJob(2, 1));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  for (const std::string& address : (*cluster)->addresses()) {
    auto stub = grpc::health::v1::Health::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
    grpc::Status s = stub->Check(&ctx, request, &response);
    ASSERT_TRUE(s.ok()) << address << ": " << s.error_message();
    EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  }
}

TEST(ClientTest, JoinsServersGivenInAnyOrder) {
  auto cluster = LocalCluster::Start(SmallJob(3, 1));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<std::string> addresses = (*cluster)->addresses();
  std::reverse(addresses.begin(), addresses.end());
  auto client = ConnectTo(addresses, 0);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ((*client)->job().num_shards, 3);
  EXPECT_EQ((*client)->joined_step(), 0);
  // Fetching a unit assembles the slices in shard order: equal to the init.
  auto fetched = (*client)->StartFetch(0, 0);
  ASSERT_TRUE(fetched->Wait().ok());
  const UnitSpec& unit = (*client)->layout().spec.units[0];
  std::vector<float> expected((*client)->layout().partitions[0].padded_numel());
  InitializeUnitRange(unit, 1, 0, expected);
  EXPECT_EQ(fetched->values(), expected);
}

TEST(ClientTest, RefusesServersOfDifferentJobs) {
  auto a = LocalCluster::Start(SmallJob(2, 1, /*seed=*/1));
  auto b = LocalCluster::Start(SmallJob(2, 1, /*seed=*/2));
  ASSERT_TRUE(a.ok() && b.ok());
  auto client = ConnectTo({(*a)->addresses()[0], (*b)->addresses()[1]}, 0);
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(client.status().message().find("different job"), std::string::npos) << client.status();
}

TEST(ClientTest, RefusesAnIncompleteServerList) {
  auto cluster = LocalCluster::Start(SmallJob(3, 1));
  ASSERT_TRUE(cluster.ok());
  auto client = ConnectTo({(*cluster)->addresses()[0], (*cluster)->addresses()[1]}, 0);
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(client.status().message().find("3 shards but 2 addresses"), std::string::npos) << client.status();
}

TEST(ClientTest, RefusesARankOutsideTheJob) {
  auto cluster = LocalCluster::Start(SmallJob(1, 2));
  ASSERT_TRUE(cluster.ok());
  auto client = ConnectTo((*cluster)->addresses(), 2);
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(client.status().message().find("trainer rank 2"), std::string::npos) << client.status();
}

TEST(ClientTest, NoServerGivesAnErrorNamingTheAddressAfterTheJoinDeadline) {
  const absl::Time start = absl::Now();
  auto client = ConnectTo({"127.0.0.1:1"}, 0, absl::Seconds(1));
  ASSERT_FALSE(client.ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
  EXPECT_NE(client.status().message().find("127.0.0.1:1"), std::string::npos) << client.status();
}

TEST(ClientTest, CoordinatorRefusesANormReportFromAnotherJob) {
  auto cluster = LocalCluster::Start(SmallJob(2, 1));
  ASSERT_TRUE(cluster.ok());
  auto stub = v1::ShardService::NewStub(
      grpc::CreateChannel((*cluster)->addresses()[0], grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::NormReport report;
  report.set_shard_index(1);
  report.set_job_fingerprint(JobFingerprint(SmallJob(2, 1, /*seed=*/99)));
  v1::NormAgreement agreement;
  grpc::Status s = stub->AgreeNorm(&ctx, report, &agreement);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find("different job"), std::string::npos) << s.error_message();
}

// A route plan from a topology decides the data path of each link.
TEST(ClientTest, RoutePlanChoosesTheTransportOfEachLink) {
  auto cluster = LocalCluster::Start(SmallJob(2, 1));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::vector<std::string> addresses = (*cluster)->addresses();
  const std::string json = absl::StrCat(R"({"nodes": [{"name": "here", "servers": [")", addresses[0],
                                        R"("], "trainers": [0]}, {"name": "there", "servers": [")", addresses[1],
                                        R"("]}], "links": [{"between": ["here", "there"], "kind": "ethernet",
                                        "transport": "grpc"}]})");
  auto topology = Topology::Parse(json);
  ASSERT_TRUE(topology.ok()) << topology.status();
  auto plan = PlanRoutes(&*topology, 0, addresses, PSHARD_WITH_UCX != 0);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ShardClient::Options options;
  options.server_addresses = addresses;
  options.transport_by_address = plan->TransportByAddress();
  auto client = ShardClient::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ((*client)->transport_name(0), PSHARD_WITH_UCX ? "ucx" : "grpc");
  EXPECT_EQ((*client)->transport_name(1), "grpc");
  // Both paths carry a whole unit.
  auto fetched = (*client)->StartFetch(0, 0);
  ASSERT_TRUE(fetched->Wait().ok());
  std::vector<float> expected((*client)->layout().partitions[0].padded_numel());
  InitializeUnitRange((*client)->layout().spec.units[0], 1, 0, expected);
  EXPECT_EQ(fetched->values(), expected);
}

}  // namespace
}  // namespace pshard::testing
