// Strangers: against real TLS and token-checking shard servers, every RPC
// is refused to a caller without a certificate, with one from another CA,
// with a role the call is not for, or with a wrong token; each refusal is
// counted by method and reason and changes nothing; then the right
// credentials train to the same bits as a plaintext job. Certificates come
// from tools/make-certs.sh, as users make them.
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "pshard/config.h"
#include "common/security/caller_authenticator.h"
#include "common/status_macros.h"
#include "common/security/security.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "common/square_sum.h"
#include "proto/rpc_util.h"
#include "grpcpp/grpcpp.h"
#include "proto/shard.grpc.pb.h"
#include "shard_server/checkpoint.h"
#include "shard_server/server_metrics.h"
#include "shard_server/session_tokens.h"
#include "tests/testutil/local_cluster.h"
#include "tests/testutil/reference_training.h"
#include "tests/testutil/tiny_job.h"
#include "tools/cluster_status.h"
#include "trainer_client/trainer.h"

namespace pshard::testing {
namespace {

constexpr int kSteps = 3;

// A CA with its three role certificates ("good"), another CA with its own
// ("other"), the job's token file and a file of other tokens.
struct Credentials {
  std::string dir;
  std::string good, other, tokens, wrong_tokens;
};

void WriteTokens(const std::string& path, const std::string& seed) {
  std::ofstream(path) << "server " << seed << "-server-0123456789\n"
                      << "trainer " << seed << "-trainer-0123456789\n"
                      << "reader " << seed << "-reader-0123456789\n";
}

const Credentials& Made() {
  static const Credentials* made = [] {
    auto* c = new Credentials();
    c->dir = absl::StrCat(::testing::TempDir(), "/pshard-security-", getpid());
    c->good = c->dir + "/good";
    c->other = c->dir + "/other";
    for (const std::string& d : {c->good, c->other}) {
      const std::string command = absl::StrCat(PSHARD_SOURCE_DIR, "/tools/make-certs.sh ", d, " > /dev/null");
      EXPECT_EQ(std::system(command.c_str()), 0) << command;
    }
    c->tokens = c->dir + "/tokens";
    c->wrong_tokens = c->dir + "/wrong-tokens";
    WriteTokens(c->tokens, "job");
    WriteTokens(c->wrong_tokens, "stranger");
    return c;
  }();
  return *made;
}

enum class Mode { kTls, kTokens, kTlsAndTokens };
std::string ModeName(Mode m) { return m == Mode::kTls ? "Tls" : m == Mode::kTokens ? "Tokens" : "TlsAndTokens"; }
bool UsesTls(Mode m) { return m != Mode::kTokens; }
bool UsesTokens(Mode m) { return m != Mode::kTls; }

// A role's own credentials in this mode.
SecurityOptions Own(Mode mode, Role role) {
  const Credentials& c = Made();
  SecurityOptions o;
  if (UsesTls(mode)) {
    o.tls_cert = absl::StrCat(c.good, "/", RoleName(role), "/tls.crt");
    o.tls_key = absl::StrCat(c.good, "/", RoleName(role), "/tls.key");
    o.tls_ca = c.good + "/ca.pem";
  }
  if (UsesTokens(mode)) o.auth_token_file = c.tokens;
  return o;
}

// One kind of bad caller: its credentials, the role it claims, and the
// reason the server must count.
struct Stranger {
  std::string name;
  SecurityOptions options;
  AuthFailure reason;
};

std::vector<Stranger> Strangers(Mode mode) {
  const Credentials& c = Made();
  std::vector<Stranger> out;
  if (UsesTls(mode)) {
    SecurityOptions none = Own(mode, Role::kTrainer);
    none.tls_cert.clear();
    none.tls_key.clear();
    out.push_back({"no certificate", none, AuthFailure::kNoCredentials});
    SecurityOptions foreign = Own(mode, Role::kTrainer);
    foreign.tls_cert = c.other + "/trainer/tls.crt";
    foreign.tls_key = c.other + "/trainer/tls.key";
    out.push_back({"a certificate of another CA", foreign, AuthFailure::kUntrustedCertificate});
  }
  if (UsesTokens(mode)) {
    SecurityOptions wrong = Own(mode, Role::kTrainer);
    wrong.auth_token_file = c.wrong_tokens;
    out.push_back({"a wrong token", wrong, AuthFailure::kWrongToken});
  }
  if (mode == Mode::kTokens) {
    // Without TLS a token-less caller is simply one without credentials.
    SecurityOptions none = Own(mode, Role::kTrainer);
    none.auth_token_file.clear();
    out.push_back({"no token", none, AuthFailure::kNoCredentials});
  }
  return out;
}

// The role that may not make each call (GetStatus is every role's).
std::optional<Role> WrongRoleFor(RpcMethod m) {
  switch (m) {
    case RpcMethod::kJoin:
    case RpcMethod::kFetch:
    case RpcMethod::kReadMaster:
      return Role::kServer;
    case RpcMethod::kPush:
    case RpcMethod::kRendezvous:
    case RpcMethod::kRollBack:
      return Role::kReader;
    case RpcMethod::kAgreeNorm:
    case RpcMethod::kAnnounce:
      return Role::kTrainer;
    case RpcMethod::kGetStatus:
      return std::nullopt;
  }
  return std::nullopt;
}

constexpr RpcMethod kMethods[] = {RpcMethod::kJoin,      RpcMethod::kFetch,      RpcMethod::kPush,
                                  RpcMethod::kAgreeNorm, RpcMethod::kGetStatus,  RpcMethod::kReadMaster,
                                  RpcMethod::kRendezvous, RpcMethod::kAnnounce,   RpcMethod::kRollBack};

// Makes one well-formed call of `method` to shard 0 that, if accepted, would
// change its state (join as trainer 0, push a gradient, report a norm for
// step 0, take a rendezvous seat, announce shard 1 elsewhere).
grpc::Status Call(v1::ShardService::Stub* stub, RpcMethod method, const ShardState& state) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  switch (method) {
    case RpcMethod::kJoin: {
      v1::JoinRequest request;
      request.set_trainer_rank(0);
      request.set_metrics_address("stranger:1");
      v1::JoinResponse response;
      return stub->Join(&ctx, request, &response);
    }
    case RpcMethod::kFetch: {
      v1::FetchRequest request;
      request.set_unit(0);
      request.set_version(0);
      request.set_encoding(v1::ENCODING_FP32);
      auto reader = stub->Fetch(&ctx, request);
      v1::FetchChunk chunk;
      while (reader->Read(&chunk)) {
      }
      return reader->Finish();
    }
    case RpcMethod::kPush: {
      v1::PushResponse response;
      auto writer = stub->Push(&ctx, &response);
      v1::PushChunk chunk;
      chunk.set_unit(0);
      chunk.set_step(0);
      chunk.set_trainer_rank(0);
      chunk.set_encoding(v1::ENCODING_FP32);
      chunk.set_slice_length(state.slice_length(0));
      chunk.set_data(std::string(static_cast<size_t>(state.slice_length(0)) * 4, '\x01'));
      writer->Write(chunk);
      writer->WritesDone();
      return writer->Finish();
    }
    case RpcMethod::kAgreeNorm: {
      v1::NormReport request;
      request.set_shard_index(1);
      request.set_step(0);
      SquareSum large;
    const float gradient = 1e15f;
    large.AddSquares(std::span<const float>(&gradient, 1));
    request.set_sum_of_squares(large.ToBytes());
      request.set_job_fingerprint(JobFingerprint(state.job()));
      v1::NormAgreement response;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
      return stub->AgreeNorm(&ctx, request, &response);
    }
    case RpcMethod::kGetStatus: {
      v1::StatusResponse response;
      return stub->GetStatus(&ctx, v1::StatusRequest(), &response);
    }
    case RpcMethod::kReadMaster: {
      v1::ReadMasterRequest request;
      request.set_unit(0);
      v1::ReadMasterResponse response;
      return stub->ReadMaster(&ctx, request, &response);
    }
    case RpcMethod::kRendezvous: {
      v1::RendezvousRequest request;
      request.set_group("fabric:0,1");
      request.set_member(0);
      request.set_size(2);
      request.set_payload("stranger");
      v1::RendezvousResponse response;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
      return stub->Rendezvous(&ctx, request, &response);
    }
    case RpcMethod::kAnnounce: {
      v1::AnnounceRequest request;
      request.set_shard_index(1);
      request.set_port(1);
      request.set_advertised_address("stranger:1");
      request.set_job_fingerprint(JobFingerprint(state.job()));
      v1::AnnounceResponse response;
      return stub->Announce(&ctx, request, &response);
    }
    case RpcMethod::kRollBack: {
      v1::RollBackRequest request;
      request.set_step(0);
      request.set_job_fingerprint(JobFingerprint(state.job()));
      v1::RollBackResponse response;
      return stub->RollBack(&ctx, request, &response);
    }
  }
  return grpc::Status(grpc::StatusCode::INTERNAL, "no such method");
}

double Refused(ShardServer& server, RpcMethod method, AuthFailure reason) {
  absl::StatusOr<MetricsText> page = ParseMetricsText(server.registry().Serialize());
  EXPECT_TRUE(page.ok()) << page.status();
  if (!page.ok()) return -1;
  absl::StatusOr<double> v = SampleValue(*page, "pshard_server_refused_calls_total",
                                         {{"method", RpcMethodName(method)}, {"reason", AuthFailureName(reason)}});
  EXPECT_TRUE(v.ok()) << v.status();
  return v.value_or(-1);
}

absl::Status Train(ShardClient* client, int steps) {
  ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(client, &TestCorpus(), TinyTrainerOptions(5)));
  for (int64_t step = 0; step < steps; ++step) RETURN_IF_ERROR(trainer->RunStep(step).status());
  return absl::OkStatus();
}

class SecurityTest : public ::testing::TestWithParam<Mode> {
 protected:
  static LocalCluster::Options Secured(Mode mode) {
    LocalCluster::Options options;
    options.security = Own(mode, Role::kServer);
    for (int r = 0; r < kNumRoles; ++r) options.client_security[r] = Own(mode, static_cast<Role>(r));
    return options;
  }
};

TEST_P(SecurityTest, EveryRpcRefusesStrangersCountsThemAndChangesNothing) {
  const Mode mode = GetParam();
  const JobConfig job = TinyGptJob(2, 1, kSteps);
  auto cluster = LocalCluster::Start(job, Secured(mode));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ShardServer& shard0 = (*cluster)->server(0);
  auto before = (*cluster)->ReadMasterWeights();
  ASSERT_TRUE(before.ok()) << before.status();
  const std::string address = (*cluster)->addresses()[0];

  auto expect_refused = [&](const std::string& who, const SecurityOptions& options, Role role, RpcMethod method,
                            AuthFailure reason) {
    auto security = ClientSecurity::Create(options, role);
    ASSERT_TRUE(security.ok()) << who << ": " << security.status();
    auto stub = v1::ShardService::NewStub((*security)->NewChannel(address));
    const double counted = Refused(shard0, method, reason);
    const grpc::Status s = Call(stub.get(), method, shard0.state());
    EXPECT_TRUE(s.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
                s.error_code() == grpc::StatusCode::PERMISSION_DENIED)
        << RpcMethodName(method) << " by " << who << ": " << s.error_code() << " " << s.error_message();
    EXPECT_NE(s.error_message().find("shard 0: "), std::string::npos) << s.error_message();
    EXPECT_EQ(Refused(shard0, method, reason), counted + 1) << RpcMethodName(method) << " by " << who;
  };

  for (RpcMethod method : kMethods) {
    for (const Stranger& stranger : Strangers(mode)) {
      expect_refused(stranger.name, stranger.options, Role::kTrainer, method, stranger.reason);
    }
    if (std::optional<Role> wrong = WrongRoleFor(method)) {
      expect_refused(absl::StrCat("the ", RoleName(*wrong), " role"), Own(mode, *wrong), *wrong, method,
                     AuthFailure::kWrongRole);
    }
    if (mode == Mode::kTlsAndTokens) {
      // A trainer's certificate with the reader's token.
      expect_refused("a certificate and a token of different roles", Own(mode, Role::kTrainer), Role::kReader,
                     method, AuthFailure::kRoleMismatch);
    }
  }

  // Nothing changed: no step, no trainer joined, no norm or seat taken,
  // shard 1's address as it announced it, the same weights.
  EXPECT_EQ(shard0.state().current_step(), 0);
  auto reader = ClientSecurity::Create(Own(mode, Role::kReader), Role::kReader);
  ASSERT_TRUE(reader.ok()) << reader.status();
  auto stub = v1::ShardService::NewStub((*reader)->NewChannel(address));
  grpc::ClientContext ctx;
  v1::StatusResponse status;
  ASSERT_TRUE(stub->GetStatus(&ctx, v1::StatusRequest(), &status).ok());
  EXPECT_EQ(status.joined_trainers_size(), 0);
  ASSERT_EQ(status.shard_addresses_size(), 2);
  EXPECT_EQ(status.shard_addresses(1), (*cluster)->addresses()[1]);
  auto after = (*cluster)->ReadMasterWeights();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(BitIdentical(*after, *before));

  // The job itself trains (shard 1 agrees norms with shard 0 as a server),
  // to the bits of plaintext training.
  auto client = (*cluster)->Connect(0, WireEncoding::kFp32);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE(Train(client->get(), kSteps).ok());
  auto trained = (*cluster)->ReadMasterWeights(kSteps);
  ASSERT_TRUE(trained.ok()) << trained.status();
  auto plain_cluster = LocalCluster::Start(job);
  ASSERT_TRUE(plain_cluster.ok()) << plain_cluster.status();
  auto plain_client = (*plain_cluster)->Connect(0, WireEncoding::kFp32);
  ASSERT_TRUE(plain_client.ok()) << plain_client.status();
  ASSERT_TRUE(Train(plain_client->get(), kSteps).ok());
  auto plain = (*plain_cluster)->ReadMasterWeights(kSteps);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_TRUE(BitIdentical(*trained, *plain));
}

// A reader (the monitoring role) fetching in more odd int8 block sizes than
// a shard publishes: each fetch is answered, encoded for it alone, and none
// takes a place among the formats the shard publishes, so the trainers'
// own encoding is still there for them.
TEST_P(SecurityTest, AReaderCannotTakeTheTrainersEncodings) {
  const JobConfig job = TinyGptJob(2, 1, kSteps);
  auto cluster = LocalCluster::Start(job, Secured(GetParam()));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto reader = ClientSecurity::Create(Own(GetParam(), Role::kReader), Role::kReader);
  ASSERT_TRUE(reader.ok()) << reader.status();
  for (int shard = 0; shard < 2; ++shard) {
    auto stub = v1::ShardService::NewStub((*reader)->NewChannel((*cluster)->addresses()[shard]));
    for (const int block : {16, 32, 48, 80, 96, 112}) {
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
      v1::FetchRequest request;
      request.set_unit(0);
      request.set_version(0);
      request.set_encoding(v1::ENCODING_INT8);
      request.set_quant_block(block);
      auto stream = stub->Fetch(&ctx, request);
      v1::FetchChunk chunk;
      int64_t bytes = 0;
      while (stream->Read(&chunk)) bytes += static_cast<int64_t>(chunk.data().size());
      const grpc::Status fetched = stream->Finish();
      EXPECT_TRUE(fetched.ok()) << "shard " << shard << ", blocks of " << block << ": " << fetched.error_message();
      EXPECT_GT(bytes, 0) << "shard " << shard << ", blocks of " << block;
    }
  }
  // A trainer with int8 weights of a block size of its own trains (the
  // shards publish it: the readers' six took none of their four places).
  auto client = (*cluster)->Connect(0, WireEncodings(WireEncoding::kInt8, WireEncoding::kFp32, 128));
  ASSERT_TRUE(client.ok()) << client.status();
  const absl::Status trained = Train(client->get(), kSteps);
  EXPECT_TRUE(trained.ok()) << trained;
}

// Joins as a trainer's rank, as many as one likes, with a trainer's own
// credentials, cannot take its live UCX session: once the rank's places are
// full of live sessions they are refused (and counted), and the trainer
// trains on over UCX to the end.
TEST_P(SecurityTest, JoinsAsATrainersRankCannotEvictItsLiveSession) {
  if (!PSHARD_WITH_UCX) GTEST_SKIP() << "built without UCX";
  const JobConfig job = TinyGptJob(1, 1, kSteps);
  auto cluster = LocalCluster::Start(job, Secured(GetParam()));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto victim = (*cluster)->Connect(0, WireEncoding::kFp32, "ucx");
  ASSERT_TRUE(victim.ok()) << victim.status();
  auto trainer = Trainer::Create(victim->get(), &TestCorpus(), TinyTrainerOptions(5));
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  ASSERT_TRUE((*trainer)->RunStep(0).ok());  // its session is in use

  auto thief = ClientSecurity::Create(Own(GetParam(), Role::kTrainer), Role::kTrainer);
  ASSERT_TRUE(thief.ok()) << thief.status();
  auto stub = v1::ShardService::NewStub((*thief)->NewChannel((*cluster)->addresses()[0]));
  int refused = 0;
  for (int i = 0; i < 3 * static_cast<int>(SessionTokens::kPerRank); ++i) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::JoinRequest request;
    request.set_trainer_rank(0);
    v1::JoinResponse response;
    const grpc::Status joined = stub->Join(&ctx, request, &response);
    if (joined.ok()) continue;
    ++refused;
    EXPECT_EQ(joined.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << joined.error_message();
    EXPECT_THAT(joined.error_message(), ::testing::HasSubstr("trainer 0 already holds 8 live sessions"));
  }
  EXPECT_GE(refused, 2 * static_cast<int>(SessionTokens::kPerRank));
  absl::StatusOr<MetricsText> page = ParseMetricsText((*cluster)->server(0).registry().Serialize());
  ASSERT_TRUE(page.ok()) << page.status();
  EXPECT_GE(SampleValue(*page, "pshard_server_rejected_requests_total", {{"reason", "limit"}}).value_or(0),
            refused);

  for (int64_t step = 1; step < kSteps; ++step) {
    const absl::StatusOr<StepReport> report = (*trainer)->RunStep(step);
    ASSERT_TRUE(report.ok()) << "step " << step << ": " << report.status();
  }
}

// RollBack with a trainer's credentials: while no shard restarted (every
// server restored at the same step, or stepping on together), each server
// refuses it, whatever step or servers it names, and counts it; after a
// real restart behind it, the shard ahead goes back once, and once the job
// has stepped on, asking again changes nothing.
TEST_P(SecurityTest, RollBackNeedsARestartedShardAndHappensOncePerRestart) {
  const JobConfig job = TinyGptJob(2, 1, 8);
  const std::string dir = absl::StrCat(::testing::TempDir(), "/pshard-security-rollback-", getpid());
  std::filesystem::remove_all(dir);
  LocalCluster::Options options = Secured(GetParam());
  options.checkpoint_dir = dir;
  options.checkpoint_every = 1;
  {
    auto cluster = LocalCluster::Start(job, options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    auto client = (*cluster)->Connect(0, WireEncoding::kFp32);
    ASSERT_TRUE(client.ok()) << client.status();
    ASSERT_TRUE(Train(client->get(), 4).ok());
    ASSERT_TRUE((*cluster)->ReadMasterWeights(4).ok());
  }
  auto trainer = ClientSecurity::Create(Own(GetParam(), Role::kTrainer), Role::kTrainer);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  auto roll_back = [&](LocalCluster& cluster, int shard, int64_t step) {
    auto stub = v1::ShardService::NewStub((*trainer)->NewChannel(cluster.addresses()[shard]));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    v1::RollBackRequest request;
    request.set_step(step);
    request.set_job_fingerprint(JobFingerprint(cluster.server(shard).state().job()));
    request.set_trainer_rank(0);
    for (const std::string& a : cluster.addresses()) request.add_restarted_addresses(a);
    v1::RollBackResponse response;
    return stub->RollBack(&ctx, request, &response);
  };
  auto refused_rollbacks = [](LocalCluster& cluster, int shard) {
    absl::StatusOr<MetricsText> page = ParseMetricsText(cluster.server(shard).registry().Serialize());
    EXPECT_TRUE(page.ok()) << page.status();
    return page.ok() ? SampleValue(*page, "pshard_server_refused_rollbacks_total", {}).value_or(-1) : -1;
  };

  {  // Both shards restored at step 4: nothing restarted behind anyone.
    auto cluster = LocalCluster::Start(job, options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    for (int shard = 0; shard < 2; ++shard) {
      for (int64_t step : {3, 2}) {
        const grpc::Status s = roll_back(**cluster, shard, step);
        EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << shard << " " << step;
        EXPECT_THAT(s.error_message(), ::testing::HasSubstr("no shard of this job restarted from its checkpoint of step"))
            << s.error_message();
      }
      EXPECT_EQ((*cluster)->server(shard).state().current_step(), 4);
      EXPECT_EQ(refused_rollbacks(**cluster, shard), 2);
    }
  }
  // Shard 1 restarts behind: its checkpoint of step 4 is gone, it restores 3.
  std::filesystem::remove(std::filesystem::path(dir) / CheckpointFileName(1, 2, 4));
  auto cluster = LocalCluster::Start(job, options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ASSERT_EQ((*cluster)->server(0).state().current_step(), 4);
  ASSERT_EQ((*cluster)->server(1).state().current_step(), 3);
  const grpc::Status back = roll_back(**cluster, 0, 3);
  ASSERT_TRUE(back.ok()) << back.error_message();
  EXPECT_EQ((*cluster)->server(0).state().current_step(), 3);
  // The job steps on from 3 (the trainer redoes step 3)...
  auto client = (*cluster)->Connect(0, WireEncoding::kFp32);
  ASSERT_TRUE(client.ok()) << client.status();
  auto stepping = Trainer::Create(client->get(), &TestCorpus(), TinyTrainerOptions(5));
  ASSERT_TRUE(stepping.ok()) << stepping.status();
  ASSERT_TRUE((*stepping)->RunStep(3).ok());
  ASSERT_TRUE((*cluster)->ReadMasterWeights(4).ok());
  // ...and the same restart is no reason to go back again.
  for (int shard = 0; shard < 2; ++shard) {
    const grpc::Status again = roll_back(**cluster, shard, 3);
    EXPECT_EQ(again.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << again.error_message();
    EXPECT_EQ((*cluster)->server(shard).state().current_step(), 4);
  }
  std::filesystem::remove_all(dir);
}

// A trainer that posts rendezvous seats and goes away takes them with it:
// a table the abandoned rounds had filled takes the job's own round.
TEST_P(SecurityTest, AbandonedRendezvousRoundsCloseWhenTheirCallersLeave) {
  const JobConfig job = TinyGptJob(2, 2, kSteps);
  auto cluster = LocalCluster::Start(job, Secured(GetParam()));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto trainer = ClientSecurity::Create(Own(GetParam(), Role::kTrainer), Role::kTrainer);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  auto channel = (*trainer)->NewChannel((*cluster)->addresses()[0]);
  // Connected before the burst: a handshake that fails under load would
  // otherwise answer the posts UNAVAILABLE at once, and nothing would fill.
  ASSERT_TRUE(channel->WaitForConnected(absl::ToChronoTime(absl::Now() + absl::Seconds(20))))
      << "the shard server did not accept a connection within 20 s";
  auto stub = v1::ShardService::NewStub(channel);
  auto post = [&](grpc::ClientContext* ctx, const std::string& group, int member, absl::Duration wait) {
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + wait));
    ctx->set_wait_for_ready(true);
    v1::RendezvousRequest request;
    request.set_group(group);
    request.set_member(member);
    request.set_size(2);
    request.set_payload(absl::StrCat(group, "/", member));
    v1::RendezvousResponse response;
    return stub->Rendezvous(ctx, request, &response);
  };

  // Seats in rounds nobody else joins, an hour's wait each, more than the
  // table holds: it fills (the rest are refused at once).
  constexpr int kPosts = 40;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::thread> abandoned;
  std::vector<grpc::Status> answers(kPosts);
  std::atomic<int> answered_early{0};
  std::atomic<bool> leaving{false};
  absl::Mutex mu;
  int refused = 0;
  for (int i = 0; i < kPosts; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    abandoned.emplace_back([&, i, ctx = contexts.back().get()] {
      answers[i] = post(ctx, absl::StrCat("abandoned-", i), 0, absl::Hours(1));
      if (answers[i].error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
        absl::MutexLock lock(&mu);
        ++refused;
      } else if (!leaving.load()) {
        ++answered_early;
      }
    });
  }
  // One of the burst refused means the burst alone filled the table. Only
  // then does the probe go in: a probe seated while the burst still
  // arrives would hold a place of its own, and the table it sees full
  // would be partly the probe's.
  bool filled;
  {
    absl::MutexLock lock(&mu);
    const auto any = [](int* n) { return *n > 0; };
    filled = mu.AwaitWithTimeout(absl::Condition(+any, &refused), absl::Seconds(30));
  }
  grpc::Status probed;
  if (filled) {
    grpc::ClientContext probe;
    probed = post(&probe, "probe", 0, absl::Seconds(5));
  }

  // The callers leave (on every path, so that no thread outlives the test).
  leaving.store(true);
  for (auto& ctx : contexts) ctx->TryCancel();
  for (auto& t : abandoned) t.join();
  EXPECT_EQ(answered_early.load(), 0) << "abandoned posts were answered before their callers left";
  ASSERT_TRUE(filled) << "none of " << kPosts << " abandoned posts was refused within 30 s: the table never filled";
  ASSERT_EQ(probed.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << "a table full of abandoned rounds took another: " << probed.error_message();
  int cancelled = 0;
  for (int i = 0; i < kPosts; ++i) {
    const grpc::StatusCode code = answers[i].error_code();
    cancelled += code == grpc::StatusCode::CANCELLED;
    EXPECT_TRUE(code == grpc::StatusCode::CANCELLED || code == grpc::StatusCode::RESOURCE_EXHAUSTED)
        << i << ": " << code << " " << answers[i].error_message();
  }
  EXPECT_GT(cancelled, 0);

  // The job's round meets (the withdrawals are on the server's time).
  grpc::Status met0, met1;
  for (absl::Time until = absl::Now() + absl::Seconds(10); absl::Now() < until;) {
    grpc::ClientContext c0, c1;
    std::thread member1([&] { met1 = post(&c1, "fabric:0,1", 1, absl::Seconds(5)); });
    met0 = post(&c0, "fabric:0,1", 0, absl::Seconds(5));
    member1.join();
    if (met0.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED &&
        met1.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(met0.ok()) << met0.error_message();
  EXPECT_TRUE(met1.ok()) << met1.error_message();
}

INSTANTIATE_TEST_SUITE_P(Modes, SecurityTest, ::testing::Values(Mode::kTls, Mode::kTokens, Mode::kTlsAndTokens),
                         [](const auto& info) { return ModeName(info.param); });

// A plaintext client cannot talk to a TLS server at all, and a TLS client
// checks the server: a server whose certificate is of another CA, or names
// another host, is not trusted.
TEST(SecurityTest, ClientsTrustOnlyTheirCaAndTheServersName) {
  const Credentials& c = Made();
  const JobConfig job = TinyGptJob(1, 1, kSteps);
  LocalCluster::Options options;
  options.security = Own(Mode::kTls, Role::kServer);
  auto cluster = LocalCluster::Start(job, options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string address = (*cluster)->addresses()[0];
  auto status_with = [&](const SecurityOptions& o) {
    auto security = ClientSecurity::Create(o, Role::kReader);
    EXPECT_TRUE(security.ok()) << security.status();
    auto stub = v1::ShardService::NewStub((*security)->NewChannel(address));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(3)));
    v1::StatusResponse response;
    return stub->GetStatus(&ctx, v1::StatusRequest(), &response);
  };
  EXPECT_FALSE(status_with(SecurityOptions()).ok());  // plaintext to a TLS port
  SecurityOptions other_ca = Own(Mode::kTls, Role::kReader);
  other_ca.tls_ca = c.other + "/ca.pem";
  EXPECT_EQ(status_with(other_ca).error_code(), grpc::StatusCode::UNAVAILABLE);
  SecurityOptions other_name = Own(Mode::kTls, Role::kReader);
  other_name.tls_server_name = "pshard-server-7.example";
  EXPECT_EQ(status_with(other_name).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(status_with(Own(Mode::kTls, Role::kReader)).ok());
}

// Rotation: the server re-reads its CA file when it changes. A client of a
// new CA is refused until the server's CA file holds the new CA too.
TEST(SecurityTest, ANewCaIsTrustedOnceTheCaFileHoldsIt) {
  const Credentials& c = Made();
  const std::string ca = Made().dir + "/rotating-ca.pem";
  std::filesystem::copy_file(c.good + "/ca.pem", ca, std::filesystem::copy_options::overwrite_existing);
  LocalCluster::Options options;
  options.security = Own(Mode::kTls, Role::kServer);
  options.security.tls_ca = ca;
  options.security.reload_interval = absl::Seconds(1);
  auto cluster = LocalCluster::Start(TinyGptJob(1, 1, kSteps), options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  SecurityOptions newcomer;
  newcomer.tls_cert = c.other + "/reader/tls.crt";
  newcomer.tls_key = c.other + "/reader/tls.key";
  newcomer.tls_ca = c.good + "/ca.pem";  // the server's certificate is still the old CA's
  auto security = ClientSecurity::Create(newcomer, Role::kReader);
  ASSERT_TRUE(security.ok()) << security.status();
  auto stub = v1::ShardService::NewStub((*security)->NewChannel((*cluster)->addresses()[0]));
  auto status = [&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(3)));
    v1::StatusResponse response;
    return stub->GetStatus(&ctx, v1::StatusRequest(), &response);
  };
  EXPECT_EQ(status().error_code(), grpc::StatusCode::UNAUTHENTICATED);

  // Both CAs, written whole and renamed in, as secret mounts update.
  std::ofstream(ca + ".new") << std::ifstream(c.good + "/ca.pem").rdbuf() << std::ifstream(c.other + "/ca.pem").rdbuf();
  std::filesystem::rename(ca + ".new", ca);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  grpc::Status s = status();
  while (!s.ok() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(200));
    s = status();
  }
  EXPECT_TRUE(s.ok()) << s.error_message();
}

TEST(SecurityTest, BadSettingsAreRefusedNamingTheFlag) {
  const Credentials& c = Made();
  SecurityOptions half;
  half.tls_cert = c.good + "/server/tls.crt";
  EXPECT_NE(half.Validate(true).message().find("--tls_cert and --tls_key"), std::string::npos);
  SecurityOptions missing = Own(Mode::kTls, Role::kServer);
  missing.tls_ca = c.dir + "/no-such-ca.pem";
  EXPECT_NE(missing.Validate(true).message().find("--tls_ca="), std::string::npos);
  SecurityOptions client_without_ca = Own(Mode::kTls, Role::kTrainer);
  client_without_ca.tls_ca.clear();
  EXPECT_FALSE(ClientSecurity::Create(client_without_ca, Role::kTrainer).ok());

  const std::string tokens = c.dir + "/bad-tokens";
  auto refused = [&](const std::string& text, const std::string& why) {
    std::ofstream(tokens) << text;
    absl::StatusOr<std::array<std::string, kNumRoles>> read = ReadTokenFile(tokens);
    ASSERT_FALSE(read.ok()) << text;
    EXPECT_NE(read.status().message().find(why), std::string::npos) << read.status();
  };
  refused("admin 0123456789abcdef0123\n", "unknown role \"admin\"");
  refused("trainer short\n", "shorter than 16");
  refused("trainer 0123456789abcdef0123\ntrainer 1123456789abcdef0123\n", "listed twice");
  refused("trainer 0123456789abcdef0123\nreader 0123456789abcdef0123\n", "share one token");
  refused("# nothing\n", "no tokens");
  std::ofstream(tokens) << "trainer 0123456789abcdef0123\n";
  SecurityOptions reader_without_token;
  reader_without_token.auth_token_file = tokens;
  absl::StatusOr<std::shared_ptr<const ClientSecurity>> r = ClientSecurity::Create(reader_without_token, Role::kReader);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("no token for the role of this program (reader)"), std::string::npos);

  // A server that cannot read its credentials does not start (open).
  LocalCluster::Options options;
  options.security = missing;
  auto cluster = LocalCluster::Start(TinyGptJob(1, 1, kSteps), options);
  EXPECT_FALSE(cluster.ok());
}

// Without TLS or tokens anyone may call Announce: it can still not move a
// shard that answers where it is (export and status would read a stranger's
// server as that shard). A shard that stopped answering can be moved: a
// restarted one on a new port.
TEST(DefaultMode, AnAnnounceCannotMoveALiveShard) {
  const JobConfig job = TinyGptJob(2, 1, kSteps);
  auto cluster = LocalCluster::Start(job);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::vector<std::string> addresses = (*cluster)->addresses();
  auto stub = v1::ShardService::NewStub(grpc::CreateChannel(addresses[0], grpc::InsecureChannelCredentials()));
  auto announce = [&](const std::string& where) {
    grpc::ClientContext ctx;
    v1::AnnounceRequest request;
    request.set_shard_index(1);
    request.set_port(1);
    request.set_advertised_address(where);
    request.set_job_fingerprint(JobFingerprint((*cluster)->server(0).state().job()));
    v1::AnnounceResponse response;
    return stub->Announce(&ctx, request, &response);
  };
  auto shard1_address = [&] {
    grpc::ClientContext ctx;
    v1::StatusResponse status;
    EXPECT_TRUE(stub->GetStatus(&ctx, v1::StatusRequest(), &status).ok());
    return status.shard_addresses_size() == 2 ? status.shard_addresses(1) : std::string("?");
  };
  // Shard 1 announces itself once it is up.
  for (absl::Time until = absl::Now() + absl::Seconds(10); absl::Now() < until && shard1_address().empty();) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_EQ(shard1_address(), addresses[1]);

  const grpc::Status moved = announce("127.0.0.1:1");
  EXPECT_EQ(moved.error_code(), grpc::StatusCode::ALREADY_EXISTS) << moved.error_message();
  EXPECT_THAT(moved.error_message(), ::testing::HasSubstr("shard 1 answers at " + addresses[1]));
  EXPECT_EQ(shard1_address(), addresses[1]);
  // The shard itself announcing where it is: accepted, nothing changes.
  EXPECT_TRUE(announce(addresses[1]).ok());

  (*cluster)->server(1).Shutdown(absl::ZeroDuration());
  const grpc::Status restarted = announce("127.0.0.1:2");
  EXPECT_TRUE(restarted.ok()) << restarted.error_message();
  EXPECT_EQ(shard1_address(), "127.0.0.1:2");
}

}  // namespace
}  // namespace pshard::testing
