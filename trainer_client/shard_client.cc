#include "trainer_client/shard_client.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "proto/rpc_util.h"
#include "proto/shard.grpc.pb.h"

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
  absl::MutexLock lock(&mu_);
  if (free_.size() >= max_free_) free_.erase(free_.begin());
  free_.push_back(std::move(buffer));
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

void UnitTransfer::PartDone(absl::Status status, int64_t wire_bytes) {
  absl::MutexLock lock(&mu_);
  if (status_.ok() && !status.ok()) status_ = std::move(status);
  wire_bytes_ += wire_bytes;
  if (--remaining_ == 0) finished_ = absl::Now();
}

// ---- per-shard connection and reactors ----

struct ShardClient::Shard {
  std::string address;
  std::unique_ptr<v1::ShardService::Stub> stub;
  std::unique_ptr<EmulatedLink> down;  // server -> trainer
  std::unique_ptr<EmulatedLink> up;    // trainer -> server
};

namespace {

// Enough free buffers for a few prefetched units of each size.
constexpr size_t kPooledBuffers = 8;

std::string Where(int shard, const std::string& address) {
  return absl::StrCat("shard ", shard, " (", address, ")");
}

// Reads one shard's slice of a unit into its place in the unit buffer.
class FetchPart final : public grpc::ClientReadReactor<v1::FetchChunk> {
 public:
  FetchPart(v1::ShardService::Stub* stub, std::shared_ptr<UnitTransfer> transfer, int shard,
            std::string address, const SliceRange& slice, int unit, int64_t version,
            WireEncoding encoding, int trainer, absl::Duration timeout, EmulatedLink* up,
            EmulatedLink* down, DeadlineTimer* timer)
      : transfer_(std::move(transfer)), shard_(shard), address_(std::move(address)), slice_(slice),
        unit_(unit), version_(version), encoding_(encoding), down_(down), timer_(timer) {
    ctx_.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    request_.set_unit(unit);
    request_.set_version(version);
    request_.set_encoding(EncodingToProto(encoding));
    request_.set_trainer_rank(trainer);
    request_arrival_ = up->Admit(static_cast<int64_t>(request_.ByteSizeLong()));
    stub->async()->Fetch(&ctx_, &request_, this);
    StartRead(&chunk_);
    StartCall();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // OnDone follows with the final status
    if (absl::Status s = Accept(); !s.ok()) {
      error_ = s;
      ctx_.TryCancel();
      return;
    }
    // On an emulated link the chunk is usable only once it has "arrived";
    // reading the next one waits until then (flow control does the rest).
    arrival_ = down_->Admit(static_cast<int64_t>(chunk_.ByteSizeLong()), request_arrival_);
    if (arrival_ <= absl::Now()) return StartRead(&chunk_);
    AddHold();
    timer_->Schedule(arrival_, [this] {
      StartRead(&chunk_);
      RemoveHold();
    });
  }

  void OnDone(const grpc::Status& status) override {
    absl::Status result = error_;
    if (result.ok()) result = FromGrpcStatus(status);
    if (result.ok() && received_ != slice_.length) {
      result = absl::DataLossError(absl::StrCat("stream ended after ", received_, " of ",
                                                slice_.length, " elements"));
    }
    if (result.ok() && crc_ != expected_crc_) {
      result = absl::DataLossError(absl::StrCat("checksum mismatch: got ", crc_, ", published ",
                                                expected_crc_));
    }
    if (!result.ok()) {
      result = absl::Status(result.code(), absl::StrCat("fetch of unit ", unit_, " version ", version_,
                                                        " from ", Where(shard_, address_), ": ",
                                                        result.message()));
    }
    if (arrival_ > absl::Now()) {
      timer_->Schedule(arrival_, [transfer = transfer_, result, bytes = wire_bytes_]() mutable {
        transfer->PartDone(std::move(result), bytes);
      });
    } else {
      transfer_->PartDone(std::move(result), wire_bytes_);
    }
    delete this;
  }

 private:
  absl::Status Accept() {
    if (received_ == 0) {
      if (chunk_.slice_length() != slice_.length || chunk_.version() != version_) {
        return absl::FailedPreconditionError(absl::StrCat(
            "server sent slice of ", chunk_.slice_length(), " elements at version ", chunk_.version(),
            "; expected ", slice_.length, " at version ", version_));
      }
      expected_crc_ = chunk_.checksum();
    }
    const size_t width = BytesPerElement(encoding_);
    const int64_t count = static_cast<int64_t>(chunk_.data().size() / width);
    if (chunk_.offset() != received_ || chunk_.data().size() % width != 0 ||
        received_ + count > slice_.length) {
      return absl::DataLossError(absl::StrCat("malformed chunk at element ", chunk_.offset()));
    }
    crc_ = Crc32c(chunk_.data().data(), chunk_.data().size(), crc_);
    DecodeElements(encoding_, reinterpret_cast<const std::byte*>(chunk_.data().data()),
                   std::span<float>(transfer_->values().data() + slice_.begin + received_, count));
    received_ += count;
    wire_bytes_ += static_cast<int64_t>(chunk_.ByteSizeLong());
    return absl::OkStatus();
  }

  std::shared_ptr<UnitTransfer> transfer_;
  const int shard_;
  const std::string address_;
  const SliceRange slice_;
  const int unit_;
  const int64_t version_;
  const WireEncoding encoding_;
  EmulatedLink* const down_;
  DeadlineTimer* const timer_;
  absl::Time request_arrival_;
  absl::Time arrival_ = absl::InfinitePast();
  grpc::ClientContext ctx_;
  v1::FetchRequest request_;
  v1::FetchChunk chunk_;
  absl::Status error_;
  int64_t received_ = 0;
  uint32_t crc_ = 0;
  uint32_t expected_crc_ = 0;
  int64_t wire_bytes_ = 0;
};

// Streams one shard's slice of a gradient to its owner.
class PushPart final : public grpc::ClientWriteReactor<v1::PushChunk> {
 public:
  PushPart(v1::ShardService::Stub* stub, std::shared_ptr<UnitTransfer> transfer,
           std::shared_ptr<const std::vector<float>> grads, int shard, std::string address,
           const SliceRange& slice, int unit, int64_t step, WireEncoding encoding, int trainer,
           int64_t chunk_bytes, absl::Duration timeout, EmulatedLink* up, EmulatedLink* down,
           DeadlineTimer* timer, int micro_batch, int rank_count)
      : transfer_(std::move(transfer)), grads_(std::move(grads)), shard_(shard),
        address_(std::move(address)), slice_(slice), unit_(unit), step_(step), encoding_(encoding),
        up_(up), down_(down), timer_(timer),
        chunk_elements_(std::max<int64_t>(1, chunk_bytes / static_cast<int64_t>(BytesPerElement(encoding)))) {
    ctx_.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    chunk_.set_trainer_rank(trainer);
    chunk_.set_step(step);
    chunk_.set_unit(unit);
    chunk_.set_encoding(EncodingToProto(encoding));
    chunk_.set_slice_length(slice.length);
    chunk_.set_micro_batch(micro_batch);
    chunk_.set_rank_count(rank_count);
    stub->async()->Push(&ctx_, &response_, this);
    WriteNext();
    StartCall();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return;  // the call failed; OnDone reports why
    WriteNext();
  }

  void OnDone(const grpc::Status& status) override {
    absl::Status result = FromGrpcStatus(status);
    if (!result.ok()) {
      result = absl::Status(result.code(), absl::StrCat("push of unit ", unit_, " step ", step_, " to ",
                                                        Where(shard_, address_), ": ", result.message()));
    } else if (response_.disposition() == v1::PushResponse::ACCEPTED_NON_FINITE) {
      std::fprintf(stderr, "pshard-trainer: %s: %s\n", Where(shard_, address_).c_str(),
                   response_.detail().c_str());
    }
    // The response travels back over the emulated link too.
    const absl::Time arrival = down_->Admit(static_cast<int64_t>(response_.ByteSizeLong()));
    if (arrival > absl::Now()) {
      timer_->Schedule(arrival, [transfer = transfer_, result, bytes = wire_bytes_]() mutable {
        transfer->PartDone(std::move(result), bytes);
      });
    } else {
      transfer_->PartDone(std::move(result), wire_bytes_);
    }
    delete this;
  }

 private:
  void WriteNext() {
    if (offset_ >= slice_.length) {
      StartWritesDone();
      return;
    }
    const int64_t count = std::min(chunk_elements_, slice_.length - offset_);
    std::string* data = chunk_.mutable_data();
    data->resize(count * BytesPerElement(encoding_));
    EncodeElements(encoding_, std::span<const float>(grads_->data() + slice_.begin + offset_, count),
                   reinterpret_cast<std::byte*>(data->data()));
    chunk_.set_chunk_index(index_++);
    chunk_.set_offset(offset_);
    offset_ += count;
    wire_bytes_ += static_cast<int64_t>(chunk_.ByteSizeLong());
    // On an emulated link the chunk reaches the server when it has crossed it.
    const absl::Time arrival = up_->Admit(static_cast<int64_t>(chunk_.ByteSizeLong()));
    if (arrival <= absl::Now()) return StartWrite(&chunk_);
    AddHold();
    timer_->Schedule(arrival, [this] {
      StartWrite(&chunk_);
      RemoveHold();
    });
  }

  std::shared_ptr<UnitTransfer> transfer_;
  std::shared_ptr<const std::vector<float>> grads_;
  const int shard_;
  const std::string address_;
  const SliceRange slice_;
  const int unit_;
  const int64_t step_;
  const WireEncoding encoding_;
  EmulatedLink* const up_;
  EmulatedLink* const down_;
  DeadlineTimer* const timer_;
  const int64_t chunk_elements_;
  grpc::ClientContext ctx_;
  v1::PushChunk chunk_;
  v1::PushResponse response_;
  int64_t offset_ = 0;
  int index_ = 0;
  int64_t wire_bytes_ = 0;
};

absl::StatusOr<v1::JoinResponse> JoinOne(v1::ShardService::Stub* stub, const std::string& address,
                                         int rank, const std::string& metrics_address, absl::Time deadline) {
  while (true) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(std::min(deadline, absl::Now() + absl::Seconds(5))));
    ctx.set_wait_for_ready(true);  // the server may still be starting
    v1::JoinRequest request;
    request.set_trainer_rank(rank);
    request.set_metrics_address(metrics_address);
    v1::JoinResponse response;
    grpc::Status s = stub->Join(&ctx, request, &response);
    if (s.ok()) return response;
    if (s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED &&
        s.error_code() != grpc::StatusCode::UNAVAILABLE) {
      return absl::Status(FromGrpcStatus(s).code(),
                          absl::StrCat("join ", address, ": ", s.error_message()));
    }
    if (absl::Now() >= deadline) {
      return absl::UnavailableError(
          absl::StrCat("join ", address, ": no answer before the join deadline (", s.error_message(), ")"));
    }
  }
}

}  // namespace

ShardClient::ShardClient(Options options)
    : options_(std::move(options)), pool_(std::make_shared<BufferPool>(kPooledBuffers)) {}
ShardClient::~ShardClient() = default;

absl::StatusOr<std::unique_ptr<ShardClient>> ShardClient::Connect(Options options) {
  if (options.server_addresses.empty()) return absl::InvalidArgumentError("no shard server addresses given");
  std::unique_ptr<ShardClient> client(new ShardClient(options));
  const int n = static_cast<int>(options.server_addresses.size());
  client->shards_.resize(n);
  const absl::Time deadline = absl::Now() + options.join_timeout;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  uint64_t fingerprint = 0;
  bool first = true;
  for (const std::string& address : options.server_addresses) {
    auto stub = v1::ShardService::NewStub(
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
    ASSIGN_OR_RETURN(v1::JoinResponse joined, JoinOne(stub.get(), address, options.trainer_rank, options.metrics_address, deadline));
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
    if (first) {
      first = false;
      fingerprint = joined.job_fingerprint();
      client->job_ = job;
    } else if (joined.job_fingerprint() != fingerprint) {
      return absl::FailedPreconditionError(absl::StrCat(
          address, " runs a different job from ", options.server_addresses[0],
          " (model, optimizer, seed or counts differ)"));
    }
    client->joined_step_ = std::max<int64_t>(client->joined_step_, joined.current_step());
    client->shards_[index] = std::make_unique<Shard>();
    client->shards_[index]->address = address;
    client->shards_[index]->stub = std::move(stub);
    client->shards_[index]->down = std::make_unique<EmulatedLink>(options.link, 2 * index);
    client->shards_[index]->up = std::make_unique<EmulatedLink>(options.link, 2 * index + 1);
  }
  if (options.trainer_rank >= client->job_.num_trainers) {
    return absl::InvalidArgumentError(absl::StrCat("trainer rank ", options.trainer_rank,
                                                   " is outside [0, ", client->job_.num_trainers, ")"));
  }
  ASSIGN_OR_RETURN(client->layout_, MakeJobLayout(client->job_));
  return client;
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
  for (int s : targets) {
    new FetchPart(shards_[s]->stub.get(), transfer, s, shards_[s]->address, p.Slice(s), unit, version,
                  options_.encoding, options_.trainer_rank, options_.rpc_timeout, shards_[s]->up.get(),
                  shards_[s]->down.get(), &timer_);
  }
  return transfer;
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
  auto shared = std::make_shared<const std::vector<float>>(std::move(grads));
  for (int s : targets) {
    new PushPart(shards_[s]->stub.get(), transfer, shared, s, shards_[s]->address, p.Slice(s), unit, step,
                 options_.encoding, push.first_rank >= 0 ? push.first_rank : options_.trainer_rank,
                 options_.chunk_bytes, options_.rpc_timeout,
                 shards_[s]->up.get(), shards_[s]->down.get(), &timer_, push.micro_batch, push.rank_count);
  }
  return transfer;
}

absl::StatusOr<std::vector<float>> ShardClient::ReadMasterUnit(int unit) {
  if (unit < 0 || unit >= static_cast<int>(layout_.partitions.size())) {
    return absl::InvalidArgumentError(absl::StrCat("unknown unit ", unit));
  }
  const UnitPartition& p = layout_.partitions[unit];
  std::vector<float> out(p.padded_numel());
  for (size_t s = 0; s < shards_.size(); ++s) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
    v1::ReadMasterRequest request;
    request.set_unit(unit);
    v1::ReadMasterResponse response;
    grpc::Status st = shards_[s]->stub->ReadMaster(&ctx, request, &response);
    if (!st.ok()) {
      return absl::Status(FromGrpcStatus(st).code(),
                          absl::StrCat("read master of unit ", unit, " from ", shards_[s]->address, ": ",
                                       st.error_message()));
    }
    const SliceRange slice = p.Slice(static_cast<int>(s));
    if (response.data().size() != static_cast<size_t>(slice.length) * sizeof(float)) {
      return absl::DataLossError(absl::StrCat("master slice of unit ", unit, " from ",
                                              shards_[s]->address, " has the wrong size"));
    }
    std::memcpy(out.data() + slice.begin, response.data().data(), response.data().size());
  }
  out.resize(p.numel);
  return out;
}

}  // namespace pshard
