#include "shard_server/grpc/grpc_service.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/copy.h"
#include "proto/chunk_frame.h"
#include "proto/rpc_util.h"

namespace pshard {
namespace {

// Streams one slice at one version, chunk by chunk, once it is published.
// Each chunk's data is a slice over the published bytes: nothing is copied
// here, and the version's bytes stay alive while gRPC still holds a chunk.
class FetchReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  FetchReactor(ShardState* state, ServerMetrics* metrics, const grpc::ByteBuffer& request_frame,
               absl::Time wait_deadline, int64_t chunk_bytes, bool adds_format, ConnectionCaps* waiting,
               const std::string& connection)
      : state_(state), metrics_(metrics), start_(absl::Now()), adds_format_(adds_format) {
    absl::StatusOr<std::shared_ptr<ConnectionCaps::Place>> place =
        waiting != nullptr ? waiting->Take(connection, 1) : nullptr;
    if (!place.ok()) {
      FinishWith(place.status());
      return;
    }
    absl::Status status = ParseMessage(request_frame, &request_);
    absl::StatusOr<WireFormat> format = WireFormat();
    if (status.ok()) {
      format = WeightFormatFromProto(request_.encoding(), request_.quant_block());
      status = format.status();
    }
    if (status.ok()) status = state->CheckFetch(request_.unit(), request_.version(), request_.trainer_rank());
    if (!status.ok()) {
      FinishWith(status);
      return;
    }
    bytes_out_ = &metrics->bytes_out(request_.trainer_rank());
    format_ = *format;
    slice_length_ = state->slice_length(request_.unit());
    chunk_elements_ = static_cast<int64_t>(format_.ElementsPerPiece(static_cast<size_t>(chunk_bytes)));
    // The place is given back once the wait ends (published, deadline, or
    // cancelled); streaming the slice does not count.
    waiter_ = std::make_shared<OneShotWaiter>([this, place = *std::move(place)](absl::Status s) mutable {
      place.reset();
      if (!s.ok()) return FinishWith(s);
      absl::StatusOr<std::shared_ptr<const PublishedSlice>> slice =
          state_->Published(request_.unit(), request_.version(), format_, adds_format_);
      if (!slice.ok()) return FinishWith(slice.status());
      slice_ = std::move(*slice);
      WriteNext();
    });
    state->WhenPublished(request_.unit(), request_.version(), wait_deadline, waiter_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return FinishWith(absl::CancelledError("client went away"));
    bytes_out_->Increment(static_cast<double>(frame_.Length()));
    WriteNext();
  }
  void OnCancel() override {
    if (waiter_) waiter_->Fire(absl::CancelledError("fetch cancelled while waiting"));
  }
  void OnDone() override {
    metrics_->rpc_seconds(RpcMethod::kFetch).Observe(absl::ToDoubleSeconds(absl::Now() - start_));
    delete this;
  }

 private:
  void FinishWith(const absl::Status& status) {
    if (!status.ok()) metrics_->Reject(status);
    Finish(ToGrpcStatus(status));
  }

  void WriteNext() {
    if (offset_ >= slice_length_) return FinishWith(absl::OkStatus());
    const int64_t count = std::min(chunk_elements_, slice_length_ - offset_);
    const size_t from = format_.EncodedBytes(offset_);
    const size_t bytes = format_.EncodedBytes(offset_ + count) - from;
    v1::FetchChunk header;
    if (offset_ == 0) {
      header.set_checksum(slice_->checksum());
      header.set_slice_length(slice_length_);
      header.set_version(request_.version());
    }
    header.set_offset(offset_);
    frame_ = MakeFrame(header, kFetchChunkDataField,
                       SliceOver(slice_->bytes().subspan(from, bytes), slice_));
    offset_ += count;
    StartWrite(&frame_);
  }

  ShardState* const state_;
  ServerMetrics* const metrics_;
  v1::FetchRequest request_;
  const absl::Time start_;
  const bool adds_format_;  // false for a reader: see ShardState::Published
  metrics::Counter* bytes_out_ = nullptr;
  WireFormat format_;
  int64_t slice_length_ = 0;
  int64_t chunk_elements_ = 0;
  int64_t offset_ = 0;
  grpc::ByteBuffer frame_;
  std::shared_ptr<OneShotWaiter> waiter_;
  std::shared_ptr<const PublishedSlice> slice_;  // the version's bytes, held while streaming
};

// Receives one gradient slice; commits it only once it is complete.
// Each chunk's data is moved once, from the slices gRPC received it in into
// the reduction's buffer.
class PushReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  PushReactor(ShardState* state, ServerMetrics* metrics, grpc::CallbackServerContext* ctx,
              grpc::ByteBuffer* response, ConnectionCaps* push_bytes)
      : state_(state), metrics_(metrics), ctx_(ctx), response_frame_(response), push_bytes_(push_bytes),
        start_(absl::Now()) {
    StartRead(&frame_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) return Complete();
    absl::Status s = ParseFrame(frame_, kPushChunkDataField, &chunk_, &data_);
    if (s.ok()) s = Accept();
    frame_.Clear();
    data_ = FrameData();
    if (!s.ok()) return FinishWith(s);
    StartRead(&frame_);
  }
  void OnDone() override {
    metrics_->rpc_seconds(RpcMethod::kPush).Observe(absl::ToDoubleSeconds(absl::Now() - start_));
    delete this;
  }

 private:
  void FinishWith(const absl::Status& status) {
    if (!status.ok()) metrics_->Reject(status);
    if (status.ok()) *response_frame_ = SerializeMessage(response_);
    Finish(ToGrpcStatus(status));
  }

  absl::Status Accept() {
    if (chunks_ == 0) {
      first_ = chunk_;
      absl::StatusOr<WireFormat> format = FormatFromProto(chunk_.encoding(), chunk_.quant_block());
      if (!format.ok()) return format.status();
      format_ = *format;
      if (absl::Status s = state_->CheckPush(Identity()); !s.ok()) return s;
      if (absl::Status s = state_->CheckPushFormat(Identity(), format_); !s.ok()) return s;
      const int64_t expected = state_->slice_length(chunk_.unit());
      if (chunk_.slice_length() != expected) {
        return absl::InvalidArgumentError(absl::StrCat(
            "wrong length: push of unit ", chunk_.unit(), " declares ", chunk_.slice_length(),
            " elements; this shard's slice has ", expected));
      }
      // Room for the whole slice, not filled: its pages take memory as
      // chunks are written into them, so a push that stops early holds
      // about what arrived, and what all unfinished pushes hold is capped
      // (ConnectionCaps).
      expected_ = static_cast<size_t>(expected);
      staged_ = ReductionValues::Allocate(format_, expected_);
      if (push_bytes_ != nullptr) {
        absl::StatusOr<std::shared_ptr<ConnectionCaps::Place>> place = push_bytes_->Take(ctx_->peer(), 0);
        if (!place.ok()) return place.status();
        held_ = *std::move(place);
      }
    } else if (chunk_.trainer_rank() != first_.trainer_rank() || chunk_.step() != first_.step() ||
               chunk_.unit() != first_.unit() || chunk_.encoding() != first_.encoding() ||
               chunk_.slice_length() != first_.slice_length() || chunk_.micro_batch() != first_.micro_batch() ||
               chunk_.rank_count() != first_.rank_count() || chunk_.quant_block() != first_.quant_block() ||
               chunk_.non_finite() != first_.non_finite()) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk ", chunk_.chunk_index(), " changes the push's identity"));
    }
    if (chunk_.chunk_index() != chunks_) {
      return absl::InvalidArgumentError(absl::StrCat("chunk ", chunk_.chunk_index(),
                                                     " arrived where chunk ", chunks_, " was due"));
    }
    const size_t remaining = expected_ - static_cast<size_t>(received_);
    const std::optional<size_t> elements = format_.ElementsIn(data_.size, remaining);
    if (!elements) {
      return absl::InvalidArgumentError(absl::StrCat(
          "wrong length: chunk ", chunks_, " carries ", data_.size, " bytes, which are neither whole ",
          format_.quantized() ? "blocks" : "elements", " of ", format_.ToString(), " nor the ", remaining,
          " elements left of the slice (", format_.EncodedBytes(remaining), " bytes)"));
    }
    const int64_t count = static_cast<int64_t>(*elements);
    if (chunk_.offset() != received_) {
      return absl::InvalidArgumentError(absl::StrCat("wrong offset: chunk ", chunks_, " starts at element ",
                                                     chunk_.offset(), " after ", received_, " received"));
    }
    if (held_ != nullptr) {
      if (absl::Status room = held_->Grow(static_cast<int64_t>(data_.size)); !room.ok()) {
        return absl::ResourceExhaustedError(absl::StrCat("push of unit ", first_.unit(), " step ", first_.step(),
                                                         " refused at chunk ", chunks_, ": ", room.message()));
      }
    }
    std::byte* to = staged_.mutable_bytes(static_cast<size_t>(received_)).data();
    for (std::span<const std::byte> piece : data_.pieces) {
      CopyBytes(to, piece.data(), piece.size());
      to += piece.size();
    }
    staged_.CheckFiniteUpTo(static_cast<size_t>(received_ + count));  // while the chunk is in cache
    metrics_->bytes_in(first_.trainer_rank()).Increment(static_cast<double>(frame_.Length()));
    received_ += count;
    ++chunks_;
    return absl::OkStatus();
  }

  // The contribution this push carries (from the first chunk).
  ContributionId Identity() const {
    const v1::PushChunk& c = chunks_ == 0 ? chunk_ : first_;
    return ContributionId{c.trainer_rank(), std::max(1, c.rank_count()), c.micro_batch(), c.step(), c.unit()};
  }

  void Complete() {
    held_.reset();  // from here the slice is the reduction's (or dropped)
    if (ctx_->IsCancelled()) return FinishWith(absl::CancelledError("push abandoned; nothing applied"));
    if (chunks_ == 0) return FinishWith(absl::InvalidArgumentError("empty push"));
    if (received_ != static_cast<int64_t>(expected_)) {
      return FinishWith(absl::InvalidArgumentError(
          absl::StrCat("wrong length: push of unit ", first_.unit(), " ended after ", received_, " of ",
                       expected_, " elements; nothing applied")));
    }
    absl::StatusOr<PushDisposition> d = state_->Contribute(Identity(), std::move(staged_), first_.non_finite());
    if (!d.ok()) return FinishWith(d.status());
    switch (*d) {
      case PushDisposition::kAccepted:
        response_.set_disposition(v1::PushResponse::ACCEPTED);
        break;
      case PushDisposition::kDuplicate:
        response_.set_disposition(v1::PushResponse::DUPLICATE);
        metrics_->duplicate_pushes.Increment();
        response_.set_detail("contribution already received; ignored");
        break;
      case PushDisposition::kAcceptedNonFinite:
        response_.set_disposition(v1::PushResponse::ACCEPTED_NON_FINITE);
        metrics_->non_finite_pushes.Increment();
        response_.set_detail(absl::StrCat("non-finite gradient: step ", first_.step(),
                                           " will be skipped on every shard"));
        break;
    }
    FinishWith(absl::OkStatus());
  }

  ShardState* const state_;
  ServerMetrics* const metrics_;
  grpc::CallbackServerContext* const ctx_;
  grpc::ByteBuffer* const response_frame_;
  ConnectionCaps* const push_bytes_;               // null: no cap
  std::shared_ptr<ConnectionCaps::Place> held_;    // this push's bytes so far
  v1::PushResponse response_;
  grpc::ByteBuffer frame_;
  FrameData data_;  // chunk_'s data, pointing into frame_'s slices
  v1::PushChunk chunk_;  // the chunk's other fields
  v1::PushChunk first_;
  WireFormat format_;
  ReductionValues staged_;  // the slice as it arrives, in its encoding
  size_t expected_ = 0;     // elements in the whole slice
  const absl::Time start_;
  int64_t received_ = 0;
  int chunks_ = 0;
};

// The longest host:port a peer may give for itself (Join, Announce): what
// GetStatus lists stays far below its message limit.
constexpr size_t kMaxAddressBytes = 256;

// A streaming call refused before it started.
class RefusedFetch final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  explicit RefusedFetch(const absl::Status& status) { Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};
// A rendezvous post, withdrawn when its caller goes away.
class RendezvousReactor final : public grpc::ServerUnaryReactor {
 public:
  void OnCancel() override {
    if (withdraw) withdraw();
  }
  void OnDone() override { delete this; }
  RendezvousTable::Withdraw withdraw;
};

class RefusedPush final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  explicit RefusedPush(const absl::Status& status) { Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

// A job's fabric groups are at most all its trainers, and it has at most one
// group per trainer; a few rounds more leave room for groups that restart.
RendezvousTable::Limits RendezvousLimits(const JobConfig& job) {
  return RendezvousTable::Limits{.max_group_size = std::max(1, job.num_trainers),
                                 .max_open_rounds = 2 * std::max(1, job.num_trainers) + 8};
}

bool Allowed(RpcMethod method, Role role) {
  switch (method) {
    case RpcMethod::kJoin:
    case RpcMethod::kFetch:
    case RpcMethod::kReadMaster:
      return role == Role::kTrainer || role == Role::kReader;
    case RpcMethod::kPush:
    case RpcMethod::kRendezvous:
    case RpcMethod::kRollBack:
      return role == Role::kTrainer;
    case RpcMethod::kAgreeNorm:
    case RpcMethod::kAnnounce:
      return role == Role::kServer;
    case RpcMethod::kGetStatus:
      return true;
  }
  return false;
}

}  // namespace

absl::Status ShardServiceImpl::Authorize(const grpc::CallbackServerContext* ctx, RpcMethod method,
                                         bool needs_trainer, std::optional<Role>* role) {
  if (options_.authenticator == nullptr || !options_.authenticator->enabled()) return absl::OkStatus();
  CallerCheck caller = options_.authenticator->Identify(*ctx);
  if (role != nullptr) *role = caller.role;
  if (caller.role && (!Allowed(method, *caller.role) || (needs_trainer && *caller.role != Role::kTrainer))) {
    caller.failure = AuthFailure::kWrongRole;
    caller.refusal = absl::PermissionDeniedError(
        absl::StrCat("the ", RoleName(*caller.role), " role may not call ", RpcMethodName(method),
                     needs_trainer ? " as a trainer" : ""));
  }
  if (caller.refusal.ok()) return absl::OkStatus();
  metrics_->refused_calls(method, caller.failure).Increment();
  return absl::Status(caller.refusal.code(),
                      absl::StrCat("shard ", state_->shard_index(), ": ", caller.refusal.message()));
}

ShardServiceImpl::ShardServiceImpl(ShardState* state, NormCoordinator* coordinator, ServerMetrics* metrics,
                                   Options options)
    : state_(state),
      coordinator_(coordinator),
      metrics_(metrics),
      options_(options),
      fingerprint_(JobFingerprint(state->job())),
      rendezvous_(RendezvousLimits(state->job())) {
  if (coordinator_ != nullptr) {
    shard_addresses_.resize(state->job().num_shards);
    shard_addresses_[0] = options_.own_address;
  }
}

absl::Time ShardServiceImpl::WaitDeadline(const grpc::CallbackServerContext* ctx,
                                          absl::Duration limit) {
  const absl::Time server_limit = absl::Now() + limit;
  const absl::Time client = absl::FromChrono(ctx->deadline());
  if (client == absl::InfiniteFuture() || client > server_limit + absl::Hours(24 * 365)) {
    return server_limit;
  }
  const absl::Duration margin = std::min(absl::Milliseconds(500), (client - absl::Now()) / 10);
  return std::min(server_limit, client - margin);
}

void ShardServiceImpl::FinishUnary(grpc::ServerUnaryReactor* reactor, RpcMethod method, absl::Time start,
                                   const absl::Status& status) {
  if (!status.ok()) metrics_->Reject(status);
  metrics_->rpc_seconds(method).Observe(absl::ToDoubleSeconds(absl::Now() - start));
  reactor->Finish(ToGrpcStatus(status));
}

grpc::ServerUnaryReactor* ShardServiceImpl::Join(grpc::CallbackServerContext* ctx, const v1::JoinRequest* request,
                                                 v1::JoinResponse* response) {
  const absl::Time start = absl::Now();
  auto* reactor = ctx->DefaultReactor();
  const int rank = request->trainer_rank();
  // A reader joins without a rank: it learns the job, but no trainer's
  // place, gradient format or UCX session.
  if (absl::Status refused = Authorize(ctx, RpcMethod::kJoin, /*needs_trainer=*/rank >= 0); !refused.ok()) {
    FinishUnary(reactor, RpcMethod::kJoin, start, refused);
    return reactor;
  }
  if (rank < -1 || rank >= state_->job().num_trainers) {
    FinishUnary(reactor, RpcMethod::kJoin, start,
                absl::InvalidArgumentError(
                    absl::StrCat("trainer rank ", rank, " is outside [0, ", state_->job().num_trainers, ")")));
    return reactor;
  }
  if (request->metrics_address().size() > kMaxAddressBytes) {
    FinishUnary(reactor, RpcMethod::kJoin, start,
                absl::InvalidArgumentError(absl::StrCat("metrics address of ", request->metrics_address().size(),
                                                        " bytes: at most ", kMaxAddressBytes)));
    return reactor;
  }
  std::optional<WireFormat> grads;
  if (request->grad_encoding() != v1::ENCODING_UNSPECIFIED) {
    absl::StatusOr<WireFormat> format = FormatFromProto(request->grad_encoding(), request->quant_block());
    if (!format.ok()) {
      FinishUnary(reactor, RpcMethod::kJoin, start,
                  absl::InvalidArgumentError(absl::StrCat("gradient encoding: ", format.status().message())));
      return reactor;
    }
    grads = *format;
  }
  // Before anything is recorded: a Join refused for want of a session
  // changes nothing.
  absl::StatusOr<uint64_t> session = options_.tokens->Issue(rank, request->previous_session_token());
  if (!session.ok()) {
    FinishUnary(reactor, RpcMethod::kJoin, start,
                absl::Status(session.status().code(),
                             absl::StrCat("shard ", state_->shard_index(), ": ", session.status().message())));
    return reactor;
  }
  if (rank >= 0) {
    absl::MutexLock lock(&joined_mu_);
    joined_[rank] = request->metrics_address();
    state_->DeclareGradientFormat(rank, grads);
    state_->MarkJoined(rank);
  }
  *response->mutable_job() = JobToProto(state_->job());
  response->set_shard_index(state_->shard_index());
  response->set_current_step(state_->current_step());
  for (const UnitSpec& u : state_->layout().spec.units) response->add_unit_numels(u.numel);
  response->set_job_fingerprint(fingerprint_);
  response->set_ucx_address(options_.ucx_address);
  response->set_session_token(*session);
  FinishUnary(reactor, RpcMethod::kJoin, start, absl::OkStatus());
  return reactor;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* ShardServiceImpl::Fetch(grpc::CallbackServerContext* ctx,
                                                                    const grpc::ByteBuffer* request) {
  std::optional<Role> role;
  if (absl::Status refused = Authorize(ctx, RpcMethod::kFetch, /*needs_trainer=*/false, &role); !refused.ok()) {
    return new RefusedFetch(refused);
  }
  return new FetchReactor(state_, metrics_, *request, WaitDeadline(ctx, options_.fetch_wait_limit),
                          options_.fetch_chunk_bytes, /*adds_format=*/role != Role::kReader, options_.waiting_fetches,
                          ctx->peer());
}

grpc::ServerReadReactor<grpc::ByteBuffer>* ShardServiceImpl::Push(grpc::CallbackServerContext* ctx,
                                                                   grpc::ByteBuffer* response) {
  if (absl::Status refused = Authorize(ctx, RpcMethod::kPush); !refused.ok()) return new RefusedPush(refused);
  return new PushReactor(state_, metrics_, ctx, response, options_.push_bytes);
}

grpc::ServerUnaryReactor* ShardServiceImpl::AgreeNorm(grpc::CallbackServerContext* ctx,
                                                      const v1::NormReport* request,
                                                      v1::NormAgreement* response) {
  const absl::Time start = absl::Now();
  auto* reactor = ctx->DefaultReactor();
  if (absl::Status refused = Authorize(ctx, RpcMethod::kAgreeNorm); !refused.ok()) {
    FinishUnary(reactor, RpcMethod::kAgreeNorm, start, refused);
    return reactor;
  }
  if (coordinator_ == nullptr) {
    FinishUnary(reactor, RpcMethod::kAgreeNorm, start,
                absl::FailedPreconditionError(absl::StrCat(
                    "shard ", state_->shard_index(), " is not the norm coordinator (shard 0 is)")));
    return reactor;
  }
  if (request->job_fingerprint() != fingerprint_) {
    FinishUnary(reactor, RpcMethod::kAgreeNorm, start,
                absl::FailedPreconditionError(absl::StrCat(
                    "shard ", request->shard_index(),
                    " runs a different job (model, optimizer, seed or counts differ)")));
    return reactor;
  }
  if (request->shard_index() < 0 || request->shard_index() >= state_->job().num_shards) {
    FinishUnary(reactor, RpcMethod::kAgreeNorm, start,
                absl::InvalidArgumentError(absl::StrCat("shard index ", request->shard_index(), " is out of range")));
    return reactor;
  }
  if (request->checkpoint_steps_size() > kMaxReportedCheckpoints ||
      !std::is_sorted(request->checkpoint_steps().begin(), request->checkpoint_steps().end())) {
    FinishUnary(reactor, RpcMethod::kAgreeNorm, start,
                absl::InvalidArgumentError(absl::StrCat("shard ", request->shard_index(), " reports ",
                                                        request->checkpoint_steps_size(),
                                                        " checkpoint steps: need at most ", kMaxReportedCheckpoints,
                                                        ", ascending")));
    return reactor;
  }
  // A shard reports the step it closes: shard 0's, or the next (shard 0
  // may not have all of that step's gradients yet); a late retry may name
  // one of the few steps the coordinator still remembers.
  if (const int64_t current = state_->current_step();
      request->step() > current + 1 || request->step() < current - NormCoordinator::kRoundsKept) {
    FinishUnary(reactor, RpcMethod::kAgreeNorm, start,
                absl::OutOfRangeError(absl::StrCat("shard ", request->shard_index(), " reports a norm for step ",
                                                   request->step(), "; the coordinator is at step ", current)));
    return reactor;
  }
  absl::StatusOr<SquareSum> squares = SquareSum::FromBytes(request->sum_of_squares());
  if (!squares.ok()) {
    FinishUnary(reactor, RpcMethod::kAgreeNorm, start,
                absl::InvalidArgumentError(absl::StrCat("shard ", request->shard_index(), " reports step ",
                                                        request->step(), ": ", squares.status().message())));
    return reactor;
  }
  StepNorm partial;
  partial.sum_of_squares = *squares;
  partial.non_finite = request->non_finite();
  partial.checkpoint_steps.assign(request->checkpoint_steps().begin(), request->checkpoint_steps().end());
  const int64_t step = request->step();
  coordinator_->Report(step, request->shard_index(), partial, WaitDeadline(ctx, options_.norm_wait_limit),
                       [this, reactor, response, step, start](absl::StatusOr<StepNorm> total) {
                         if (total.ok()) {
                           response->set_step(step);
                           response->set_total_sum_of_squares(total->sum_of_squares.ToBytes());
                           response->set_non_finite(total->non_finite);
                           for (int64_t s : total->checkpoint_steps) response->add_common_checkpoint_steps(s);
                         }
                         FinishUnary(reactor, RpcMethod::kAgreeNorm, start, total.status());
                       });
  return reactor;
}

grpc::ServerUnaryReactor* ShardServiceImpl::GetStatus(grpc::CallbackServerContext* ctx, const v1::StatusRequest*,
                                                      v1::StatusResponse* response) {
  const absl::Time start = absl::Now();
  if (absl::Status refused = Authorize(ctx, RpcMethod::kGetStatus); !refused.ok()) {
    auto* reactor = ctx->DefaultReactor();
    FinishUnary(reactor, RpcMethod::kGetStatus, start, refused);
    return reactor;
  }
  const ShardState::Counters c = state_->counters();
  response->set_shard_index(state_->shard_index());
  response->set_current_step(state_->current_step());
  response->set_applied_updates(c.applied_updates);
  response->set_skipped_steps(c.skipped_steps);
  response->set_last_grad_norm(c.last_grad_norm);
  response->set_state_bytes(c.state_bytes);
  response->set_waiting_for(state_->DescribeWait());
  response->set_metrics_address(options_.metrics_address);
  {
    absl::MutexLock lock(&joined_mu_);
    for (const auto& [rank, address] : joined_) {
      v1::JoinedTrainer* t = response->add_joined_trainers();
      t->set_rank(rank);
      t->set_metrics_address(address);
    }
  }
  if (coordinator_ != nullptr) {
    absl::MutexLock lock(&shards_mu_);
    for (const std::string& a : shard_addresses_) response->add_shard_addresses(a);
  }
  response->set_coordinator_address(options_.coordinator_address);
  response->set_restored_step(options_.restored_step);
  response->set_job_fingerprint(fingerprint_);
  auto* reactor = ctx->DefaultReactor();
  FinishUnary(reactor, RpcMethod::kGetStatus, start, absl::OkStatus());
  return reactor;
}

grpc::ServerUnaryReactor* ShardServiceImpl::Announce(grpc::CallbackServerContext* ctx,
                                                     const v1::AnnounceRequest* request, v1::AnnounceResponse*) {
  const absl::Time start = absl::Now();
  auto* reactor = ctx->DefaultReactor();
  if (absl::Status refused = Authorize(ctx, RpcMethod::kAnnounce); !refused.ok()) {
    FinishUnary(reactor, RpcMethod::kAnnounce, start, refused);
    return reactor;
  }
  absl::Status refused;
  if (coordinator_ == nullptr) {
    refused = absl::FailedPreconditionError(
        absl::StrCat("shard ", state_->shard_index(), " is not the coordinator (shard 0 is)"));
  } else if (request->job_fingerprint() != fingerprint_) {
    refused = absl::FailedPreconditionError(absl::StrCat(
        "shard ", request->shard_index(), " runs a different job (model, optimizer, seed or counts differ)"));
  } else if (request->shard_index() <= 0 || request->shard_index() >= state_->job().num_shards) {
    refused = absl::InvalidArgumentError(absl::StrCat("shard index ", request->shard_index(), " is out of range"));
  } else if (request->port() <= 0 || request->port() > 65535 || request->advertised_address().size() > kMaxAddressBytes) {
    refused = absl::InvalidArgumentError("announced port or address out of range");
  }
  std::string address = request->advertised_address();
  if (refused.ok() && address.empty()) {
    // ctx->peer() is "ipv4:10.0.0.5:40312" or "ipv6:[fd00::5]:40312".
    const std::string peer = ctx->peer();
    const size_t kind = peer.find(':'), port = peer.rfind(':');
    if (kind == std::string::npos || port == kind) {
      refused = absl::InvalidArgumentError(absl::StrCat("cannot tell the announcing shard's host from \"", peer, "\""));
    } else {
      address = absl::StrCat(peer.substr(kind + 1, port - kind - 1), ":", request->port());
    }
  }
  if (refused.ok() && options_.answers_as_shard) {
    std::string previous;
    {
      absl::MutexLock lock(&shards_mu_);
      previous = shard_addresses_[request->shard_index()];
    }
    // A restarted shard on a new port moves; a live one stays where it is.
    if (!previous.empty() && previous != address && options_.answers_as_shard(previous, request->shard_index())) {
      refused = absl::AlreadyExistsError(absl::StrCat("shard ", request->shard_index(), " answers at ", previous,
                                                      "; it is not moved to ", address, " while it does"));
    }
  }
  if (refused.ok()) {
    absl::MutexLock lock(&shards_mu_);
    shard_addresses_[request->shard_index()] = address;
  }
  FinishUnary(reactor, RpcMethod::kAnnounce, start, refused);
  return reactor;
}

grpc::ServerUnaryReactor* ShardServiceImpl::ReadMaster(grpc::CallbackServerContext* ctx,
                                                       const v1::ReadMasterRequest* request,
                                                       v1::ReadMasterResponse* response) {
  const absl::Time start = absl::Now();
  auto* reactor = ctx->DefaultReactor();
  if (absl::Status refused = Authorize(ctx, RpcMethod::kReadMaster); !refused.ok()) {
    FinishUnary(reactor, RpcMethod::kReadMaster, start, refused);
    return reactor;
  }
  if (request->unit() < 0 || request->unit() >= state_->num_units()) {
    FinishUnary(reactor, RpcMethod::kReadMaster, start,
                absl::NotFoundError(absl::StrCat("unknown unit ", request->unit())));
    return reactor;
  }
  const int64_t slice_length = state_->slice_length(request->unit());
  if (request->offset() < 0 || request->offset() > slice_length || request->max_elements() < 0) {
    FinishUnary(reactor, RpcMethod::kReadMaster, start,
                absl::OutOfRangeError(absl::StrCat("page at element ", request->offset(), " of at most ",
                                                   request->max_elements(), " elements: the slice of unit ",
                                                   request->unit(), " has ", slice_length)));
    return reactor;
  }
  // A page fills at most one fetch chunk: far below the message limit.
  const int64_t page = options_.fetch_chunk_bytes / static_cast<int64_t>(sizeof(float));
  const int64_t count = request->max_elements() == 0 ? page : std::min(page, request->max_elements());
  auto [version, master] = state_->ReadMaster(request->unit(), request->offset(), count);
  response->set_version(version);
  response->set_offset(request->offset());
  response->set_slice_length(slice_length);
  response->set_data(master.data(), master.size() * sizeof(float));
  FinishUnary(reactor, RpcMethod::kReadMaster, start, absl::OkStatus());
  return reactor;
}

grpc::ServerUnaryReactor* ShardServiceImpl::Rendezvous(grpc::CallbackServerContext* ctx,
                                                       const v1::RendezvousRequest* request,
                                                       v1::RendezvousResponse* response) {
  const absl::Time start = absl::Now();
  auto* reactor = new RendezvousReactor();
  if (absl::Status refused = Authorize(ctx, RpcMethod::kRendezvous); !refused.ok()) {
    FinishUnary(reactor, RpcMethod::kRendezvous, start, refused);
    return reactor;
  }
  // Members of a group may start minutes apart (image pulls, scheduling):
  // the client's deadline bounds the wait, and a caller that goes away
  // takes its seat with it. gRPC calls OnCancel only once this returned.
  reactor->withdraw = rendezvous_.Post(
      request->group(), request->member(), request->size(), request->payload(), WaitDeadline(ctx, absl::Hours(1)),
      [this, reactor, response, start](absl::StatusOr<std::vector<std::string>> payloads) {
        if (payloads.ok()) {
          for (std::string& p : *payloads) response->add_payloads(std::move(p));
        }
        FinishUnary(reactor, RpcMethod::kRendezvous, start, payloads.status());
      });
  return reactor;
}

grpc::ServerUnaryReactor* ShardServiceImpl::RollBack(grpc::CallbackServerContext* ctx,
                                                     const v1::RollBackRequest* request,
                                                     v1::RollBackResponse* response) {
  const absl::Time start = absl::Now();
  auto* reactor = ctx->DefaultReactor();
  if (absl::Status refused = Authorize(ctx, RpcMethod::kRollBack); !refused.ok()) {
    FinishUnary(reactor, RpcMethod::kRollBack, start, refused);
    return reactor;
  }
  if (request->job_fingerprint() != fingerprint_) {
    FinishUnary(reactor, RpcMethod::kRollBack, start,
                absl::FailedPreconditionError(absl::StrCat("shard ", state_->shard_index(),
                                                           ": a rollback asked for by another job")));
    return reactor;
  }
  if (!options_.roll_back) {
    FinishUnary(reactor, RpcMethod::kRollBack, start,
                absl::UnimplementedError(absl::StrCat("shard ", state_->shard_index(), " cannot roll back")));
    return reactor;
  }
  if (request->restarted_addresses_size() > state_->job().num_shards) {
    FinishUnary(reactor, RpcMethod::kRollBack, start,
                absl::InvalidArgumentError(absl::StrCat("a rollback names ", request->restarted_addresses_size(),
                                                        " restarted servers; the job has ",
                                                        state_->job().num_shards, " shards")));
    return reactor;
  }
  std::vector<std::string> restarted;
  for (const std::string& a : request->restarted_addresses()) {
    if (a.size() > kMaxAddressBytes) {
      FinishUnary(reactor, RpcMethod::kRollBack, start,
                  absl::InvalidArgumentError(absl::StrCat("a restarted server's address of ", a.size(),
                                                          " bytes: at most ", kMaxAddressBytes)));
      return reactor;
    }
    restarted.push_back(a);
  }
  // Stopping and restarting the step driver takes up to a second, and the
  // restarted shard is asked first: not on gRPC's callback thread. The gRPC
  // server's shutdown waits for this call.
  std::thread([this, reactor, response, start, step = request->step(), rank = request->trainer_rank(),
               restarted = std::move(restarted)] {
    absl::StatusOr<int64_t> now = options_.roll_back(step, rank, restarted);
    if (now.ok()) response->set_current_step(*now);
    FinishUnary(reactor, RpcMethod::kRollBack, start, now.status());
  }).detach();
  return reactor;
}

}  // namespace pshard
