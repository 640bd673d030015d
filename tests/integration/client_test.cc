// Joining a job: health, consistency checks between servers, clear errors.
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "grpcpp/grpcpp.h"
#include "proto/health.grpc.pb.h"
#include "proto/rpc_util.h"
#include "absl/strings/str_cat.h"
#include "proto/shard.grpc.pb.h"
#include "pshard/config.h"
#include "trainer_client/route_plan.h"
#include "tests/testutil/local_cluster.h"
#include "tests/testutil/tiny_job.h"
#include "tools/cluster_status.h"
#include "trainer_client/trainer.h"
#include "trainer_client/model/gpt_spec.h"

namespace pshard::testing {
namespace {

JobConfig SmallJob(int shards, int trainers, uint64_t seed = 1) {
  JobConfig job;
  job.model = MakeGptSpec(GptConfig{.num_layers = 1, .d_model = 16, .num_heads = 2, .context = 8, .vocab = 64}).value();
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

// One layer of width 640 on one shard: the block's slice is 20 MB, five
// times the message limit.
JobConfig WideJob(int trainers) {
  JobConfig job;
  job.model = MakeGptSpec(GptConfig{.num_layers = 1, .d_model = 640, .num_heads = 4, .context = 8, .vocab = 256}).value();
  job.num_shards = 1;
  job.num_trainers = trainers;
  return job;
}

// A master slice of 20 MB (one layer of width 640 on one shard) is five
// times the message limit: it is read in pages, and every byte arrives.
TEST(ClientTest, ReadsMasterSlicesLargerThanAMessage) {
  auto cluster = LocalCluster::Start(WideJob(1));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const ShardState& state = (*cluster)->server(0).state();
  int64_t largest = 0;
  for (int u = 0; u < state.num_units(); ++u) largest = std::max(largest, state.slice_length(u));
  ASSERT_GT(largest * 4, 4 * (4 << 20));
  auto weights = (*cluster)->ReadMasterWeights();
  ASSERT_TRUE(weights.ok()) << weights.status();
  ASSERT_EQ(static_cast<int>(weights->size()), state.num_units());
  for (int u = 0; u < state.num_units(); ++u) {
    std::vector<float> master = state.ReadMaster(u).second;
    master.resize((*weights)[u].size());  // without the padding
    EXPECT_TRUE(master == (*weights)[u]) << "unit " << u;
  }
  // A page past the slice is refused, naming the slice's length.
  auto stub = v1::ShardService::NewStub(grpc::CreateChannel((*cluster)->addresses()[0],
                                                            grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::ReadMasterRequest request;
  request.set_unit(1);
  request.set_offset(state.slice_length(1) + 1);
  v1::ReadMasterResponse response;
  const grpc::Status refused = stub->ReadMaster(&ctx, request, &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_NE(refused.error_message().find(absl::StrCat("has ", state.slice_length(1))), std::string::npos)
      << refused.error_message();
}

// Resident memory of this process, in bytes.
int64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

// A trainer's gradient buffers are reused: once a push has gone, its
// buffer is the next one lent for that unit, all zeros again.
TEST(ClientTest, APushedGradientBufferIsLentAgainAsZeros) {
  auto cluster = LocalCluster::Start(SmallJob(2, 1));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto client = ConnectTo((*cluster)->addresses(), 0);
  ASSERT_TRUE(client.ok()) << client.status();
  const int unit = 1;
  std::vector<float> grads = (*client)->GradientBuffer(unit);
  ASSERT_EQ(static_cast<int64_t>(grads.size()), (*client)->layout().partitions[unit].padded_numel());
  EXPECT_TRUE(std::all_of(grads.begin(), grads.end(), [](float g) { return g == 0.0f; }));
  std::fill(grads.begin(), grads.end(), 0.5f);
  const float* pushed = grads.data();
  ASSERT_TRUE((*client)->StartPush(unit, 0, std::move(grads))->Wait().ok());
  // The transports let go of it a moment after the push is acknowledged.
  std::vector<float> again;
  for (const absl::Time deadline = absl::Now() + absl::Seconds(10); absl::Now() < deadline;) {
    again = (*client)->GradientBuffer(unit);
    if (again.data() == pushed) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(again.data(), pushed) << "the pushed buffer was not lent again within 10 s";
  EXPECT_TRUE(std::all_of(again.begin(), again.end(), [](float g) { return g == 0.0f; }))
      << "a lent buffer still holds the last gradient";
}

// A push's room grows as its data arrives: eight pushes of a 20 MB slice
// that stop after a 4 KiB first chunk hold kilobytes, not the 160 MB that
// allocating each whole slice at its first chunk would pin.
TEST(ClientTest, AnAbandonedPushHoldsOnlyWhatArrived) {
  auto cluster = LocalCluster::Start(WideJob(8));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const ShardState& state = (*cluster)->server(0).state();
  const int unit = 1;  // the block
  const int64_t slice = state.slice_length(unit);
  ASSERT_GT(slice * 4, 16 << 20);
  auto stub = v1::ShardService::NewStub(grpc::CreateChannel((*cluster)->addresses()[0],
                                                            grpc::InsecureChannelCredentials()));
  const int64_t before = ResidentBytes();
  struct OpenPush {
    grpc::ClientContext ctx;
    v1::PushResponse response;
    std::unique_ptr<grpc::ClientWriter<v1::PushChunk>> writer;
  };
  std::vector<std::unique_ptr<OpenPush>> pushes;
  for (int i = 0; i < 8; ++i) {
    auto push = std::make_unique<OpenPush>();
    push->writer = stub->Push(&push->ctx, &push->response);
    v1::PushChunk chunk;
    chunk.set_unit(unit);
    chunk.set_step(0);
    chunk.set_trainer_rank(i);  // distinct contributions
    chunk.set_encoding(v1::ENCODING_FP32);
    chunk.set_slice_length(slice);
    chunk.set_data(std::string(4096, '\0'));
    ASSERT_TRUE(push->writer->Write(chunk));
    pushes.push_back(std::move(push));
  }
  // Until the server has staged every first chunk (it counts a chunk's bytes
  // once staged).
  auto staged = [&] {
    absl::StatusOr<MetricsText> page = ParseMetricsText((*cluster)->server(0).registry().Serialize());
    if (!page.ok()) return -1;
    int pushes_staged = 0;
    for (int i = 0; i < 8; ++i) {
      absl::StatusOr<double> bytes = SampleValue(
          *page, "pshard_server_transfer_bytes_total",
          {{"rank", absl::StrCat(i)}, {"direction", "push"}, {"transport", "grpc"}});
      pushes_staged += bytes.ok() && *bytes >= 4096 ? 1 : 0;
    }
    return pushes_staged;
  };
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (staged() < 8 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(staged(), 8) << "the server did not stage the 8 first chunks within 30 s";
  const int64_t grown = ResidentBytes() - before;
  EXPECT_LT(grown, 32 << 20) << "open pushes grew this process by " << grown << " bytes";
  // Each push was still open (staged, not refused) until cancelled here.
  for (auto& p : pushes) p->ctx.TryCancel();
  for (auto& p : pushes) EXPECT_EQ(p->writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(state.current_step(), 0);
}

// A step held up by a trainer is reported: the servers count, per rank, how
// long a slow step (over 1 s) waited for it, and less for the others.
TEST(ClientTest, ServersCountHowLongAStepWaitedForEachMissingTrainer) {
  const JobConfig job = TinyGptJob(2, 2, 3);
  auto cluster = LocalCluster::Start(job);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<absl::Status> results(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      absl::StatusOr<std::unique_ptr<ShardClient>> client = (*cluster)->Connect(rank, WireEncoding::kFp32);
      if (!client.ok()) {
        results[rank] = client.status();
        return;
      }
      absl::StatusOr<std::unique_ptr<Trainer>> trainer =
          Trainer::Create(client->get(), &TestCorpus(), TinyTrainerOptions(5));
      if (!trainer.ok()) {
        results[rank] = trainer.status();
        return;
      }
      if (rank == 1) absl::SleepFor(absl::Milliseconds(1500));  // late to step 0
      results[rank] = (*trainer)->RunStep(0).status();
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_TRUE(results[0].ok()) << results[0];
  ASSERT_TRUE(results[1].ok()) << results[1];
  for (int shard = 0; shard < 2; ++shard) {
    absl::StatusOr<MetricsText> page = ParseMetricsText((*cluster)->server(shard).registry().Serialize());
    ASSERT_TRUE(page.ok()) << page.status();
    const std::string name = "pshard_server_missing_trainer_seconds_total";
    const double late = SampleValue(*page, name, {{"rank", "1"}}).value_or(-1);
    const double prompt = SampleValue(*page, name, {{"rank", "0"}}).value_or(-1);
    EXPECT_GE(late, 1.0) << "shard " << shard;
    EXPECT_GE(prompt, 0.0) << "shard " << shard;
    EXPECT_LT(prompt, late) << "shard " << shard;
  }
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
