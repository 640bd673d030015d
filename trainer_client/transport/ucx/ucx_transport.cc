#include "trainer_client/transport/ucx/ucx_transport.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/checksum.h"
#include "common/ucx/ucx_wire.h"
#include "proto/rpc_util.h"

namespace pshard {
namespace {

std::string Where(int shard, const std::string& address) {
  return absl::StrCat("shard ", shard, " (", address, ")");
}

// True when the host of `address` ("host:port", "[v6]:port") resolves to
// a loopback address or to an address of one of this host's interfaces.
bool IsThisHost(const std::string& address) {
  std::string host = address.substr(0, address.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* resolved = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &resolved) != 0) return false;
  ifaddrs* interfaces = nullptr;
  if (getifaddrs(&interfaces) != 0) interfaces = nullptr;
  bool local = false;
  for (const addrinfo* a = resolved; a != nullptr && !local; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      const in_addr ip = reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr;
      local = (ntohl(ip.s_addr) >> 24) == 127;
      for (const ifaddrs* i = interfaces; i != nullptr && !local; i = i->ifa_next) {
        if (i->ifa_addr != nullptr && i->ifa_addr->sa_family == AF_INET) {
          local = reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr == ip.s_addr;
        }
      }
    } else if (a->ai_family == AF_INET6) {
      const in6_addr ip = reinterpret_cast<const sockaddr_in6*>(a->ai_addr)->sin6_addr;
      local = IN6_IS_ADDR_LOOPBACK(&ip);
      for (const ifaddrs* i = interfaces; i != nullptr && !local; i = i->ifa_next) {
        if (i->ifa_addr != nullptr && i->ifa_addr->sa_family == AF_INET6) {
          local = std::memcmp(&reinterpret_cast<const sockaddr_in6*>(i->ifa_addr)->sin6_addr, &ip, sizeof(ip)) == 0;
        }
      }
    }
  }
  if (interfaces != nullptr) freeifaddrs(interfaces);
  freeaddrinfo(resolved);
  return local;
}

}  // namespace

// One fetch or push in flight. Lives in UcxContext::pending_ until its reply
// (or its deadline) ends it; progress thread only, except where noted.
struct UcxContext::Op {
  UcxContext* owner = nullptr;
  bool is_fetch = true;
  uint64_t id = 0;
  ucp_ep_h ep = nullptr;
  std::shared_ptr<UcxContext::Health> health;  // the endpoint's
  absl::Duration timeout;
  std::string what;     // "fetch of unit 3 version 12 from shard 1 (host:port)"
  TransferDone done;
  std::shared_ptr<CancelScope> cancel;  // registered when the op starts
  int64_t wire_bytes = 0;
  // fetch
  ucx::FetchHeader fetch;
  FetchArgs fetch_args;
  float* dest = nullptr;
  bool receiving = false;  // rendezvous data is being written
  bool expired = false;    // the deadline passed while receiving: the endpoint was closed
  uint32_t checksum = 0;
  std::vector<std::byte> staging;  // rendezvous bytes that do not fit in dest (tiny quantized slices)
  // A piece of a slice fetched in pieces (pieced null: the whole slice):
  // piece_length bytes from piece_offset, in fp32.
  std::shared_ptr<UcxContext::PiecedFetch> pieced;
  int piece = 0;
  int64_t piece_offset = 0;
  int64_t piece_length = 0;
  // push: the slice goes from the gradient itself (fp32) or from `encoded`
  ucx::PushHeader push;
  std::shared_ptr<const std::vector<float>> grads;
  std::unique_ptr<std::byte[]> encoded;
  const void* payload = nullptr;
  size_t payload_length = 0;

  void Finish(absl::Status status) {
    if (!status.ok()) {
      status = absl::Status(status.code(), absl::StrCat(what, ": ", status.message()));
    }
    done(std::move(status), wire_bytes);
  }
  // Verifies and decodes the slice, in one pass, from `bytes` (a received
  // eager message, or `staging`; null when rendezvous put it in dest's
  // tail, or in dest itself for fp32), and ends the fetch.
  void FinishFetch(const void* bytes);
  absl::Status NoReply() const {
    return absl::DeadlineExceededError(absl::StrCat("no reply over UCX within ", absl::FormatDuration(timeout)));
  }
  absl::Status StillArriving() const {
    return absl::DeadlineExceededError(absl::StrCat("the reply was still arriving over UCX after ",
                                                    absl::FormatDuration(timeout), "; its endpoint was closed"));
  }
};

// The pieces of one slice's fetch. Ends the fetch once every piece has
// ended: with the first piece's error (the others are cancelled), or with
// the pieces' checksums joined and held against the published one.
struct UcxContext::PiecedFetch {
  UcxContext* context = nullptr;
  std::string what;  // the slice's fetch, for its messages
  TransferDone done;
  std::vector<uint64_t> ids;      // the pieces' ops; set before any starts
  std::vector<int64_t> lengths;   // the pieces' bytes
  std::atomic<bool> failed{false};

  absl::Mutex mu;
  std::vector<uint32_t> crcs ABSL_GUARDED_BY(mu);       // of each piece as received
  std::vector<uint32_t> published ABSL_GUARDED_BY(mu);  // the slice's, as each reply gave it
  int remaining ABSL_GUARDED_BY(mu) = 0;
  int64_t wire_bytes ABSL_GUARDED_BY(mu) = 0;
  absl::Status first_error ABSL_GUARDED_BY(mu);

  void Verified(int piece, uint32_t crc, uint32_t published_crc) {
    absl::MutexLock lock(&mu);
    crcs[piece] = crc;
    published[piece] = published_crc;
  }

  void Ended(int piece, absl::Status status, int64_t bytes) {
    bool first_failure = false;
    bool last = false;
    {
      absl::MutexLock lock(&mu);
      wire_bytes += bytes;
      if (!status.ok() && first_error.ok()) {
        first_error = std::move(status);
        first_failure = true;
        failed = true;
      }
      last = --remaining == 0;
    }
    if (first_failure && !last) {
      for (size_t i = 0; i < ids.size(); ++i) {
        if (static_cast<int>(i) != piece) context->worker_->Post([context = context, id = ids[i]] { context->Cancel(id); });
      }
    }
    if (!last) return;
    absl::Status result;
    int64_t total = 0;
    {
      absl::MutexLock lock(&mu);
      total = wire_bytes;
      result = first_error.ok() ? Joined() : first_error;
    }
    done(std::move(result), total);
  }

 private:
  absl::Status Joined() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    uint32_t crc = crcs[0];
    for (size_t i = 1; i < crcs.size(); ++i) {
      if (published[i] != published[0]) {
        return absl::DataLossError(absl::StrCat(what, ": the pieces' replies gave two checksums of the slice, ",
                                                published[0], " and ", published[i]));
      }
      crc = Crc32cCombine(crc, crcs[i], static_cast<uint64_t>(lengths[i]));
    }
    if (crc != published[0]) {
      return absl::DataLossError(absl::StrCat(what, ": checksum mismatch: got ", crc, ", published ", published[0]));
    }
    return absl::OkStatus();
  }
};

void UcxContext::Op::FinishFetch(const void* bytes) {
  if (expired) return Finish(StillArriving());
  if (pieced != nullptr) {
    // fp32: the piece is the slice's bytes from piece_offset, in dest.
    std::byte* at = reinterpret_cast<std::byte*>(dest) + piece_offset;
    const uint32_t crc =
        bytes == nullptr
            ? Crc32c(at, static_cast<size_t>(piece_length))
            : DecodeAndChecksum(fetch_args.format, static_cast<const std::byte*>(bytes),
                                std::span<float>(reinterpret_cast<float*>(at), piece_length / sizeof(float)), 0);
    pieced->Verified(piece, crc, checksum);
    return Finish(absl::OkStatus());
  }
  const std::span<float> slice(dest, fetch_args.slice.length);
  const uint32_t crc =
      bytes == nullptr ? DecodeTailInPlaceAndChecksum(fetch_args.format, slice, 0)
                       : DecodeAndChecksum(fetch_args.format, static_cast<const std::byte*>(bytes), slice, 0);
  if (crc != checksum) {
    return Finish(absl::DataLossError(absl::StrCat("checksum mismatch: got ", crc, ", published ", checksum)));
  }
  Finish(absl::OkStatus());
}

// ---- UcxContext ----

absl::StatusOr<std::unique_ptr<UcxContext>> UcxContext::Create() {
  std::unique_ptr<UcxContext> context(new UcxContext());
  absl::StatusOr<std::unique_ptr<ucx::UcxWorker>> worker = ucx::UcxWorker::Create(
      {{ucx::kFetchReply, &UcxContext::OnReply, context.get()}, {ucx::kPushReply, &UcxContext::OnReply, context.get()}});
  if (!worker.ok()) return worker.status();
  context->worker_ = std::move(*worker);
  return context;
}

UcxContext::~UcxContext() {
  if (worker_ == nullptr) return;  // Create failed
  worker_->Stop([this] {
    for (const Arrived& a : arrived_) ucp_am_data_release(worker_->worker(), a.descriptor);
    arrived_.clear();
    for (auto& [id, op] : pending_) op->Finish(absl::CancelledError("the trainer's UCX context shut down"));
    pending_.clear();
  });
}

std::shared_ptr<UcxContext::Op> UcxContext::Take(uint64_t id) {
  auto it = pending_.find(id);
  if (it == pending_.end()) return nullptr;
  std::shared_ptr<Op> op = std::move(it->second);
  pending_.erase(it);
  return op;
}

void UcxContext::Start(std::shared_ptr<Op> op) {
  if (op->health->closed) {  // closed since the transport checked
    return op->Finish(absl::UnavailableError("the UCX endpoint to the server was closed: a reply outlived its deadline"));
  }
  if (op->pieced != nullptr && op->pieced->failed) {
    return op->Finish(absl::CancelledError("cancelled: another piece of the slice failed"));
  }
  const uint64_t id = op->id;
  pending_[id] = op;
  timer_.Schedule(absl::Now() + op->timeout, [this, id] { worker_->Post([this, id] { Expire(id); }); });
  const void* header = op->is_fetch ? static_cast<const void*>(&op->fetch) : &op->push;
  const size_t header_length = op->is_fetch ? sizeof(op->fetch) : sizeof(op->push);
  op->wire_bytes += static_cast<int64_t>(header_length + op->payload_length);
  ucx::SendAm(op->ep, op->is_fetch ? ucx::kFetchRequest : ucx::kPushRequest, header, header_length,
              op->payload, op->payload_length, /*reply=*/true, [this, op, id](ucs_status_t s) {
                if (s == UCS_OK) return;  // the reply ends the op
                if (Take(id) != nullptr) op->Finish(PSHARD_UCX_ERROR("ucp_am_send_nbx", s));
              });
}

void UcxContext::Expire(uint64_t id) {
  auto it = pending_.find(id);
  if (it == pending_.end()) return;
  std::shared_ptr<Op> op = it->second;
  if (!op->receiving) {
    Take(id);
    return op->Finish(op->NoReply());
  }
  // Announced, and queued behind another receive: nothing has landed yet.
  auto queued = std::find_if(arrived_.begin(), arrived_.end(), [id](const Arrived& a) { return a.op->id == id; });
  if (queued != arrived_.end()) {
    ucp_am_data_release(worker_->worker(), queued->descriptor);
    arrived_.erase(queued);
    Take(id);
    return op->Finish(op->NoReply());
  }
  // Its data is landing in dest, so only the end of its receive may end it;
  // from a server that stopped mid-transfer that end never comes unless the
  // endpoint is closed (forced), which ends the receive with an error.
  op->expired = true;
  CloseEndpoint(op->ep, *op->health,
                absl::UnavailableError(absl::StrCat("the UCX endpoint to the server was closed: ", op->what,
                                                    " was still arriving after its deadline")));
}

void UcxContext::Cancel(uint64_t id) {
  auto it = pending_.find(id);
  // Gone (ended), or its data is landing in dest: that ends it soon.
  if (it == pending_.end() || it->second->receiving) return;
  Take(id)->Finish(absl::CancelledError("cancelled: another slice of the unit failed"));
}

void UcxContext::FailEndpoint(ucp_ep_h ep, const absl::Status& status) {
  // Queued receives have not started: their data is released, not awaited.
  for (auto it = arrived_.begin(); it != arrived_.end();) {
    if (it->op->ep != ep) {
      ++it;
      continue;
    }
    ucp_am_data_release(worker_->worker(), it->descriptor);
    it->op->receiving = false;
    it = arrived_.erase(it);
  }
  std::vector<uint64_t> ids;
  for (const auto& [id, op] : pending_) {
    if (op->ep == ep && !op->receiving) ids.push_back(id);
  }
  for (uint64_t id : ids) Take(id)->Finish(status);
}

void UcxContext::CloseEndpoint(ucp_ep_h ep, Health& health, const absl::Status& status) {
  if (health.closed) return;
  health.closed = true;
  health.failed = true;
  FailEndpoint(ep, status);
  ucx::CloseLater(ep);  // may end the receive in flight at once (OnFetchData)
}

void UcxContext::OnFetchData(void* request, ucs_status_t status, size_t length, void* user_data) {
  std::unique_ptr<std::shared_ptr<UcxContext::Op>> holder(static_cast<std::shared_ptr<UcxContext::Op>*>(user_data));
  UcxContext::Op& op = **holder;
  UcxContext* self = op.owner;
  self->Take(op.id);  // ended here, whatever its deadline did
  if (request != nullptr) ucp_request_free(request);
  --self->receiving_;
  if (status != UCS_OK) {
    op.Finish(op.expired ? op.StillArriving() : PSHARD_UCX_ERROR("ucp_am_recv_data_nbx", status));
  } else {
    self->verifier_.Post([op = std::move(*holder)] {
      op->FinishFetch(op->staging.empty() ? nullptr : op->staging.data());
    });
  }
  self->StartReceives();
}

void UcxContext::StartReceives() {
  while (receiving_ < kReceivesInFlight && !arrived_.empty()) {
    Arrived next = std::move(arrived_.front());
    arrived_.pop_front();
    Receive(std::move(next));
  }
}

void UcxContext::Receive(Arrived arrived) {
  ++receiving_;
  auto* holder = new std::shared_ptr<Op>(std::move(arrived.op));
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.cb.recv_am = OnFetchData;
  rp.user_data = holder;
  ucs_status_ptr_t request =
      ucp_am_recv_data_nbx(worker_->worker(), arrived.descriptor, arrived.target, arrived.length, &rp);
  if (request == nullptr || UCS_PTR_IS_ERR(request)) {  // done, or failed, at once
    OnFetchData(nullptr, request == nullptr ? UCS_OK : UCS_PTR_STATUS(request), arrived.length, holder);
  }
}

ucs_status_t UcxContext::OnReply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                 const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxContext*>(arg);
  const bool rendezvous = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  ucx::ReplyHeader reply;
  std::shared_ptr<Op> op;
  if (ucx::ReadHeader(header, header_length, &reply)) op = self->Take(reply.request_id);
  // Rendezvous data not asked for with ucp_am_recv_data_nbx is dropped by UCX.
  if (op == nullptr) return UCS_OK;  // late (after its deadline) or malformed
  op->wire_bytes += static_cast<int64_t>(header_length + length);
  auto refuse = [&](absl::Status status) {
    op->Finish(std::move(status));
    return UCS_OK;
  };
  if (reply.status_code != 0) {
    return refuse(absl::Status(static_cast<absl::StatusCode>(reply.status_code), reply.Message()));
  }
  if (!op->is_fetch) {
    if (reply.disposition == static_cast<int32_t>(ucx::Disposition::kAcceptedNonFinite)) {
      std::fprintf(stderr, "pshard-trainer: %s: %s\n", op->what.c_str(), std::string(reply.Message()).c_str());
    }
    op->Finish(absl::OkStatus());
    return UCS_OK;
  }
  const FetchArgs& args = op->fetch_args;
  if (reply.slice_length != args.slice.length || reply.version != args.version) {
    return refuse(absl::FailedPreconditionError(absl::StrCat(
        "server sent slice of ", reply.slice_length, " elements at version ", reply.version, "; expected ",
        args.slice.length, " at version ", args.version)));
  }
  const size_t expected = op->pieced != nullptr ? static_cast<size_t>(op->piece_length)
                                                : args.format.EncodedBytes(static_cast<size_t>(args.slice.length));
  if (length != expected) {
    return refuse(absl::DataLossError(absl::StrCat("reply carries ", length, " bytes; expected ", expected)));
  }
  op->checksum = reply.checksum;
  if (!rendezvous) {
    op->FinishFetch(data);
    return UCS_OK;
  }
  // Rendezvous: the encoded bytes land in the tail of the slice's own fp32
  // buffer (all of it for fp32; a piece at its offset) and are decoded
  // there, in place. A few are received at once, in arrival order, few
  // enough that the first finish (and are verified on the verifier thread)
  // while later ones still move; started all at once, they would all finish
  // together and leave their verification as a tail after the last byte.
  void* target = nullptr;
  if (op->pieced != nullptr) {
    target = reinterpret_cast<std::byte*>(op->dest) + op->piece_offset;
  } else if (FitsInFloats(args.format, static_cast<size_t>(args.slice.length))) {
    target = reinterpret_cast<std::byte*>(op->dest) + args.slice.length * sizeof(float) - length;
  } else {
    op->staging.resize(length);
    target = op->staging.data();
  }
  op->receiving = true;
  self->pending_[op->id] = op;  // until the data is in (a deadline then only marks it)
  Arrived arrived{std::move(op), data, target, length};
  if (self->receiving_ < kReceivesInFlight && self->arrived_.empty()) {
    self->Receive(std::move(arrived));
    return UCS_OK;
  }
  // Queued: UCX keeps the descriptor until ucp_am_recv_data_nbx takes it.
  self->arrived_.push_back(std::move(arrived));
  return UCS_INPROGRESS;
}

// ---- UcxTransport ----

absl::StatusOr<std::unique_ptr<UcxTransport>> UcxTransport::Create(Spec spec) {
  std::unique_ptr<UcxTransport> t(new UcxTransport(std::move(spec)));
  absl::Notification created;
  absl::Status status;
  UcxTransport* raw = t.get();
  // A server on this host is reached without UCX's peer failure mode, so
  // that UCX may use shared memory; its gRPC channel tells when it dies.
  const bool same_host = IsThisHost(raw->spec_.address);
  const bool posted = raw->spec_.context->worker_->Post([raw, same_host, &created, &status] {
    ucx::UcxWorker& worker = *raw->spec_.context->worker_;
    absl::StatusOr<ucx::Endpoint> endpoint =
        ucx::Connect(worker.worker(), raw->spec_.ucx_address.data(),
                     same_host ? ucx::PeerFailure::kOwner : ucx::PeerFailure::kUcx, &UcxTransport::OnEndpointError, raw);
    if (endpoint.ok()) {
      raw->endpoint_ = std::move(*endpoint);
      // First on the endpoint: where the server answers this session, over
      // an endpoint of its own (made the same way).
      auto hello = std::make_shared<ucx::HelloHeader>();
      hello->token = raw->spec_.session_token;
      hello->flags = same_host ? ucx::kHelloSameHost : 0;
      const std::string& address = worker.address();
      ucx::SendAm(raw->endpoint_.ep, ucx::kHello, hello.get(), sizeof(*hello), address.data(), address.size(),
                  /*reply=*/false, [hello](ucs_status_t) {});
    } else {
      status = endpoint.status();
    }
    created.Notify();
  });
  if (!posted) return absl::CancelledError("the trainer's UCX context is shutting down");
  created.WaitForNotification();
  if (!status.ok()) {
    return absl::Status(status.code(), absl::StrCat("UCX endpoint to ", Where(raw->spec_.shard, raw->spec_.address),
                                                    ": ", status.message()));
  }
  if (!raw->endpoint_.detects_peer_failure && raw->spec_.control_channel != nullptr) {
    WatchControlChannel(raw->health_, raw->spec_.context, raw->endpoint_.ep, raw->spec_.control_channel,
                        Where(raw->spec_.shard, raw->spec_.address));
  }
  return t;
}

UcxTransport::~UcxTransport() {
  if (endpoint_.ep == nullptr) return;
  absl::Notification closed;
  const bool posted = spec_.context->worker_->Post([this, &closed] {
    if (!health_->closed) ucx::CloseNow(spec_.context->worker_->worker(), endpoint_.ep);
    closed.Notify();
  });
  if (posted) closed.WaitForNotification();
}

std::string UcxTransport::description() const {
  std::string text = absl::StrCat("ucx over ", endpoint_.Describe());
  if (!endpoint_.detects_peer_failure) {
    absl::StrAppend(&text, spec_.control_channel != nullptr
                               ? ": a dead server is noticed through its gRPC channel"
                               : ": a dead server is noticed at the deadline only");
  }
  return text;
}

void UcxTransport::WatchControlChannel(std::weak_ptr<Health> weak, UcxContext* context, ucp_ep_h ep,
                                       std::shared_ptr<grpc::ChannelInterface> channel, std::string where) {
  std::shared_ptr<Health> health = weak.lock();
  if (health == nullptr || health->failed) return;  // the transport is gone, or failed already
  const grpc_connectivity_state state = channel->GetState(/*try_to_connect=*/false);
  const bool lost = (health->was_ready && state != GRPC_CHANNEL_READY) ||
                    state == GRPC_CHANNEL_TRANSIENT_FAILURE || state == GRPC_CHANNEL_SHUTDOWN;
  if (lost) {
    // The server's process ended (its connections closed), or it is being
    // replaced: the endpoint leads to a worker that no longer answers.
    health->failed = true;
    absl::Status status = absl::UnavailableError(absl::StrCat(
        "the gRPC connection to ", where, " was lost, so its UCX link over shared memory is taken as failed: ",
        "the server is down or restarting"));
    context->worker_->Post([context, ep, status] { context->FailEndpoint(ep, status); });
    return;
  }
  if (state == GRPC_CHANNEL_READY) {
    health->was_ready = true;
  } else if (state == GRPC_CHANNEL_IDLE) {
    channel->GetState(/*try_to_connect=*/true);  // not connected yet: connect, so a dead server shows
  }
  context->timer_.Schedule(absl::Now() + kControlChannelCheck,
                           [weak = std::move(weak), context, ep, channel = std::move(channel),
                            where = std::move(where)]() mutable {
                             WatchControlChannel(std::move(weak), context, ep, std::move(channel), std::move(where));
                           });
}

void UcxTransport::OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* self = static_cast<UcxTransport*>(arg);
  self->health_->failed = true;
  self->spec_.context->FailEndpoint(
      ep, absl::UnavailableError(absl::StrCat("the UCX connection to the server failed (", ucs_status_string(status),
                                              "): it is down or unreachable")));
}

std::shared_ptr<UcxContext::Op> UcxTransport::NewFetchOp(const FetchArgs& args, float* dest, TransferDone done,
                                                         int64_t offset, int64_t length) {
  auto op = std::make_shared<UcxContext::Op>();
  op->is_fetch = true;
  op->id = spec_.context->next_id_.fetch_add(1);
  op->timeout = spec_.rpc_timeout;
  op->what = absl::StrCat("fetch of unit ", args.unit, " version ", args.version, " from ",
                          Where(spec_.shard, spec_.address));
  if (length > 0) absl::StrAppend(&op->what, ", bytes ", offset, " to ", offset + length);
  op->done = std::move(done);
  op->cancel = args.cancel;
  op->fetch_args = args;
  op->dest = dest;
  op->piece_offset = offset;
  op->piece_length = length;
  op->fetch = ucx::FetchHeader{spec_.session_token, op->id, args.version, absl::ToInt64Milliseconds(spec_.rpc_timeout),
                               args.unit, static_cast<int32_t>(EncodingToProto(args.format.encoding())),
                               args.format.block()};
  op->fetch.byte_offset = offset;
  op->fetch.byte_length = length;
  return op;
}

void UcxTransport::Fetch(const FetchArgs& args, float* dest, TransferDone done) {
  const int64_t bytes = args.slice.length * static_cast<int64_t>(sizeof(float));
  if (args.format.encoding() != WireEncoding::kFp32 || bytes < 2 * kFetchPieceBytes) {
    return StartOp(NewFetchOp(args, dest, std::move(done), 0, 0));
  }
  // Even pieces of whole floats.
  const int64_t count = (bytes + kFetchPieceBytes - 1) / kFetchPieceBytes;
  const int64_t piece_floats = (args.slice.length + count - 1) / count;
  auto pieced = std::make_shared<UcxContext::PiecedFetch>();
  pieced->context = spec_.context;
  pieced->what = absl::StrCat("fetch of unit ", args.unit, " version ", args.version, " from ",
                              Where(spec_.shard, spec_.address));
  pieced->done = std::move(done);
  std::vector<std::shared_ptr<UcxContext::Op>> ops;
  for (int64_t first = 0; first < args.slice.length; first += piece_floats) {
    const int64_t offset = first * static_cast<int64_t>(sizeof(float));
    const int64_t length = std::min(piece_floats, args.slice.length - first) * static_cast<int64_t>(sizeof(float));
    const int piece = static_cast<int>(ops.size());
    ops.push_back(NewFetchOp(
        args, dest,
        [pieced, piece](absl::Status status, int64_t wire_bytes) { pieced->Ended(piece, std::move(status), wire_bytes); },
        offset, length));
    ops.back()->pieced = pieced;
    ops.back()->piece = piece;
    pieced->ids.push_back(ops.back()->id);
    pieced->lengths.push_back(length);
  }
  {
    absl::MutexLock lock(&pieced->mu);
    pieced->crcs.assign(ops.size(), 0);
    pieced->published.assign(ops.size(), 0);
    pieced->remaining = static_cast<int>(ops.size());
  }
  for (std::shared_ptr<UcxContext::Op>& op : ops) StartOp(std::move(op));
}

void UcxTransport::Push(const PushArgs& args, std::shared_ptr<const std::vector<float>> grads, TransferDone done) {
  auto op = std::make_shared<UcxContext::Op>();
  op->is_fetch = false;
  op->id = spec_.context->next_id_.fetch_add(1);
  op->timeout = spec_.rpc_timeout;
  op->what = absl::StrCat("push of unit ", args.unit, " step ", args.step, " to ", Where(spec_.shard, spec_.address));
  op->done = std::move(done);
  op->cancel = args.cancel;
  const std::span<const float> values(grads->data() + args.slice.begin, args.slice.length);
  op->payload_length = args.format.EncodedBytes(values.size());
  if (args.format.encoding() == WireEncoding::kFp32) {
    op->payload = values.data();
    op->grads = std::move(grads);  // held until the server has the bytes
  } else {
    op->encoded.reset(new std::byte[op->payload_length]);
    EncodeElements(args.format, values, op->encoded.get());
    op->payload = op->encoded.get();
  }
  op->push.token = spec_.session_token;
  op->push.request_id = op->id;
  op->push.step = args.step;
  op->push.slice_length = args.slice.length;
  op->push.trainer = args.first_rank;
  op->push.rank_count = args.rank_count;
  op->push.micro_batch = args.micro_batch;
  op->push.unit = args.unit;
  op->push.encoding = static_cast<int32_t>(EncodingToProto(args.format.encoding()));
  op->push.quant_block = args.format.block();
  op->push.non_finite = args.non_finite ? 1 : 0;
  StartOp(std::move(op));
}

void UcxTransport::StartOp(std::shared_ptr<UcxContext::Op> op) {
  if (health_->failed) {
    op->Finish(absl::UnavailableError("the UCX connection to the server failed earlier: it is down or unreachable"));
    return;
  }
  op->ep = endpoint_.ep;
  op->health = health_;
  op->owner = spec_.context;
  UcxContext* context = spec_.context;
  std::shared_ptr<CancelScope> cancel = op->cancel;
  const uint64_t id = op->id;
  if (!context->worker_->Post([context, op] { context->Start(op); })) {
    op->Finish(absl::CancelledError("the trainer's UCX context is shutting down"));
    return;
  }
  // Posted after the start: the cancel finds the op pending (or ended).
  // The context outlives every transfer of its client (ShardClient).
  if (cancel) cancel->OnCancel([context, id] { context->worker_->Post([context, id] { context->Cancel(id); }); });
}

}  // namespace pshard
