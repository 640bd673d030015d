#include "trainer_client/shard_client.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "proto/rpc_util.h"
#include "proto/shard.grpc.pb.h"
#include "pshard/config.h"
#include "trainer_client/transport/grpc/grpc_transport.h"
#include "trainer_client/join.h"
#if PSHARD_WITH_UCX
#include "trainer_client/transport/ucx/ucx_transport.h"
#else
namespace pshard {
class UcxContext {};  // never created in builds without UCX
}  // namespace pshard
#endif

namespace pshard {

// ---- BufferPool ----

std::vector<float> BufferPool::Take(size_t n) {
  {
    absl::MutexLock lock(&mu_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->size() == n) {
        std::vector<float> out = std::move(*it);
        free_.erase(it);
        return out;
      }
    }
  }
  return std::vector<float>(n);
}

void BufferPool::Give(std::vector<float> buffer) {
  if (buffer.empty()) return;
  absl::MutexLock lock(&mu_);
  if (free_.size() >= max_free_) free_.erase(free_.begin());
  free_.push_back(std::move(buffer));
}

bool IsRecoverableFailure(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kInternal:
      return true;
    default:
      return false;
  }
}

// ---- UnitTransfer ----

UnitTransfer::UnitTransfer(int parts, std::shared_ptr<BufferPool> pool)
    : remaining_(parts), started_(absl::Now()), pool_(std::move(pool)) {
  absl::MutexLock lock(&mu_);
  if (parts == 0) finished_ = started_;
}

UnitTransfer::~UnitTransfer() {
  if (pool_ && !values_.empty()) pool_->Give(std::move(values_));
}

absl::Status UnitTransfer::Wait() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](int* remaining) { return *remaining == 0; }, &remaining_));
  return status_;
}

bool UnitTransfer::done() const {
  absl::MutexLock lock(&mu_);
  return remaining_ == 0;
}

absl::Time UnitTransfer::finished() const {
  absl::MutexLock lock(&mu_);
  return finished_;
}

int64_t UnitTransfer::wire_bytes() const {
  absl::MutexLock lock(&mu_);
  return wire_bytes_;
}

int64_t UnitTransfer::payload_bytes() const {
  absl::MutexLock lock(&mu_);
  return payload_bytes_;
}

void UnitTransfer::PartDone(absl::Status status, int64_t wire_bytes, int64_t payload_bytes) {
  bool first_failure = false;
  {
    absl::MutexLock lock(&mu_);
    if (status.ok()) payload_bytes_ += payload_bytes;
    if (status_.ok() && !status.ok()) {
      status_ = std::move(status);
      first_failure = remaining_ > 1;
    }
    wire_bytes_ += wire_bytes;
    if (--remaining_ == 0) finished_ = absl::Now();
  }
  // The unit is lost with this part: the others need not run to their
  // deadlines (a fetch from a live server may wait for a version that the
  // dead one holds up).
  if (first_failure) cancel_->Cancel();
}

// ---- per-shard connection and reactors ----

struct ShardClient::Shard {
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::ShardService::Stub> stub;  // control plane
  std::unique_ptr<Transport> transport;          // data plane
  std::string ucx_address;                       // JoinResponse.ucx_address
  uint64_t session_token = 0;                    // JoinResponse.session_token
};

namespace {

// Enough free buffers for a few prefetched units of each size.
constexpr size_t kPooledBuffers = 8;

// Each server's current step, by GetStatus.
absl::Status ReadSteps(const std::vector<v1::ShardService::Stub*>& stubs, const std::vector<std::string>& addresses,
                       std::vector<int64_t>& steps) {
  for (size_t i = 0; i < stubs.size(); ++i) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::StatusRequest request;
    v1::StatusResponse response;
    if (grpc::Status s = stubs[i]->GetStatus(&ctx, request, &response); !s.ok()) {
      return absl::UnavailableError(absl::StrCat("status of ", addresses[i], ": ", s.error_message()));
    }
    steps[i] = response.current_step();
  }
  return absl::OkStatus();
}

// Asks every server ahead of `step` to go back to its checkpoint of it.
absl::Status RollBackServers(const std::vector<v1::ShardService::Stub*>& stubs,
                             const std::vector<std::string>& addresses, const std::vector<int64_t>& steps,
                             int64_t step, uint64_t fingerprint, int rank) {
  for (size_t i = 0; i < stubs.size(); ++i) {
    if (steps[i] <= step) continue;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    v1::RollBackRequest request;
    request.set_step(step);
    request.set_job_fingerprint(fingerprint);
    request.set_trainer_rank(rank);
    // The restarted servers: each server asked checks one of them.
    for (size_t j = 0; j < stubs.size(); ++j) {
      if (steps[j] == step) request.add_restarted_addresses(addresses[j]);
    }
    v1::RollBackResponse response;
    if (grpc::Status s = stubs[i]->RollBack(&ctx, request, &response); !s.ok()) {
      return absl::Status(FromGrpcStatus(s).code(),
                          absl::StrCat("rolling back ", addresses[i], " from step ", steps[i], " to step ", step,
                                       ": ", s.error_message()));
    }
  }
  return absl::OkStatus();
}

// Servers of one job are at the same step, or one apart for the moment a
// step is being published. Waits (briefly) for them to agree. A lasting
// difference means some were restored from checkpoints of an earlier step:
// with `roll_back`, the servers ahead are asked to go back to the lowest
// step (a server that restarted mid-job); without, it is an error.
absl::StatusOr<int64_t> AgreedStep(const std::vector<v1::ShardService::Stub*>& stubs,
                                   const std::vector<std::string>& addresses, std::vector<int64_t> steps,
                                   bool roll_back, uint64_t fingerprint, int rank) {
  absl::Time give_up = absl::Now() + (roll_back ? absl::Seconds(2) : absl::Seconds(10));
  int rollbacks = 0;
  while (true) {
    const auto [lo, hi] = std::minmax_element(steps.begin(), steps.end());
    if (*lo == *hi) return *hi;
    std::vector<std::string> where;
    for (size_t i = 0; i < steps.size(); ++i) where.push_back(absl::StrCat(addresses[i], " at ", steps[i]));
    if (absl::Now() >= give_up && roll_back && rollbacks < 3) {
      ++rollbacks;
      std::fprintf(stderr,
                   "pshard-trainer %d: the shard servers are at different steps (%s): a server restarted from its "
                   "checkpoint; rolling the others back to step %lld\n",
                   rank, absl::StrJoin(where, ", ").c_str(), static_cast<long long>(*lo));
      RETURN_IF_ERROR(RollBackServers(stubs, addresses, steps, *lo, fingerprint, rank));
      give_up = absl::Now() + absl::Seconds(2);
    } else if (absl::Now() >= give_up) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the shard servers are at different steps (", absl::StrJoin(where, ", "),
          "): they were restored from checkpoints of different steps; restart them with "
          "--resume_step set to a step every shard has"));
    }
    absl::SleepFor(absl::Milliseconds(200));
    RETURN_IF_ERROR(ReadSteps(stubs, addresses, steps));
  }
}

}  // namespace

ShardClient::ShardClient(Options options)
    : options_(std::move(options)), pool_(std::make_shared<BufferPool>(kPooledBuffers)) {}
ShardClient::~ShardClient() {
  std::vector<std::shared_ptr<UnitTransfer>> live;
  {
    absl::MutexLock lock(&live_mu_);
    for (auto& weak : live_) {
      if (std::shared_ptr<UnitTransfer> t = weak.lock()) live.push_back(std::move(t));
    }
  }
  // Their parts still use the transports and the UCX context.
  for (auto& t : live) t->Cancel();
  for (auto& t : live) t->Wait().IgnoreError();
}

void ShardClient::Track(const std::shared_ptr<UnitTransfer>& transfer) {
  absl::MutexLock lock(&live_mu_);
  live_.erase(std::remove_if(live_.begin(), live_.end(),
                             [](const std::weak_ptr<UnitTransfer>& w) {
                               std::shared_ptr<UnitTransfer> t = w.lock();
                               return t == nullptr || t->done();
                             }),
              live_.end());
  live_.push_back(transfer);
}

absl::StatusOr<std::unique_ptr<ShardClient>> ShardClient::Connect(Options options) {
  if (options.server_addresses.empty()) return absl::InvalidArgumentError("no shard server addresses given");
  if (options.transport != "auto" && options.transport != "grpc" && options.transport != "ucx") {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown transport \"", options.transport, "\"; expected auto, grpc or ucx"));
  }
  if (options.transport == "ucx" && !PSHARD_WITH_UCX) {
    return absl::FailedPreconditionError(
        "transport \"ucx\" was asked for but this build has no UCX (configure with -DPSHARD_WITH_UCX=ON)");
  }
  if (options.link_scope != "node" && options.link_scope != "connection") {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown link scope \"", options.link_scope, "\"; expected node or connection"));
  }
  std::unique_ptr<ShardClient> client(new ShardClient(options));
  const int n = static_cast<int>(options.server_addresses.size());
  client->shards_.resize(n);
  const grpc::ChannelArguments args = ServerChannelArguments(64 << 20);
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<v1::ShardService::Stub>> stubs;
  JoinSpec join;
  for (const std::string& address : options.server_addresses) {
    channels.push_back(options.security ? options.security->NewChannel(address, args)
                                        : grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
    stubs.push_back(v1::ShardService::NewStub(channels.back()));
    join.stubs.push_back(stubs.back().get());
  }
  join.addresses = options.server_addresses;
  for (const std::string& address : options.server_addresses) {
    auto previous = options.previous_sessions.find(address);
    join.previous_tokens.push_back(previous == options.previous_sessions.end() ? 0 : previous->second);
  }
  join.trainer_rank = options.trainer_rank;
  join.metrics_address = options.metrics_address;
  if (options.trainer_rank >= 0) join.grad_format = options.encodings.grad_format();
  join.timeout = options.join_timeout;
  join.resolve_grace = options.join_resolve_grace;
  join.log_every = options.join_log_every;
  join.log = options.join_log;
  // Every answer is checked as it arrives: a server of another job ends the
  // join at once, whatever the others are doing.
  uint64_t fingerprint = 0;
  std::optional<size_t> first;
  std::vector<int64_t> joined_steps(n, 0);
  join.accept = [&](size_t i, const v1::JoinResponse& joined) -> absl::Status {
    const std::string& address = options.server_addresses[i];
    ASSIGN_OR_RETURN(JobConfig job, JobFromProto(joined.job()));
    if (job.num_shards != n) {
      return absl::FailedPreconditionError(absl::StrCat(
          address, " belongs to a job of ", job.num_shards, " shards but ", n, " addresses were given"));
    }
    const int index = joined.shard_index();
    if (index < 0 || index >= n || client->shards_[index] != nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat(address, " reports shard index ", index, ", which is out of range or taken"));
    }
    if (!first) {
      first = i;
      fingerprint = joined.job_fingerprint();
      client->job_ = job;
    } else if (joined.job_fingerprint() != fingerprint) {
      return absl::FailedPreconditionError(absl::StrCat(
          address, " runs a different job from ", options.server_addresses[*first],
          " (model, optimizer, seed or counts differ)"));
    }
    joined_steps[index] = joined.current_step();
    client->shards_[index] = std::make_unique<Shard>();
    client->shards_[index]->address = address;
    client->shards_[index]->channel = channels[i];
    client->shards_[index]->stub = std::move(stubs[i]);
    client->shards_[index]->ucx_address = joined.ucx_address();
    client->shards_[index]->session_token = joined.session_token();
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(JoinServers(join).status());
  {
    std::vector<v1::ShardService::Stub*> stubs;
    std::vector<std::string> addresses;
    for (const auto& shard : client->shards_) {
      stubs.push_back(shard->stub.get());
      addresses.push_back(shard->address);
    }
    ASSIGN_OR_RETURN(client->joined_step_,
                     AgreedStep(stubs, addresses, std::move(joined_steps), options.roll_back_to_common_step,
                                fingerprint, options.trainer_rank));
  }
  RETURN_IF_ERROR(client->CreateTransports());
  if (options.trainer_rank >= client->job_.num_trainers) {
    return absl::InvalidArgumentError(absl::StrCat("trainer rank ", options.trainer_rank,
                                                   " is outside [0, ", client->job_.num_trainers, ")"));
  }
  ASSIGN_OR_RETURN(client->layout_, MakeJobLayout(client->job_));
  return client;
}

std::string ShardClient::PreferredTransport(const std::string& address) const {
  auto it = options_.transport_by_address.find(address);
  return it == options_.transport_by_address.end() ? options_.transport : it->second;
}

absl::Status ShardClient::CreateTransports() {
#if PSHARD_WITH_UCX
  bool strict = false;     // some link must be UCX
  bool wants_ucx = false;  // some link may be UCX
  for (const auto& shard : shards_) {
    const std::string preferred = PreferredTransport(shard->address);
    strict |= preferred == "ucx";
    wants_ucx |= preferred != "grpc" && !shard->ucx_address.empty();
  }
  if (wants_ucx) {
    absl::StatusOr<std::unique_ptr<UcxContext>> ucx = UcxContext::Create();
    if (ucx.ok()) {
      ucx_ = std::move(*ucx);
    } else if (strict) {
      return absl::Status(ucx.status().code(), absl::StrCat("transport ucx: ", ucx.status().message()));
    } else {
      std::fprintf(stderr, "pshard-trainer: warning: UCX cannot start here (%s); using gRPC for every link\n",
                   std::string(ucx.status().message()).c_str());
    }
  }
#endif
  for (size_t s = 0; s < shards_.size(); ++s) {
    Shard& shard = *shards_[s];
    const std::string preferred = PreferredTransport(shard.address);
    if (preferred == "ucx" && shard.ucx_address.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "transport ucx: shard ", s, " (", shard.address,
          ") offers no UCX address (built without UCX, started with --ucx=false, or its UCX failed)"));
    }
#if PSHARD_WITH_UCX
    if (ucx_ != nullptr && !shard.ucx_address.empty() && preferred != "grpc") {
      UcxTransport::Spec spec;
      spec.context = ucx_.get();
      spec.shard = static_cast<int>(s);
      spec.address = shard.address;
      spec.ucx_address = shard.ucx_address;
      spec.session_token = shard.session_token;
      spec.rpc_timeout = options_.rpc_timeout;
      spec.control_channel = shard.channel;
      absl::StatusOr<std::unique_ptr<UcxTransport>> transport = UcxTransport::Create(spec);
      if (transport.ok()) {
        shard.transport = std::move(*transport);
        RETURN_IF_ERROR(EmulateLink(static_cast<int>(s)));
        continue;
      }
      if (preferred == "ucx") return transport.status();
      std::fprintf(stderr, "pshard-trainer: warning: %s; using gRPC for this link\n",
                   std::string(transport.status().message()).c_str());
    }
#endif
    GrpcTransport::Spec spec;
    spec.channel = shard.channel;
    spec.shard = static_cast<int>(s);
    spec.address = shard.address;
    spec.rpc_timeout = options_.rpc_timeout;
    spec.chunk_bytes = options_.chunk_bytes;
    shard.transport = std::make_unique<GrpcTransport>(spec);
    RETURN_IF_ERROR(EmulateLink(static_cast<int>(s)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<LinkBucket>> ShardClient::Bucket(const std::string& name, int slot, bool local) {
  const std::string key = absl::StrCat(name, "/", slot);
  if (auto it = buckets_.find(key); it != buckets_.end()) return it->second;
  std::shared_ptr<LinkBucket> bucket;
  if (!options_.link_dir.empty()) {
    ASSIGN_OR_RETURN(bucket, LinkBucket::Shared(absl::StrCat(options_.link_dir, "/", name, ".link"), slot));
  } else if (local) {
    bucket = LinkBucket::InProcess();
  }
  buckets_[key] = bucket;
  return bucket;
}

std::string ShardClient::TrainerNode() const {
  return options_.node.empty() ? absl::StrCat("trainer-", options_.trainer_rank) : options_.node;
}

absl::Status ShardClient::EmulateLink(int s) {
  Shard& shard = *shards_[s];
  auto named = options_.node_by_address.find(shard.address);
  const std::string server_node =
      named != options_.node_by_address.end() ? named->second : absl::StrCat("server-", s);
  const std::string trainer_node = TrainerNode();
  if (server_node == trainer_node) return absl::OkStatus();  // on the node: no network between them
  auto own_link = options_.link_to_node.find(server_node);
  const LinkSpec& spec = own_link != options_.link_to_node.end() ? own_link->second : options_.link;
  if (!spec.enabled()) return absl::OkStatus();
  using Slot = std::tuple<std::string, int, bool, std::vector<std::shared_ptr<LinkBucket>>*>;
  LinkPath path;
  std::vector<Slot> slots;
  if (options_.link_scope == "connection") {
    path.down.push_back(LinkBucket::InProcess());
    path.up.push_back(LinkBucket::InProcess());
  } else if (own_link != options_.link_to_node.end()) {
    // The node pair's own link, named in sorted order.
    const bool trainer_first = trainer_node < server_node;
    const std::string pair = trainer_first ? absl::StrCat(trainer_node, "~", server_node)
                                           : absl::StrCat(server_node, "~", trainer_node);
    slots = {Slot{pair, trainer_first ? 1 : 0, true, &path.down}, Slot{pair, trainer_first ? 0 : 1, true, &path.up}};
  } else {
    // Each node's interface: slot 0 what it sends, slot 1 what it receives.
    slots = {Slot{server_node, 0, false, &path.down}, Slot{trainer_node, 1, true, &path.down},
             Slot{trainer_node, 0, true, &path.up}, Slot{server_node, 1, false, &path.up}};
  }
  for (const auto& [name, slot, local, list] : slots) {
    ASSIGN_OR_RETURN(std::shared_ptr<LinkBucket> bucket, Bucket(name, slot, local));
    if (bucket != nullptr) list->push_back(std::move(bucket));
  }
  const uint64_t seed = (static_cast<uint64_t>(options_.trainer_rank + 1) << 32) | static_cast<uint64_t>(s);
  shard.transport = std::make_unique<EmulatedTransport>(std::move(shard.transport), spec, std::move(path), &timer_,
                                                         seed);
  return absl::OkStatus();
}

std::string ShardClient::transport_name(int shard) const { return shards_[shard]->transport->name(); }
std::string ShardClient::transport_description(int shard) const {
  return shards_[shard]->transport->description();
}

std::vector<std::string> ShardClient::shard_addresses() const {
  std::vector<std::string> out;
  for (const auto& shard : shards_) out.push_back(shard->address);
  return out;
}

namespace {

// `shards`, or every shard when unset.
std::vector<int> ShardsOrAll(const std::optional<std::vector<int>>& shards, int n) {
  if (shards) return *shards;
  std::vector<int> all(n);
  for (int s = 0; s < n; ++s) all[s] = s;
  return all;
}

}  // namespace

std::shared_ptr<UnitTransfer> ShardClient::StartFetch(int unit, int64_t version,
                                                      const std::optional<std::vector<int>>& shards) {
  const std::vector<int> targets = ShardsOrAll(shards, static_cast<int>(shards_.size()));
  auto transfer = std::make_shared<UnitTransfer>(static_cast<int>(targets.size()), pool_);
  const UnitPartition& p = layout_.partitions[unit];
  transfer->values_ = pool_->Take(p.padded_numel());
  Track(transfer);
  for (int s : targets) {
    const SliceRange slice = p.Slice(s);
    FetchArgs args{unit, version, options_.encodings.weight_format(), options_.trainer_rank, slice,
                   transfer->cancel_scope()};
    const auto payload = static_cast<int64_t>(args.format.EncodedBytes(static_cast<size_t>(slice.length)));
    shards_[s]->transport->Fetch(args, transfer->values_.data() + slice.begin,
                                 [transfer, payload](absl::Status status, int64_t bytes) {
                                   transfer->PartDone(std::move(status), bytes, payload);
                                 });
  }
  return transfer;
}

std::vector<float> ShardClient::GradientBuffer(int unit) {
  std::vector<float> buffer = pool_->Take(static_cast<size_t>(layout_.partitions[unit].padded_numel()));
  std::fill(buffer.begin(), buffer.end(), 0.0f);
  return buffer;
}

std::shared_ptr<UnitTransfer> ShardClient::StartPush(int unit, int64_t step, std::vector<float> grads,
                                                     const PushOptions& push) {
  const std::vector<int> targets = ShardsOrAll(push.shards, static_cast<int>(shards_.size()));
  auto transfer = std::make_shared<UnitTransfer>(static_cast<int>(targets.size()));
  const UnitPartition& p = layout_.partitions[unit];
  if (static_cast<int64_t>(grads.size()) != p.padded_numel()) {
    for (size_t i = 0; i < targets.size(); ++i) {
      transfer->PartDone(absl::InvalidArgumentError(absl::StrCat("gradient of unit ", unit, " has ", grads.size(),
                                                                 " elements; expected ", p.padded_numel())),
                         0);
    }
    return transfer;
  }
  const WireFormat format = options_.encodings.grad_format();
  std::vector<char> non_finite(targets.size(), 0);
  if (format.quantized()) {
    absl::MutexLock lock(&residual_mu_);
    std::vector<float>* residual = nullptr;
    if (options_.error_feedback) {
      residuals_.resize(layout_.partitions.size());
      residual = &residuals_[unit];
      if (residual->empty()) residual->assign(grads.size(), 0.0f);
    }
    std::vector<float> sent;
    for (size_t i = 0; i < targets.size(); ++i) {
      const SliceRange slice = p.Slice(targets[i]);
      const std::span<float> g(grads.data() + slice.begin, slice.length);
      non_finite[i] = QuantizeWithFeedback(format, g, residual == nullptr ? std::span<float>()
                                                           : std::span<float>(residual->data() + slice.begin, slice.length),
                                          &sent) ? 0 : 1;
    }
  }
  // Back to the pool when the last transport lets go of it.
  std::shared_ptr<const std::vector<float>> shared(
      new std::vector<float>(std::move(grads)), [pool = std::weak_ptr<BufferPool>(pool_)](const std::vector<float>* v) {
        std::unique_ptr<std::vector<float>> owned(const_cast<std::vector<float>*>(v));
        if (std::shared_ptr<BufferPool> p = pool.lock()) p->Give(std::move(*owned));
      });
  Track(transfer);
  for (size_t i = 0; i < targets.size(); ++i) {
    const int s = targets[i];
    PushArgs args{unit, step, format, push.first_rank >= 0 ? push.first_rank : options_.trainer_rank,
                  push.rank_count, push.micro_batch, p.Slice(s), non_finite[i] != 0, transfer->cancel_scope()};
    const auto payload = static_cast<int64_t>(format.EncodedBytes(static_cast<size_t>(args.slice.length)));
    shards_[s]->transport->Push(args, shared, [transfer, payload](absl::Status status, int64_t bytes) {
      transfer->PartDone(std::move(status), bytes, payload);
    });
  }
  return transfer;
}

std::span<float> ShardClient::GroupResidual(int unit) {
  if (!options_.error_feedback || !options_.encodings.grad_format().quantized()) return {};
  absl::MutexLock lock(&residual_mu_);
  residuals_.resize(layout_.partitions.size());
  std::vector<float>& residual = residuals_[unit];
  if (residual.empty()) residual.assign(layout_.partitions[unit].padded_numel(), 0.0f);
  return residual;
}

absl::flat_hash_map<std::string, uint64_t> ShardClient::sessions() const {
  absl::flat_hash_map<std::string, uint64_t> tokens;
  for (const auto& shard : shards_) {
    if (shard) tokens[shard->address] = shard->session_token;
  }
  return tokens;
}

int64_t ShardClient::residual_bytes() const {
  absl::MutexLock lock(&residual_mu_);
  int64_t bytes = 0;
  for (const auto& r : residuals_) bytes += static_cast<int64_t>(r.size() * sizeof(float));
  return bytes;
}

absl::StatusOr<std::vector<std::string>> ShardClient::Rendezvous(const std::string& group, int member, int size,
                                                                const std::string& payload, absl::Duration timeout) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  v1::RendezvousRequest request;
  request.set_group(group);
  request.set_member(member);
  request.set_size(size);
  request.set_payload(payload);
  v1::RendezvousResponse response;
  grpc::Status st = shards_[0]->stub->Rendezvous(&ctx, request, &response);
  if (!st.ok()) {
    return absl::Status(FromGrpcStatus(st).code(),
                        absl::StrCat("rendezvous at ", shards_[0]->address, ": ", st.error_message()));
  }
  return std::vector<std::string>(response.payloads().begin(), response.payloads().end());
}

absl::StatusOr<std::vector<float>> ShardClient::ReadMasterUnit(int unit, std::optional<int64_t> version) {
  if (unit < 0 || unit >= static_cast<int>(layout_.partitions.size())) {
    return absl::InvalidArgumentError(absl::StrCat("unknown unit ", unit));
  }
  if (version) RETURN_IF_ERROR(StartFetch(unit, *version)->Wait());  // waits until published
  const UnitPartition& p = layout_.partitions[unit];
  std::vector<float> out(p.padded_numel());
  for (size_t s = 0; s < shards_.size(); ++s) {
    const SliceRange slice = p.Slice(static_cast<int>(s));
    // Page by page; every page must be of one version (a step applied
    // meanwhile starts the slice again, a few times at most).
    std::optional<int64_t> slice_version;
    for (int64_t offset = 0, restarts = 0; offset < slice.length;) {
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
      v1::ReadMasterRequest request;
      request.set_unit(unit);
      request.set_offset(offset);
      v1::ReadMasterResponse response;
      grpc::Status st = shards_[s]->stub->ReadMaster(&ctx, request, &response);
      if (!st.ok()) {
        return absl::Status(FromGrpcStatus(st).code(),
                            absl::StrCat("read master of unit ", unit, " from ", shards_[s]->address, ": ",
                                         st.error_message()));
      }
      if (version && response.version() != *version) {
        return absl::FailedPreconditionError(absl::StrCat("unit ", unit, " on ", shards_[s]->address,
                                                          " is at version ", response.version(), ", not ", *version));
      }
      const size_t bytes = response.data().size();
      if (response.slice_length() != slice.length || response.offset() != offset || bytes % sizeof(float) != 0 ||
          bytes == 0 || offset + static_cast<int64_t>(bytes / sizeof(float)) > slice.length) {
        return absl::DataLossError(absl::StrCat("master slice of unit ", unit, " from ", shards_[s]->address,
                                                " has the wrong size"));
      }
      if (slice_version && *slice_version != response.version()) {
        if (++restarts > 3) {
          return absl::AbortedError(absl::StrCat("unit ", unit, " on ", shards_[s]->address,
                                                 " changed version while being read, ", restarts, " times"));
        }
        slice_version.reset();
        offset = 0;
        continue;
      }
      slice_version = response.version();
      std::memcpy(out.data() + slice.begin + offset, response.data().data(), bytes);
      offset += static_cast<int64_t>(bytes / sizeof(float));
    }
  }
  out.resize(p.numel);
  return out;
}

}  // namespace pshard
