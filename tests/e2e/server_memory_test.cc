// What a caller can make a shard server hold, measured on a real
// pshard-server process: thousands of fetches left waiting for a version,
// over many connections, cost the server no more than its caps allow
// (docs/security.md); the rest are refused at once, and the server serves
// on once they are gone.
#include <atomic>
#include <csignal>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "grpcpp/grpcpp.h"
#include "proto/shard.grpc.pb.h"
#include "tests/e2e/e2e_util.h"
#include "tools/process.h"

namespace pshard {
namespace {

// The resident memory of `pid`, in MiB (VmRSS of /proc/PID/status).
double ResidentMiB(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  }
  ADD_FAILURE() << "no VmRSS for process " << pid;
  return 0;
}

// A fetch of a version the server has not published: it waits there until
// its deadline, its cancellation, or a refusal.
class WaitingFetch final : public grpc::ClientReadReactor<v1::FetchChunk> {
 public:
  WaitingFetch(v1::ShardService::Stub* stub, std::atomic<int>* refused, std::atomic<int>* done)
      : refused_(refused), done_(done) {
    ctx_.set_deadline(absl::ToChronoTime(absl::Now() + absl::Minutes(2)));
    request_.set_unit(0);
    request_.set_version(1);
    request_.set_encoding(v1::ENCODING_FP32);
    stub->async()->Fetch(&ctx_, &request_, this);
    StartRead(&chunk_);
    StartCall();
  }
  void OnReadDone(bool ok) override {
    if (ok) StartRead(&chunk_);
  }
  void OnDone(const grpc::Status& s) override {
    code_ = s.error_code();
    if (code_ == grpc::StatusCode::RESOURCE_EXHAUSTED) refused_->fetch_add(1);
    done_->fetch_add(1);
  }
  void Cancel() { ctx_.TryCancel(); }
  grpc::StatusCode code() const { return code_; }

 private:
  grpc::ClientContext ctx_;
  v1::FetchRequest request_;
  v1::FetchChunk chunk_;
  std::atomic<int>* const refused_;
  std::atomic<int>* const done_;
  grpc::StatusCode code_ = grpc::StatusCode::OK;
};

TEST(ServerMemory, TwentyThousandWaitingFetchesAreCappedAndRefusedAtOnce) {
  constexpr int kConnections = 20, kPerConnection = 1000;
  constexpr int kTotalCap = 4096;  // WaitingFetches::Limits' defaults: 256 a connection, 4096 in all
  const std::string dir = MakeRunDir();
  absl::StatusOr<ChildProcess> server = ChildProcess::Spawn(
      {std::string(PSHARD_BIN_DIR) + "/pshard-server", "--metrics_address=", absl::StrCat("--port_file=", dir, "/port"),
       "--layers=2", "--d_model=32", "--heads=2", "--context=16", "--ucx=false"},
      dir + "/server.log");
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<int> port = WaitForPortFile(dir + "/port", *server, absl::Seconds(30));
  ASSERT_TRUE(port.ok()) << port.status() << ReadFile(dir + "/server.log");
  const std::string address = absl::StrCat("127.0.0.1:", *port);

  // Connections of their own (not shared through gRPC's global pool).
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<v1::ShardService::Stub>> stubs;
  for (int c = 0; c < kConnections; ++c) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    channels.push_back(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
    ASSERT_TRUE(channels.back()->WaitForConnected(absl::ToChronoTime(absl::Now() + absl::Seconds(10))));
    stubs.push_back(v1::ShardService::NewStub(channels.back()));
  }
  absl::SleepFor(absl::Seconds(1));
  const double before = ResidentMiB(server->pid());

  std::atomic<int> refused{0}, done{0};
  std::vector<std::unique_ptr<WaitingFetch>> fetches;
  for (int i = 0; i < kPerConnection; ++i) {
    for (int c = 0; c < kConnections; ++c) fetches.push_back(std::make_unique<WaitingFetch>(stubs[c].get(), &refused, &done));
  }
  const int expected_refused = kConnections * kPerConnection - kTotalCap;
  for (absl::Time until = absl::Now() + absl::Seconds(90); refused.load() < expected_refused && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  absl::SleepFor(absl::Seconds(1));
  const double holding = ResidentMiB(server->pid());
  EXPECT_EQ(refused.load(), expected_refused) << "answered " << done.load() << " of " << fetches.size();
  EXPECT_EQ(done.load(), expected_refused) << "fetches that should still wait were answered";
  // Uncapped, the 20000 waiting fetches cost the server about 313 MiB; the
  // cap holds about a fifth of them.
  EXPECT_LT(holding - before, 128.0) << "resident " << before << " MiB before, " << holding << " MiB holding";
  std::printf("server resident memory: %.0f MiB before, %.0f MiB holding %d waiting fetches (%d refused)\n", before,
              holding, kTotalCap, refused.load());

  // The callers leave: their places are given back, and fetches are served.
  for (auto& f : fetches) f->Cancel();
  for (absl::Time until = absl::Now() + absl::Seconds(60);
       done.load() < static_cast<int>(fetches.size()) && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_EQ(done.load(), static_cast<int>(fetches.size()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  v1::FetchRequest request;
  request.set_unit(0);
  request.set_version(0);
  request.set_encoding(v1::ENCODING_FP32);
  auto stream = stubs[0]->Fetch(&ctx, request);
  v1::FetchChunk chunk;
  int64_t bytes = 0;
  while (stream->Read(&chunk)) bytes += static_cast<int64_t>(chunk.data().size());
  const grpc::Status fetched = stream->Finish();
  EXPECT_TRUE(fetched.ok()) << fetched.error_message();
  EXPECT_GT(bytes, 0);
  server->Signal(SIGTERM);
  EXPECT_TRUE(server->WaitUntil(absl::Now() + absl::Seconds(20)).has_value());
}

}  // namespace
}  // namespace pshard
