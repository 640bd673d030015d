#include "fuzz/in_process_shard.h"

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/metrics/metrics.h"
#include "common/security/caller_authenticator.h"
#include "fuzz/harness.h"
#include "grpcpp/generic/generic_stub.h"
#include "shard_server/checkpoint.h"
#include "shard_server/grpc/grpc_service.h"
#include "shard_server/norm_coordinator.h"
#include "shard_server/server_metrics.h"
#include "shard_server/session_tokens.h"
#include "trainer_client/model/gpt_spec.h"

namespace pshard::fuzz {
namespace {

// One token per role, as a token file lists them.
constexpr std::array<const char*, kNumRoles> kRoleTokens = {
    "fuzz-server-token-0123456789", "fuzz-trainer-token-0123456789", "fuzz-reader-token-0123456789"};

std::string TokenOf(Caller caller) {
  switch (caller) {
    case Caller::kServer:
      return kRoleTokens[static_cast<int>(Role::kServer)];
    case Caller::kTrainer:
      return kRoleTokens[static_cast<int>(Role::kTrainer)];
    case Caller::kReader:
      return kRoleTokens[static_cast<int>(Role::kReader)];
    case Caller::kWrongToken:
      return "fuzz-token-of-no-role-0123456789";
    case Caller::kNoToken:
      break;
  }
  return "";
}

// The servers' token check, made once per process from a token file.
CallerAuthenticator& SharedAuthenticator() {
  static CallerAuthenticator* authenticator = [] {
    SecurityOptions options;
    options.auth_token_file = ScratchFolder() + "/tokens";
    {
      std::ofstream out(options.auth_token_file);
      for (int r = 0; r < kNumRoles; ++r) out << RoleName(static_cast<Role>(r)) << " " << kRoleTokens[r] << "\n";
    }
    absl::StatusOr<std::unique_ptr<CallerAuthenticator>> made = CallerAuthenticator::Create(options);
    Require(made.ok(), made.status().ToString());
    return made->release();
  }();
  return *authenticator;
}

// A message as slices of `piece_bytes` (0: one slice).
grpc::ByteBuffer Pieces(const std::string& bytes, size_t piece_bytes) {
  std::vector<grpc::Slice> slices;
  const size_t step = piece_bytes == 0 ? bytes.size() : piece_bytes;
  for (size_t at = 0; at < bytes.size(); at += step) {
    slices.emplace_back(bytes.data() + at, std::min(step, bytes.size() - at));
  }
  if (slices.empty()) slices.emplace_back("", 0);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// One call, step by step on a completion queue of its own, which is
// drained before it goes: nothing of the call outlives it. (The callback
// API's completion queue belongs to the channel, and tearing a channel
// down right after its calls ended is a double free in gRPC 1.51.)
RawResult CallOnce(grpc::GenericStub& stub, const RawCall& call) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + call.deadline));
  if (const std::string token = TokenOf(call.caller); !token.empty()) {
    context.AddMetadata(kTokenMetadataKey, absl::StrCat("Bearer ", token));
  }
  grpc::CompletionQueue queue;
  // Each operation is awaited before the next starts: the queue returns it.
  auto await = [&queue] {
    void* tag = nullptr;
    bool ok = false;
    Require(queue.Next(&tag, &ok), "the completion queue shut down during a call");
    return ok;
  };
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> stream =
      stub.PrepareCall(&context, MethodPath(call.method), &queue);
  Require(stream != nullptr, "a call could not be made");
  stream->StartCall(nullptr);
  bool ok = await();
  for (size_t i = 0; ok && i < call.requests.size(); ++i) {
    const grpc::ByteBuffer request = Pieces(call.requests[i], call.piece_bytes);
    stream->Write(request, nullptr);
    ok = await();
  }
  if (ok) {
    stream->WritesDone(nullptr);
    await();
  }
  RawResult result;
  for (grpc::ByteBuffer response;;) {
    stream->Read(&response, nullptr);
    if (!await()) break;
    grpc::Slice whole;
    Require(response.DumpToSingleSlice(&whole).ok(), "an unreadable response");
    result.responses.emplace_back(reinterpret_cast<const char*>(whole.begin()), whole.size());
  }
  stream->Finish(&result.status, nullptr);
  await();
  queue.Shutdown();
  for (void* tag = nullptr; queue.Next(&tag, &ok);) {
  }
  return result;
}

// The metrics every input's shard counts in: nothing a shard decides
// depends on them, and making them is a fifth of a shard's start.
ServerMetrics& SharedMetrics(int num_units) {
  static metrics::Registry* registry = new metrics::Registry();
  static ServerMetrics* metrics =
      new ServerMetrics(*registry, 0, FuzzJob().num_trainers, num_units, {"grpc", "ucx"});
  return *metrics;
}

}  // namespace

Caller CallerFrom(uint8_t choices) { return static_cast<Caller>((choices & 7) % 5); }

std::string MethodPath(Method method) {
  static constexpr std::array<const char*, kNumMethods> kNames = {
      "Join", "Fetch", "Push", "AgreeNorm", "GetStatus", "Announce", "ReadMaster", "Rendezvous", "RollBack"};
  return absl::StrCat("/pshard.v1.ShardService/", kNames[static_cast<int>(method)]);
}

JobConfig FuzzJob() {
  JobConfig job;
  job.model = MakeGptSpec(GptConfig{.num_layers = 2, .d_model = 16, .num_heads = 2, .context = 8, .vocab = 64}).value();
  job.optimizer.lr = 1e-2;
  job.optimizer.min_lr = 1e-3;
  job.optimizer.warmup_steps = 2;
  job.optimizer.total_steps = 10;
  job.optimizer.weight_decay = 0.1;
  job.optimizer.grad_clip = 0.5;
  job.num_shards = 2;
  job.num_trainers = 2;
  job.slice_alignment = 8;
  return job;
}

struct InProcessShard::Parts {
  std::unique_ptr<NormCoordinator> coordinator;
  SessionTokens tokens;
  std::unique_ptr<ShardServiceImpl> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<grpc::GenericStub> stub;
};

SessionTokens& InProcessShard::tokens() { return parts_->tokens; }

ServerMetrics& InProcessShard::metrics() { return SharedMetrics(state_->num_units()); }

InProcessShard::InProcessShard() : parts_(std::make_unique<Parts>()) {
  const JobConfig job = FuzzJob();
  absl::StatusOr<std::unique_ptr<ShardState>> state = ShardState::Create(job, 0);
  Require(state.ok(), state.status().ToString());
  state_ = std::move(*state);
  Parts& p = *parts_;
  p.coordinator = std::make_unique<NormCoordinator>(job.num_shards);
  ShardServiceImpl::Options options;
  options.fetch_wait_limit = kServerWaitLimit;
  options.norm_wait_limit = kServerWaitLimit;
  options.fetch_chunk_bytes = 1024;  // several chunks per slice
  options.tokens = &p.tokens;
  options.own_address = "shard-0.fuzz:7070";
  options.authenticator = &SharedAuthenticator();
  // The harness's own rollback (no other shard to ask for evidence).
  options.roll_back = [this](int64_t step, int rank, const std::vector<std::string>&) { return RollBack(step, rank); };
  p.service = std::make_unique<ShardServiceImpl>(state_.get(), p.coordinator.get(),
                                                 &SharedMetrics(state_->num_units()), options);
  grpc::ServerBuilder builder;
  builder.RegisterService(p.service.get());
  builder.SetMaxReceiveMessageSize(4 << 20);
  builder.SetMaxSendMessageSize(4 << 20);
  p.server = builder.BuildAndStart();
  Require(p.server != nullptr, "the in-process server did not start");
  p.stub = std::make_unique<grpc::GenericStub>(p.server->InProcessChannel(grpc::ChannelArguments()));
}

InProcessShard::~InProcessShard() {
  parts_->service->StopWaiting();
  parts_->server->Shutdown(absl::ToChronoTime(absl::Now()));
  parts_->server->Wait();
}

RawResult InProcessShard::Call(const RawCall& call) { return CallOnce(*parts_->stub, call); }

std::vector<RawResult> InProcessShard::CallTogether(const std::vector<RawCall>& calls) {
  std::vector<RawResult> results(calls.size());
  std::vector<std::thread> callers;
  for (size_t i = 0; i < calls.size(); ++i) {
    callers.emplace_back([this, &calls, &results, i] { results[i] = CallOnce(*parts_->stub, calls[i]); });
  }
  for (std::thread& t : callers) t.join();
  return results;
}

bool InProcessShard::CloseStepIfComplete() {
  if (!state_->AwaitContributions(absl::Now()).ok()) return false;
  state_->ApplyStep(state_->FinishReduction());
  return true;
}

void InProcessShard::SaveCheckpoint() {
  if (checkpoint_dir_.empty()) {
    checkpoint_dir_ = ScratchFolder() + "/checkpoints";
    std::filesystem::remove_all(checkpoint_dir_);  // an earlier input's
  }
  const absl::StatusOr<std::string> path = state_->SaveCheckpoint(checkpoint_dir_, 8);
  Require(path.ok(), absl::StrCat("a checkpoint could not be written: ", path.status().message()));
}

absl::StatusOr<int64_t> InProcessShard::RollBack(int64_t step, int rank) {
  const int64_t from = state_->current_step();
  if (step == from) return from;
  if (step > from || checkpoint_dir_.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("shard 0 is at step ", from, ": no checkpoint of step ", step));
  }
  const std::string path = checkpoint_dir_ + "/" + CheckpointFileName(0, state_->job().num_shards, step);
  absl::StatusOr<Checkpoint> checkpoint = ReadCheckpoint(path);
  if (!checkpoint.ok()) return absl::FailedPreconditionError(checkpoint.status().message());
  if (absl::Status rolled = state_->RollBack(*std::move(checkpoint), rank); !rolled.ok()) return rolled;
  parts_->coordinator->ForgetFrom(step);
  return step;
}

std::string InProcessShard::StatusOrDie() {
  RawResult r = Call(RawCall{.method = Method::kGetStatus, .requests = {""}, .caller = Caller::kReader});
  Require(r.status.ok() && r.responses.size() == 1,
          absl::StrCat("GetStatus failed after the input's calls: ", r.status.error_message()));
  return r.responses[0];
}

}  // namespace pshard::fuzz
