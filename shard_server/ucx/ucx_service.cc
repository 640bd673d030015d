#include "shard_server/ucx/ucx_service.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/copy.h"
#include "common/status_macros.h"
#include "common/ucx/ucx_endpoint.h"
#include "common/ucx/ucx_wire.h"
#include "common/ucx/ucx_worker.h"
#include "proto/rpc_util.h"

namespace pshard {
namespace {

constexpr const char* kTransport = "ucx";

// A reply and what it sends, kept alive until UCX is done with them.
struct Reply {
  ucx::ReplyHeader header;
  std::shared_ptr<const PublishedSlice> slice;  // a fetch reply's payload, held until sent
  std::span<const std::byte> piece;             // what of slice's bytes is sent
  std::span<const std::byte> payload() const { return slice != nullptr ? piece : std::span<const std::byte>(); }
};

// The bytes a fetch asks for: the whole encoded slice, or (fp32) a piece.
absl::Status CheckPiece(const ucx::FetchHeader& h, const WireFormat& format, int64_t slice_length) {
  if (h.byte_offset == 0 && h.byte_length == 0) return absl::OkStatus();
  const int64_t size = static_cast<int64_t>(format.EncodedBytes(static_cast<size_t>(slice_length)));
  if (format.encoding() != WireEncoding::kFp32) {
    return absl::InvalidArgumentError("a piece of a slice is served in fp32 only; ask for the whole slice");
  }
  if (h.byte_length <= 0 || h.byte_offset < 0 || h.byte_offset > size - h.byte_length) {
    return absl::InvalidArgumentError(absl::StrCat("piece of ", h.byte_length, " bytes from byte ", h.byte_offset,
                                                   " is not within the slice's ", size, " bytes"));
  }
  return absl::OkStatus();
}

// Where a session's replies go: an endpoint the server made to the trainer's
// worker (its hello), whose failure UCX reports where its transports can
// (not over shared memory), so that no reply is sent on an endpoint UCX has
// torn down. Progress thread only.
struct Peer {
  ucp_ep_h ep = nullptr;
  bool owned = false;   // made here (closed here); else a reply endpoint, valid in its callback only
  bool failed = false;  // the connection failed: replies are dropped
};

absl::Status UnknownToken() {
  return absl::UnauthenticatedError(
      "unknown session token: join this shard over gRPC first (a UCX peer that did not join is refused)");
}

}  // namespace

struct UcxService::Impl : std::enable_shared_from_this<Impl> {
  ShardState* state = nullptr;
  SessionTokens* tokens = nullptr;
  ServerMetrics* metrics = nullptr;
  Options options;
  std::unique_ptr<ucx::UcxWorker> worker;

  static ucs_status_t OnFetch(void* arg, const void* header, size_t header_length, void* data, size_t length,
                              const ucp_am_recv_param_t* param);
  static ucs_status_t OnPush(void* arg, const void* header, size_t header_length, void* data, size_t length,
                             const ucp_am_recv_param_t* param);
  static ucs_status_t OnHello(void* arg, const void* header, size_t header_length, void* data, size_t length,
                              const ucp_am_recv_param_t* param);
  static void OnPeerError(void* arg, ucp_ep_h ep, ucs_status_t status);
  // The session's endpoint, or (a peer that said no hello) the message's
  // reply endpoint, usable only in its callback. Progress thread only.
  std::shared_ptr<Peer> PeerFor(uint64_t token, const ucp_am_recv_param_t* param);
  void ClosePeer(const std::shared_ptr<Peer>& peer);
  std::map<uint64_t, std::shared_ptr<Peer>> peers;  // by session token; progress thread only

  // Progress thread only.
  void Send(const std::shared_ptr<Peer>& peer, uint16_t id, std::shared_ptr<Reply> reply, int rank);
  void Refuse(const std::shared_ptr<Peer>& peer, uint16_t id, uint64_t request_id, const absl::Status& status);
  // Any thread: takes the published slice and hands the reply to the worker.
  void SendSlice(std::shared_ptr<Peer> peer, const ucx::FetchHeader& request, const WireFormat& format, int rank,
                 absl::Status status);
  absl::Status CheckPush(const ucx::PushHeader& h, size_t length, WireFormat* format) const;
  // An eager push's data (in UCX's buffer) is copied; a rendezvous one was
  // received into `values`.
  void CompletePush(std::shared_ptr<Peer> peer, const ucx::PushHeader& h, const WireFormat& format, const void* data,
                    size_t length);
  void CompletePush(std::shared_ptr<Peer> peer, const ucx::PushHeader& h, ReductionValues values, size_t length);
  // A rendezvous push being received.
  struct PushReceive;
  static void PushReceived(void* request, ucs_status_t status, size_t length, void* user_data);
};

namespace {

ucp_ep_h ReplyEp(const ucp_am_recv_param_t* param) {
  return (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : nullptr;
}

bool IsRendezvous(const ucp_am_recv_param_t* param) {
  return (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
}

}  // namespace

void UcxService::Impl::Send(const std::shared_ptr<Peer>& peer, uint16_t id, std::shared_ptr<Reply> reply, int rank) {
  if (peer->failed || peer->ep == nullptr) return;  // the trainer is gone
  const size_t bytes = sizeof(reply->header) + reply->payload().size();
  ucx::SendAm(peer->ep, id, &reply->header, sizeof(reply->header), reply->payload().data(), reply->payload().size(),
              /*reply=*/true, [reply, bytes, rank, metrics = metrics, id](ucs_status_t s) {
                if (s == UCS_OK && id == ucx::kFetchReply) {
                  metrics->bytes_out(rank, kTransport).Increment(static_cast<double>(bytes));
                }
              });
}

void UcxService::Impl::Refuse(const std::shared_ptr<Peer>& peer, uint16_t id, uint64_t request_id, const absl::Status& status) {
  metrics->Reject(status);
  auto reply = std::make_shared<Reply>();
  reply->header.request_id = request_id;
  reply->header.status_code = static_cast<int32_t>(status.code());
  reply->header.SetMessage(status.message());
  Send(peer, id, std::move(reply), -1);
}

// ---- fetch ----

ucs_status_t UcxService::Impl::OnFetch(void* arg, const void* header, size_t header_length, void* data,
                                       size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Impl*>(arg);
  ucx::FetchHeader h;
  if (ReplyEp(param) == nullptr || !ucx::ReadHeader(header, header_length, &h)) {
    self->metrics->Reject(absl::InvalidArgumentError("malformed UCX fetch"));
    return UCS_OK;  // nobody to answer
  }
  const std::shared_ptr<Peer> peer = self->PeerFor(h.token, param);
  const std::optional<int> rank = self->tokens->Lookup(h.token);
  if (!rank) {
    self->metrics->refused_calls(RpcMethod::kFetch, AuthFailure::kUnknownSession).Increment();
    self->Refuse(peer, ucx::kFetchReply, h.request_id, UnknownToken());
    return UCS_OK;
  }
  absl::StatusOr<WireFormat> format = WeightFormatFromProto(static_cast<v1::Encoding>(h.encoding), h.quant_block);
  absl::Status status = format.status();
  if (status.ok()) status = self->state->CheckFetch(h.unit, h.version, *rank);
  if (status.ok()) status = CheckPiece(h, *format, self->state->slice_length(h.unit));
  if (!status.ok()) {
    self->Refuse(peer, ucx::kFetchReply, h.request_id, status);
    return UCS_OK;
  }
  // Like the gRPC path: answer a moment before the trainer gives up, so that
  // it hears why rather than timing out.
  absl::Duration wait = self->options.fetch_wait_limit;
  if (h.wait_ms > 0) {
    const absl::Duration client = absl::Milliseconds(h.wait_ms);
    wait = std::min(wait, client - std::min(absl::Milliseconds(500), client / 10));
  }
  std::shared_ptr<ConnectionCaps::Place> place;
  if (self->options.waiting_fetches != nullptr) {
    absl::StatusOr<std::shared_ptr<ConnectionCaps::Place>> taken =
        self->options.waiting_fetches->Take(absl::StrCat("ucx session ", h.token), 1);
    if (!taken.ok()) {
      self->metrics->Reject(taken.status());
      self->Refuse(peer, ucx::kFetchReply, h.request_id, taken.status());
      return UCS_OK;
    }
    place = *std::move(taken);
  }
  std::weak_ptr<Impl> weak = self->weak_from_this();
  auto waiter = std::make_shared<OneShotWaiter>(
      [weak, peer, h, format = *format, rank = *rank, place = std::move(place)](absl::Status s) mutable {
        place.reset();  // the wait is over
        if (std::shared_ptr<Impl> impl = weak.lock()) impl->SendSlice(peer, h, format, rank, std::move(s));
      });
  self->state->WhenPublished(h.unit, h.version, absl::Now() + wait, waiter);
  return UCS_OK;
}

void UcxService::Impl::SendSlice(std::shared_ptr<Peer> peer, const ucx::FetchHeader& request, const WireFormat& format, int rank,
                                 absl::Status status) {
  auto reply = std::make_shared<Reply>();
  reply->header.request_id = request.request_id;
  if (status.ok()) {
    absl::StatusOr<std::shared_ptr<const PublishedSlice>> slice =
        state->Published(request.unit, request.version, format);
    status = slice.status();
    if (status.ok()) {
      reply->slice = std::move(*slice);
      reply->piece = request.byte_length == 0 ? reply->slice->bytes()
                                              : reply->slice->bytes().subspan(request.byte_offset, request.byte_length);
      reply->header.checksum = reply->slice->checksum();
      reply->header.version = request.version;
      reply->header.slice_length = reply->slice->elements();
    }
  }
  if (!status.ok()) {
    metrics->Reject(status);
    reply->slice = nullptr;
    reply->header.status_code = static_cast<int32_t>(status.code());
    reply->header.SetMessage(status.message());
  }
  worker->Post([self = shared_from_this(), peer, reply, rank] { self->Send(peer, ucx::kFetchReply, reply, rank); });
}

// ---- push ----

absl::Status UcxService::Impl::CheckPush(const ucx::PushHeader& h, size_t length, WireFormat* format) const {
  // The session must be one a trainer among the push's ranks was given at
  // Join: a reader's, or another trainer's, does not push.
  const std::optional<int> rank = tokens->Lookup(h.token);
  if (!rank || *rank < h.trainer || *rank >= h.trainer + std::max(1, h.rank_count)) {
    metrics->refused_calls(RpcMethod::kPush, AuthFailure::kUnknownSession).Increment();
    if (!rank) return UnknownToken();
    return absl::PermissionDeniedError(absl::StrCat("this UCX session was given to ",
                                                    *rank < 0 ? std::string("a reader") : absl::StrCat("trainer ", *rank),
                                                    ", which may not push as trainer ", h.trainer));
  }
  ASSIGN_OR_RETURN(*format, FormatFromProto(static_cast<v1::Encoding>(h.encoding), h.quant_block));
  const ContributionId id{h.trainer, std::max(1, h.rank_count), h.micro_batch, h.step, h.unit};
  RETURN_IF_ERROR(state->CheckPush(id));
  RETURN_IF_ERROR(state->CheckPushFormat(id, *format));
  const int64_t expected = state->slice_length(h.unit);
  if (h.slice_length != expected) {
    return absl::InvalidArgumentError(absl::StrCat("wrong length: push of unit ", h.unit, " declares ",
                                                   h.slice_length, " elements; this shard's slice has ", expected));
  }
  if (length != format->EncodedBytes(static_cast<size_t>(expected))) {
    return absl::InvalidArgumentError(absl::StrCat("wrong length: push of unit ", h.unit, " carries ", length,
                                                   " bytes; ", expected, " elements in ", format->ToString(),
                                                   " take ", format->EncodedBytes(static_cast<size_t>(expected))));
  }
  return absl::OkStatus();
}

void UcxService::Impl::CompletePush(std::shared_ptr<Peer> peer, const ucx::PushHeader& h, const WireFormat& format,
                                    const void* data, size_t length) {
  ReductionValues values = ReductionValues::Allocate(format, h.slice_length);
  CopyBytes(values.mutable_bytes().data(), data, length);
  CompletePush(peer, h, std::move(values), length);
}

void UcxService::Impl::CompletePush(std::shared_ptr<Peer> peer, const ucx::PushHeader& h, ReductionValues values, size_t length) {
  metrics->bytes_in(h.trainer, kTransport).Increment(static_cast<double>(sizeof(h) + length));
  const ContributionId id{h.trainer, std::max(1, h.rank_count), h.micro_batch, h.step, h.unit};
  absl::StatusOr<PushDisposition> d = state->Contribute(id, std::move(values), h.non_finite != 0);
  if (!d.ok()) return Refuse(peer, ucx::kPushReply, h.request_id, d.status());
  auto reply = std::make_shared<Reply>();
  reply->header.request_id = h.request_id;
  switch (*d) {
    case PushDisposition::kAccepted:
      reply->header.disposition = static_cast<int32_t>(ucx::Disposition::kAccepted);
      break;
    case PushDisposition::kDuplicate:
      reply->header.disposition = static_cast<int32_t>(ucx::Disposition::kDuplicate);
      reply->header.SetMessage("contribution already received; ignored");
      metrics->duplicate_pushes.Increment();
      break;
    case PushDisposition::kAcceptedNonFinite:
      reply->header.disposition = static_cast<int32_t>(ucx::Disposition::kAcceptedNonFinite);
      reply->header.SetMessage(absl::StrCat("non-finite gradient: step ", h.step, " will be skipped on every shard"));
      metrics->non_finite_pushes.Increment();
      break;
  }
  Send(peer, ucx::kPushReply, std::move(reply), h.trainer);
}

// A rendezvous push being received.
struct UcxService::Impl::PushReceive {
  Impl* impl;
  std::shared_ptr<Peer> peer;
  ucx::PushHeader header;
  ReductionValues values;  // received straight into, in its encoding
};

void UcxService::Impl::PushReceived(void* request, ucs_status_t status, size_t length, void* user_data) {
  std::unique_ptr<PushReceive> r(static_cast<PushReceive*>(user_data));
  if (status != UCS_OK) {
    r->impl->Refuse(r->peer, ucx::kPushReply, r->header.request_id,
                    PSHARD_UCX_ERROR("ucp_am_recv_data_nbx", status));
  } else {
    r->impl->CompletePush(r->peer, r->header, std::move(r->values), length);
  }
  if (request != nullptr) ucp_request_free(request);
}

ucs_status_t UcxService::Impl::OnPush(void* arg, const void* header, size_t header_length, void* data,
                                      size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Impl*>(arg);
  ucx::PushHeader h;
  if (ReplyEp(param) == nullptr || !ucx::ReadHeader(header, header_length, &h)) {
    self->metrics->Reject(absl::InvalidArgumentError("malformed UCX push"));
    return UCS_OK;  // rendezvous data not asked for is dropped by UCX
  }
  const std::shared_ptr<Peer> peer = self->PeerFor(h.token, param);
  WireFormat format;
  if (absl::Status s = self->CheckPush(h, length, &format); !s.ok()) {
    self->Refuse(peer, ucx::kPushReply, h.request_id, s);
    return UCS_OK;
  }
  if (!IsRendezvous(param)) {
    self->CompletePush(peer, h, format, data, length);
    return UCS_OK;
  }
  auto* r = new PushReceive{self, peer, h, ReductionValues::Allocate(format, h.slice_length)};
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.cb.recv_am = PushReceived;
  rp.user_data = r;
  ucs_status_ptr_t request =
      ucp_am_recv_data_nbx(self->worker->worker(), data, r->values.mutable_bytes().data(), length, &rp);
  if (request == nullptr) {
    PushReceived(nullptr, UCS_OK, length, r);
  } else if (UCS_PTR_IS_ERR(request)) {
    PushReceived(nullptr, UCS_PTR_STATUS(request), 0, r);
  }
  return UCS_OK;
}

// ---- sessions' endpoints ----

std::shared_ptr<Peer> UcxService::Impl::PeerFor(uint64_t token, const ucp_am_recv_param_t* param) {
  if (auto it = peers.find(token); it != peers.end()) return it->second;
  auto peer = std::make_shared<Peer>();
  peer->ep = ReplyEp(param);
  return peer;
}

void UcxService::Impl::ClosePeer(const std::shared_ptr<Peer>& peer) {
  if (!peer->owned || peer->ep == nullptr) return;
  peer->owned = false;
  ucx::CloseLater(peer->ep);  // in a callback at times: no progress here
  peer->ep = nullptr;
  peer->failed = true;
}

void UcxService::Impl::OnPeerError(void* arg, ucp_ep_h ep, ucs_status_t) {
  // The trainer died or its connection failed: what would go to it is
  // dropped, and the endpoint is closed once UCX is out of this callback.
  auto* impl = static_cast<Impl*>(arg);
  for (auto it = impl->peers.begin(); it != impl->peers.end(); ++it) {
    if (it->second->ep != ep) continue;
    std::shared_ptr<Peer> peer = it->second;
    peer->failed = true;
    impl->peers.erase(it);
    impl->worker->Post([impl, peer] { impl->ClosePeer(peer); });
    return;
  }
}

ucs_status_t UcxService::Impl::OnHello(void* arg, const void* header, size_t header_length, void* data,
                                       size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Impl*>(arg);
  ucx::HelloHeader h;
  if (!ucx::ReadHeader(header, header_length, &h) || IsRendezvous(param) || length == 0 || length > 4096) {
    self->metrics->Reject(absl::InvalidArgumentError("malformed UCX hello"));
    return UCS_OK;
  }
  // Only a session handed out at Join gets an endpoint; sessions that were
  // replaced since (a few per rank are kept) lose theirs.
  if (!self->tokens->Lookup(h.token)) {
    self->metrics->refused_calls(RpcMethod::kFetch, AuthFailure::kUnknownSession).Increment();
    return UCS_OK;
  }
  for (auto it = self->peers.begin(); it != self->peers.end();) {
    if (it->first == h.token || !self->tokens->Lookup(it->first)) {
      self->ClosePeer(it->second);
      it = self->peers.erase(it);
    } else {
      ++it;
    }
  }
  auto peer = std::make_shared<Peer>();
  // A trainer on this host is reached as it reaches this server: without
  // UCX's peer failure mode, so that UCX may use shared memory. UCX then
  // cannot tell this endpoint that the trainer died: its replies are
  // dropped when the session is replaced (its next hello, or its rejoin).
  const ucx::PeerFailure mode =
      (h.flags & ucx::kHelloSameHost) != 0 ? ucx::PeerFailure::kOwner : ucx::PeerFailure::kUcx;
  absl::StatusOr<ucx::Endpoint> endpoint = ucx::Connect(self->worker->worker(), data, mode, &Impl::OnPeerError, self);
  if (!endpoint.ok()) {
    self->metrics->Reject(absl::UnavailableError(
        absl::StrCat("UCX hello: cannot reach the trainer's worker: ", endpoint.status().message())));
    return UCS_OK;
  }
  peer->ep = endpoint->ep;
  peer->owned = true;
  self->peers[h.token] = std::move(peer);
  return UCS_OK;
}

// ---- the handle ----

absl::StatusOr<std::unique_ptr<UcxService>> UcxService::Start(ShardState* state, SessionTokens* tokens,
                                                              ServerMetrics* metrics, Options options) {
  auto impl = std::make_shared<Impl>();
  impl->state = state;
  impl->tokens = tokens;
  impl->metrics = metrics;
  impl->options = options;
  ASSIGN_OR_RETURN(impl->worker, ucx::UcxWorker::Create({{ucx::kFetchRequest, &Impl::OnFetch, impl.get()},
                                                         {ucx::kPushRequest, &Impl::OnPush, impl.get()},
                                                         {ucx::kHello, &Impl::OnHello, impl.get()}}));
  return std::unique_ptr<UcxService>(new UcxService(std::move(impl)));
}

UcxService::~UcxService() {
  if (!impl_) return;
  impl_->worker->Stop([impl = impl_.get()] {
    for (auto& [token, peer] : impl->peers) impl->ClosePeer(peer);
    impl->peers.clear();
  });
}

const std::string& UcxService::address() const { return impl_->worker->address(); }

}  // namespace pshard
