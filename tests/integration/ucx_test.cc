// The UCX data path next to gRPC: trainers on either (and a host fabric
// group) reduce to the same bits; a client whose UCX cannot start falls back
// to gRPC; a UCX peer that did not join is refused and changes nothing.
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "grpcpp/grpcpp.h"
#include "proto/shard.grpc.pb.h"
#include "tools/cluster_status.h"
#include "tests/testutil/cluster_training.h"
#include "tests/testutil/local_cluster.h"
#include "tests/testutil/tiny_job.h"
#include "tests/testutil/reference_training.h"
#include "trainer_client/group/host/host_group.h"
#include "trainer_client/data/default_corpus.h"
#include "trainer_client/group/group_collective.h"
#include "trainer_client/trainer.h"
#include "trainer_client/transport/ucx/ucx_transport.h"

namespace pshard::testing {
namespace {

constexpr int kSteps = 3;

JobConfig Job(int shards, int trainers) { return TinyGptJob(shards, trainers, kSteps); }

TrainerOptions Tiny() { return TinyTrainerOptions(5); }


std::vector<std::vector<float>> Reference(const JobConfig& job, WireEncoding encoding, int steps) {
  auto weights = TrainReference(job, encoding, Tiny(), TestCorpus(), steps);
  EXPECT_TRUE(weights.ok()) << weights.status();
  return weights.ok() ? *weights : std::vector<std::vector<float>>();
}

absl::Status Train(ShardClient* client, GroupCollective* group, int steps) {
  TrainerOptions options = Tiny();
  options.group = group;
  absl::StatusOr<std::unique_ptr<Trainer>> trainer = Trainer::Create(client, &TestCorpus(), options);
  if (!trainer.ok()) return trainer.status();
  for (int64_t step = 0; step < steps; ++step) {
    absl::StatusOr<StepReport> report = (*trainer)->RunStep(step);
    if (!report.ok()) return report.status();
  }
  return absl::OkStatus();
}

// Rank 0 over gRPC, rank 1 over UCX, ranks 2 and 3 over UCX and gRPC and,
// with fp32 on the wire, a host fabric group (groups reduce in fp32, so
// bf16 parity is not defined for them; see accumulation_group_test).
TEST(UcxTest, MixedTransportsAndHostGroupKeepParity) {
  for (WireEncoding encoding : {WireEncoding::kFp32, WireEncoding::kBf16}) {
    const JobConfig job = Job(3, 4);
    auto cluster = LocalCluster::Start(job);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    const std::vector<std::string> transports = {"grpc", "ucx", "ucx", "grpc"};
    std::vector<std::unique_ptr<GroupCollective>> group = CreateHostGroup(2);
    std::vector<absl::Status> results(4);
    std::vector<std::thread> threads;
    for (int r = 0; r < 4; ++r) {
      threads.emplace_back([&, r] {
        auto client = (*cluster)->Connect(r, encoding, transports[r]);
        if (!client.ok()) {
          results[r] = client.status();
          return;
        }
        for (int s = 0; s < 3; ++s) EXPECT_EQ((*client)->transport_name(s), transports[r]) << "rank " << r;
        const bool grouped = r >= 2 && encoding == WireEncoding::kFp32;
        results[r] = Train(client->get(), grouped ? group[r - 2].get() : nullptr, kSteps);
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < 4; ++r) ASSERT_TRUE(results[r].ok()) << "trainer " << r << ": " << results[r];
    auto weights = (*cluster)->ReadMasterWeights(kSteps);
    ASSERT_TRUE(weights.ok()) << weights.status();
    EXPECT_TRUE(BitIdentical(*weights, Reference(job, encoding, kSteps))) << WireEncodingName(encoding);
  }
}

TEST(UcxTest, AutoFallsBackToGrpcWhenUcxCannotStart) {
  const JobConfig job = Job(2, 1);
  auto cluster = LocalCluster::Start(job);  // the servers' UCX starts normally
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ASSERT_FALSE((*cluster)->server(0).ucx_address().empty());
  // UCX reads UCX_TLS when a context is created: the client's will fail.
  ASSERT_EQ(setenv("UCX_TLS", "bogus", 1), 0);
  ::testing::internal::CaptureStderr();
  auto client = (*cluster)->Connect(0, WireEncoding::kFp32, "auto");
  const std::string err = ::testing::internal::GetCapturedStderr();
  auto strict = (*cluster)->Connect(0, WireEncoding::kFp32, "ucx");
  unsetenv("UCX_TLS");
  ASSERT_TRUE(client.ok()) << client.status();
  for (int s = 0; s < 2; ++s) EXPECT_EQ((*client)->transport_name(s), "grpc");
  size_t warnings = 0;
  for (size_t at = err.find("pshard-trainer: warning"); at != std::string::npos;
       at = err.find("pshard-trainer: warning", at + 1)) {
    ++warnings;
  }
  EXPECT_EQ(warnings, 1u) << err;
  EXPECT_NE(err.find("UCX cannot start"), std::string::npos) << err;
  EXPECT_FALSE(strict.ok());  // asked for UCX explicitly: an error, not a fallback
  ASSERT_TRUE(Train(client->get(), nullptr, kSteps).ok());
  auto weights = (*cluster)->ReadMasterWeights(kSteps);
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_TRUE(BitIdentical(*weights, Reference(job, WireEncoding::kFp32, kSteps)));
}

TEST(UcxTest, PeerThatDidNotJoinIsRefusedAndChangesNothing) {
  const JobConfig job = Job(1, 1);
  auto cluster = LocalCluster::Start(job);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto before = (*cluster)->ReadMasterWeights();
  ASSERT_TRUE(before.ok()) << before.status();
  const UnitPartition& p = (*cluster)->server(0).state().layout().partitions[0];

  auto context = UcxContext::Create();
  ASSERT_TRUE(context.ok()) << context.status();
  UcxTransport::Spec spec;
  spec.context = context->get();
  spec.address = (*cluster)->addresses()[0];
  spec.ucx_address = (*cluster)->server(0).ucx_address();
  spec.session_token = 0x5eed;  // never issued: this peer did not join
  spec.rpc_timeout = absl::Seconds(10);
  auto intruder = UcxTransport::Create(spec);
  ASSERT_TRUE(intruder.ok()) << intruder.status();

  auto wait = [](auto start) {
    absl::Notification done;
    absl::Status result;
    start([&](absl::Status s, int64_t) {
      result = std::move(s);
      done.Notify();
    });
    done.WaitForNotification();
    return result;
  };
  auto grads = std::make_shared<const std::vector<float>>(p.padded_numel(), 1.0f);
  PushArgs push{0, 0, WireEncoding::kFp32, 0, 1, 0, p.Slice(0)};
  absl::Status pushed = wait([&](TransferDone done) { (*intruder)->Push(push, grads, std::move(done)); });
  EXPECT_EQ(pushed.code(), absl::StatusCode::kUnauthenticated) << pushed;
  EXPECT_NE(pushed.message().find("unknown session token"), std::string::npos) << pushed;
  EXPECT_NE(pushed.message().find("push of unit 0 step 0 to shard 0"), std::string::npos) << pushed;
  std::vector<float> dest(p.padded_numel());
  FetchArgs fetch{0, 0, WireEncoding::kFp32, 0, p.Slice(0)};
  absl::Status fetched = wait([&](TransferDone done) { (*intruder)->Fetch(fetch, dest.data(), std::move(done)); });
  EXPECT_EQ(fetched.code(), absl::StatusCode::kUnauthenticated) << fetched;

  // Nothing changed, and the server still serves those who joined.
  EXPECT_EQ((*cluster)->server(0).state().current_step(), 0);
  auto after = (*cluster)->ReadMasterWeights();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(BitIdentical(*after, *before));
  auto client = (*cluster)->Connect(0, WireEncoding::kFp32, "ucx");
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE(Train(client->get(), nullptr, kSteps).ok());
  auto trained = (*cluster)->ReadMasterWeights(kSteps);
  ASSERT_TRUE(trained.ok()) << trained.status();
  EXPECT_TRUE(BitIdentical(*trained, Reference(job, WireEncoding::kFp32, kSteps)));
}

// A session token is the rank's that joined for it: a reader's token, or
// another trainer's, does not push as trainer 0 over UCX. Each refusal is
// counted, and nothing changes.
TEST(UcxTest, ASessionPushesOnlyForTheRankThatJoined) {
  const JobConfig job = Job(1, 2);
  auto cluster = LocalCluster::Start(job);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const UnitPartition& p = (*cluster)->server(0).state().layout().partitions[0];
  auto stub = v1::ShardService::NewStub(
      grpc::CreateChannel((*cluster)->addresses()[0], grpc::InsecureChannelCredentials()));
  auto join = [&](int rank) {
    grpc::ClientContext ctx;
    v1::JoinRequest request;
    request.set_trainer_rank(rank);
    v1::JoinResponse response;
    EXPECT_TRUE(stub->Join(&ctx, request, &response).ok());
    return response.session_token();
  };
  auto context = UcxContext::Create();
  ASSERT_TRUE(context.ok()) << context.status();
  auto refused = [&] {
    absl::StatusOr<MetricsText> page = ParseMetricsText((*cluster)->server(0).registry().Serialize());
    EXPECT_TRUE(page.ok());
    return SampleValue(*page, "pshard_server_refused_calls_total", {{"method", "Push"}, {"reason", "unknown_session"}})
        .value_or(-1);
  };
  for (auto [rank, who] : {std::pair{-1, "a reader"}, std::pair{1, "trainer 1"}}) {
    UcxTransport::Spec spec;
    spec.context = context->get();
    spec.address = (*cluster)->addresses()[0];
    spec.ucx_address = (*cluster)->server(0).ucx_address();
    spec.session_token = join(rank);
    spec.rpc_timeout = absl::Seconds(10);
    auto peer = UcxTransport::Create(spec);
    ASSERT_TRUE(peer.ok()) << peer.status();
    const double before = refused();
    auto grads = std::make_shared<const std::vector<float>>(p.padded_numel(), 1.0f);
    PushArgs push{0, 0, WireEncoding::kFp32, 0, 1, 0, p.Slice(0)};
    absl::Notification done;
    absl::Status pushed;
    (*peer)->Push(push, grads, [&](absl::Status s, int64_t) {
      pushed = std::move(s);
      done.Notify();
    });
    done.WaitForNotification();
    EXPECT_EQ(pushed.code(), absl::StatusCode::kPermissionDenied) << pushed;
    EXPECT_NE(pushed.message().find(absl::StrCat("this UCX session was given to ", who)), std::string::npos)
        << pushed;
    EXPECT_EQ(refused(), before + 1);
  }
  // Nothing was taken for trainer 0: the real trainers train to the
  // reference's bits.
  EXPECT_EQ((*cluster)->server(0).state().current_step(), 0);
  ClusterTraining how;
  how.encoding = WireEncoding::kFp32;
  how.transport = "ucx";
  how.trainer = Tiny();
  how.steps = kSteps;
  ASSERT_TRUE(TrainInThreads(**cluster, 2, TestCorpus(), how).ok());
  auto trained = (*cluster)->ReadMasterWeights(kSteps);
  ASSERT_TRUE(trained.ok()) << trained.status();
  EXPECT_TRUE(BitIdentical(*trained, Reference(job, WireEncoding::kFp32, kSteps)));
}

}  // namespace
}  // namespace pshard::testing
