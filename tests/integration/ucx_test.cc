// The UCX data path next to gRPC: trainers on either (and a host fabric
// group) reduce to the same bits; each UCX_TLS a user may set (shared memory,
// tcp) carries a job over exactly the transports it names; a dead server
// over shared memory is noticed through its gRPC channel; a client whose UCX
// cannot start falls back to gRPC; a UCX peer that did not join is refused
// and changes nothing.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/ucx/ucx_endpoint.h"
#include "common/ucx/ucx_wire.h"
#include "common/ucx/ucx_worker.h"
#include "gtest/gtest.h"
#include "grpcpp/grpcpp.h"
#include "proto/rpc_util.h"
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

// A UCX link to shard 0 for `token`, made by hand (not by ShardClient).
UcxTransport::Spec Shard0Spec(LocalCluster& cluster, UcxContext* context, uint64_t token,
                              absl::Duration rpc_timeout) {
  UcxTransport::Spec spec;
  spec.context = context;
  spec.address = cluster.addresses()[0];
  spec.ucx_address = cluster.server(0).ucx_address();
  spec.session_token = token;
  spec.rpc_timeout = rpc_timeout;
  return spec;
}

// The session token shard 0 gives `rank` at Join.
uint64_t JoinShard0(const LocalCluster& cluster, int rank) {
  auto stub = v1::ShardService::NewStub(grpc::CreateChannel(cluster.addresses()[0], grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::JoinRequest request;
  request.set_trainer_rank(rank);
  v1::JoinResponse response;
  EXPECT_TRUE(stub->Join(&ctx, request, &response).ok());
  return response.session_token();
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
  // 0x5eed: never issued, this peer did not join.
  auto intruder = UcxTransport::Create(Shard0Spec(**cluster, context->get(), 0x5eed, absl::Seconds(10)));
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
  auto context = UcxContext::Create();
  ASSERT_TRUE(context.ok()) << context.status();
  auto refused = [&] {
    absl::StatusOr<MetricsText> page = ParseMetricsText((*cluster)->server(0).registry().Serialize());
    EXPECT_TRUE(page.ok());
    return SampleValue(*page, "pshard_server_refused_calls_total", {{"method", "Push"}, {"reason", "unknown_session"}})
        .value_or(-1);
  };
  for (auto [rank, who] : {std::pair{-1, "a reader"}, std::pair{1, "trainer 1"}}) {
    auto peer = UcxTransport::Create(Shard0Spec(**cluster, context->get(), JoinShard0(**cluster, rank), absl::Seconds(10)));
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

// UCX reads UCX_TLS when a context is created (the servers' at Start, the
// trainer's at Connect): set for the scope of a test.
class ScopedUcxTls {
 public:
  explicit ScopedUcxTls(const std::string& tls) { EXPECT_EQ(setenv("UCX_TLS", tls.c_str(), 1), 0); }
  ~ScopedUcxTls() { unsetenv("UCX_TLS"); }
};

struct TlsCase {
  std::string tls;
  std::vector<std::string> lanes;  // each must carry the links
  bool shared_memory = false;
};

void PrintTo(const TlsCase& c, std::ostream* os) { *os << "UCX_TLS=" << c.tls; }

class UcxTlsTest : public ::testing::TestWithParam<TlsCase> {};

// A job trains over each UCX_TLS, to the reference's bits, and its links run
// over the transports named, not over another that UCX would fall back to
// (as it did when every endpoint asked for peer failure detection, which
// shared memory lacks: UCX then picked tcp, or nothing when only shared
// memory was allowed).
TEST_P(UcxTlsTest, TrainsOverTheTransportsNamedAndNoOthers) {
  const TlsCase& c = GetParam();
  ScopedUcxTls tls(c.tls);
  const JobConfig job = Job(2, 1);
  auto cluster = LocalCluster::Start(job);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ASSERT_FALSE((*cluster)->server(0).ucx_address().empty()) << "the servers' UCX did not start with UCX_TLS=" << c.tls;
  auto client = (*cluster)->Connect(0, WireEncoding::kFp32, "ucx");
  ASSERT_TRUE(client.ok()) << client.status();
  for (int s = 0; s < 2; ++s) {
    const std::string description = (*client)->transport_description(s);
    for (const std::string& lane : c.lanes) EXPECT_TRUE(absl::StrContains(description, lane)) << description;
    EXPECT_EQ(absl::StrContains(description, "tcp/"), !c.shared_memory) << description;
    EXPECT_EQ(absl::StrContains(description, "/memory"), c.shared_memory) << description;
    // On one host UCX's peer failure mode is off (shared memory lacks it),
    // tcp included: the gRPC channel tells when a server dies.
    EXPECT_TRUE(absl::StrContains(description, "noticed through its gRPC channel")) << description;
  }
  ASSERT_TRUE(Train(client->get(), nullptr, kSteps).ok());
  auto weights = (*cluster)->ReadMasterWeights(kSteps);
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_TRUE(BitIdentical(*weights, Reference(job, WireEncoding::kFp32, kSteps)));
}

INSTANTIATE_TEST_SUITE_P(EveryTransport, UcxTlsTest,
                         ::testing::Values(TlsCase{"sysv,cma", {"sysv/memory", "cma/memory"}, true},
                                           TlsCase{"posix,cma", {"posix/memory", "cma/memory"}, true},
                                           TlsCase{"tcp", {"tcp/"}, false}),
                         [](const ::testing::TestParamInfo<TlsCase>& info) {
                           std::string name = info.param.tls;
                           for (char& ch : name) ch = ch == ',' ? '_' : ch;
                           return name;
                         });

// Over shared memory UCX cannot report a dead peer: the link watches the
// server's gRPC channel instead. Here that channel leads to a stand-in gRPC
// server, shut down while a fetch waits on the real server for a version that
// will not come: the fetch ends at once, naming the lost connection, well
// before its 10-minute deadline; later transfers on the link fail at once.
TEST(UcxTest, ALinkOverSharedMemoryFailsWhenItsGrpcConnectionIsLost) {
  ScopedUcxTls tls("sysv,cma");
  const JobConfig job = Job(1, 1);
  auto cluster = LocalCluster::Start(job);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const UnitPartition& p = (*cluster)->server(0).state().layout().partitions[0];
  int port = 0;
  v1::ShardService::Service unimplemented;  // a server needs a service to start
  grpc::ServerBuilder builder;
  builder.RegisterService(&unimplemented);
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  std::unique_ptr<grpc::Server> stand_in = builder.BuildAndStart();
  ASSERT_NE(stand_in, nullptr);
  auto control = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
  ASSERT_TRUE(control->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10)));

  auto context = UcxContext::Create();
  ASSERT_TRUE(context.ok()) << context.status();
  UcxTransport::Spec spec = Shard0Spec(**cluster, context->get(), JoinShard0(**cluster, 0), absl::Minutes(10));
  spec.control_channel = control;
  auto link = UcxTransport::Create(spec);
  ASSERT_TRUE(link.ok()) << link.status();
  ASSERT_EQ((*link)->ucx_transports(), (std::vector<std::string>{"sysv/memory", "cma/memory"}));

  std::vector<float> dest(p.padded_numel());
  FetchArgs ahead{0, 1, WireEncoding::kFp32, 0, p.Slice(0)};  // version 1: the server waits for it
  absl::Notification done;
  absl::Status fetched;
  (*link)->Fetch(ahead, dest.data(), [&](absl::Status s, int64_t) {
    fetched = std::move(s);
    done.Notify();
  });
  // Still waiting while the channel is up.
  EXPECT_FALSE(done.WaitForNotificationWithTimeout(absl::Milliseconds(500)));
  stand_in->Shutdown(std::chrono::system_clock::now());
  // The server's own wait ends after 60 s (fetch_wait_limit): well before that.
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30))) << "the lost gRPC connection went unnoticed";
  EXPECT_EQ(fetched.code(), absl::StatusCode::kUnavailable) << fetched;
  EXPECT_TRUE(absl::StrContains(fetched.message(), "the gRPC connection to shard 0")) << fetched;
  EXPECT_TRUE(absl::StrContains(fetched.message(), "fetch of unit 0 version 1 from shard 0")) << fetched;

  absl::Notification again;
  absl::Status refetched;
  FetchArgs now{0, 0, WireEncoding::kFp32, 0, p.Slice(0)};
  (*link)->Fetch(now, dest.data(), [&](absl::Status s, int64_t) {
    refetched = std::move(s);
    again.Notify();
  });
  ASSERT_TRUE(again.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(refetched.code(), absl::StatusCode::kUnavailable) << refetched;
  EXPECT_TRUE(absl::StrContains(refetched.message(), "failed earlier")) << refetched;
}

// From a worker made by hand (no hello, no failure mode): connects to shard
// 0, runs `send` with the endpoint on the worker's thread, and returns the
// fetch replies that came, in order, once `expected` have (waiting at most
// 30 s in all).
std::vector<ucx::ReplyHeader> RawExchange(LocalCluster& cluster, const std::function<void(ucp_ep_h)>& send,
                                          size_t expected) {
  absl::Mutex mu;
  std::vector<ucx::ReplyHeader> replies;
  struct Sink {
    absl::Mutex* mu;
    std::vector<ucx::ReplyHeader>* replies;
  } sink{&mu, &replies};
  auto on_reply = [](void* arg, const void* header, size_t header_length, void*, size_t,
                     const ucp_am_recv_param_t*) -> ucs_status_t {
    auto* s = static_cast<Sink*>(arg);
    ucx::ReplyHeader h;
    if (ucx::ReadHeader(header, header_length, &h)) {
      absl::MutexLock lock(s->mu);
      s->replies->push_back(h);
    }
    return UCS_OK;  // rendezvous data not asked for is dropped
  };
  auto worker = ucx::UcxWorker::Create({{ucx::kFetchReply, on_reply, &sink}});
  EXPECT_TRUE(worker.ok()) << worker.status();
  if (!worker.ok()) return {};
  const std::string server = cluster.server(0).ucx_address();
  ucp_ep_h ep = nullptr;
  absl::Status connected;
  absl::Notification sent;
  (*worker)->Post([&] {
    absl::StatusOr<ucx::Endpoint> endpoint =
        ucx::Connect((*worker)->worker(), server.data(), ucx::PeerFailure::kOwner, nullptr, nullptr);
    connected = endpoint.status();
    if (endpoint.ok()) {
      ep = endpoint->ep;
      send(ep);
    }
    sent.Notify();
  });
  sent.WaitForNotification();
  EXPECT_TRUE(connected.ok()) << connected;
  {
    absl::MutexLock lock(&mu);
    auto answered = [&] { return replies.size() >= expected; };
    EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&answered), absl::Seconds(30)))
        << "the server stopped answering: " << replies.size() << " of " << expected << " fetches answered";
  }
  (*worker)->Stop([&] {
    if (ep != nullptr) ucx::CloseNow((*worker)->worker(), ep);
  });
  absl::MutexLock lock(&mu);
  return replies;
}

// Sends `requests` to shard 0 (RawExchange) and returns the server's replies.
std::vector<ucx::ReplyHeader> RawFetches(LocalCluster& cluster, const std::vector<ucx::FetchHeader>& requests) {
  return RawExchange(
      cluster,
      [&](ucp_ep_h ep) {
        for (const ucx::FetchHeader& h : requests) {
          ucx::SendAm(ep, ucx::kFetchRequest, &h, sizeof(h), nullptr, 0, /*reply=*/true, [](ucs_status_t) {});
        }
      },
      requests.size());
}

// fuzz/ucx_fuzzer's first finding: a rendezvous message (here 64 KiB) for an
// active-message id the server registers no handler for (a reply's, which
// only trainers handle) made UCX 1.13 call through the handler table's
// entry for that id, which UCX leaves uninitialised: under the fuzz build's
// allocator it held garbage and the server crashed; here the entry happens
// to be zero, so this test passes without the fix too (the fuzz smoke
// replays the crashing input, corpus/ucx/crash_unhandled_id_rendezvous).
// What it holds either way: the message is dropped, and the server answers
// the fetch sent after it and trains on.
TEST(UcxTest, AMessageForNoHandlerIsDroppedAndTheServerServesOn) {
  const JobConfig job = Job(1, 1);
  auto cluster = LocalCluster::Start(job);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::vector<char> large(64 << 10, 'x');
  ucx::FetchHeader token;
  token.request_id = 7;
  token.version = -1;  // refused at once: an answer to wait for
  const std::vector<ucx::ReplyHeader> replies = RawExchange(
      **cluster,
      [&](ucp_ep_h ep) {
        static const char kHeader[64] = {};
        ucx::SendAm(ep, ucx::kFetchReply, kHeader, sizeof(kHeader), large.data(), large.size(), /*reply=*/true,
                    [](ucs_status_t) {});
        ucx::SendAm(ep, ucx::kFetchRequest, &token, sizeof(token), nullptr, 0, /*reply=*/true, [](ucs_status_t) {});
      },
      1);
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].request_id, 7u);
  EXPECT_EQ(replies[0].status_code, static_cast<int32_t>(absl::StatusCode::kUnauthenticated));  // token 0 never joined
  // And the server still trains a job.
  auto client = (*cluster)->Connect(0, WireEncoding::kFp32, "ucx");
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE(Train(client->get(), nullptr, kSteps).ok());
}

// A slice of several pieces (fp32) lands whole: the bytes are the server's
// master bytes, each piece verified and their checksums joined. A piece
// outside the slice, or of another encoding, is refused with the reason.
TEST(UcxTest, ALargeSliceIsFetchedInPiecesAndArrivesWhole) {
  JobConfig job;
  job.model = MakeGptSpec(GptConfig{.num_layers = 1, .d_model = 512, .num_heads = 4, .context = 16, .vocab = 256})
                  .value();
  job.num_shards = 1;
  auto cluster = LocalCluster::Start(job);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const JobLayout& layout = (*cluster)->server(0).state().layout();
  int unit = 0;
  for (int u = 0; u < static_cast<int>(layout.partitions.size()); ++u) {
    if (layout.partitions[u].padded_numel() > layout.partitions[unit].padded_numel()) unit = u;
  }
  const UnitPartition& p = layout.partitions[unit];
  const int64_t slice_bytes = p.Slice(0).length * static_cast<int64_t>(sizeof(float));
  ASSERT_GE(slice_bytes, 3 * UcxTransport::kFetchPieceBytes) << "the slice must come in 3 pieces or more";
  auto master = (*cluster)->ReadMasterWeights();
  ASSERT_TRUE(master.ok()) << master.status();

  const uint64_t token = JoinShard0(**cluster, 0);
  auto context = UcxContext::Create();
  ASSERT_TRUE(context.ok()) << context.status();
  auto link = UcxTransport::Create(Shard0Spec(**cluster, context->get(), token, absl::Seconds(30)));
  ASSERT_TRUE(link.ok()) << link.status();
  for (int repeat = 0; repeat < 3; ++repeat) {
    std::vector<float> dest(p.padded_numel(), std::nanf(""));
    absl::Notification done;
    absl::Status fetched;
    int64_t wire_bytes = 0;
    (*link)->Fetch(FetchArgs{unit, 0, WireEncoding::kFp32, 0, p.Slice(0)}, dest.data(),
                   [&](absl::Status s, int64_t bytes) {
                     fetched = std::move(s);
                     wire_bytes = bytes;
                     done.Notify();
                   });
    done.WaitForNotification();
    ASSERT_TRUE(fetched.ok()) << fetched;
    EXPECT_GE(wire_bytes, slice_bytes);
    const std::vector<float>& want = (*master)[unit];
    ASSERT_GE(want.size(), static_cast<size_t>(p.Slice(0).length));
    EXPECT_EQ(std::memcmp(dest.data(), want.data(), slice_bytes), 0) << "repeat " << repeat;
  }

  // Another session (a reader's): the server answers each session at the
  // endpoint its hello named, and this one says none.
  const uint64_t reader = JoinShard0(**cluster, -1);
  auto header = [&](int64_t offset, int64_t length, WireEncoding encoding) {
    ucx::FetchHeader h;
    h.token = reader;
    h.request_id = static_cast<uint64_t>(100 + offset + length);
    h.version = 0;
    h.wait_ms = 10000;
    h.unit = unit;
    h.encoding = static_cast<int32_t>(EncodingToProto(encoding));
    h.byte_offset = offset;
    h.byte_length = length;
    return h;
  };
  const std::vector<ucx::ReplyHeader> replies = RawFetches(
      **cluster, {header(slice_bytes - 8, 16, WireEncoding::kFp32), header(-4, 8, WireEncoding::kFp32),
                  header(0, 8, WireEncoding::kBf16), header(slice_bytes - 8, 8, WireEncoding::kFp32)});
  ASSERT_EQ(replies.size(), 4u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(replies[i].status_code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument)) << i;
  }
  EXPECT_NE(replies[0].Message().find("is not within the slice's"), std::string::npos) << replies[0].Message();
  EXPECT_NE(replies[2].Message().find("fp32 only"), std::string::npos) << replies[2].Message();
  EXPECT_EQ(replies[3].status_code, 0) << replies[3].Message();  // the last 8 bytes, in range
}

}  // namespace
}  // namespace pshard::testing
