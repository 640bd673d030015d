// UCX: the shard server's active-message handlers (hello, fetch, push) as
// a peer on the network reaches them, over a real UCX endpoint to a real
// UcxService on the shard. Each record is one active message:
//   byte 0  which handler: 0 hello, 1 fetch, 2 push, else the id byte 0 - 3
//           (ids without a handler, among them the replies' and ids
//           beyond the last one registered)
//   byte 1  whose session token goes into the header's first 8 bytes:
//           0 trainer 0's, 1 trainer 1's, 2 a reader's, 3 one never
//           issued, else the header's own bytes
//   byte 2  the header's length (cut or zero-padded to it)
//   then    the header's bytes, and the rest is the message's data.
// After each message the harness waits for what must come back: a fetch or a
// push whose header has the right size is answered (an error or the slice)
// within seconds; a refused push changes nothing the step waits for; a
// served slice is whole, at the version asked, and matches its checksum.
// When the pushes complete the step it closes as the step driver would, and
// the shard serves the new version.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/checksum.h"
#include "common/ucx/ucx_endpoint.h"
#include "common/ucx/ucx_wire.h"
#include "common/ucx/ucx_worker.h"
#include "fuzz/harness.h"
#include "fuzz/in_process_shard.h"
#include "fuzz/service_checks.h"
#include "proto/rpc_util.h"
#include "shard_server/ucx/ucx_service.h"

namespace pshard::fuzz {
namespace {

// What came back for one request id.
struct Reply {
  ucx::ReplyHeader header;
  bool rendezvous = false;  // its data was not received (only its header is checked)
  std::string data;         // an eager reply's data
};

// The trainer's side: a worker whose reply handler files replies by id.
class Peer {
 public:
  static std::unique_ptr<Peer> Connect(const std::string& server_address) {
    auto peer = std::unique_ptr<Peer>(new Peer());
    absl::StatusOr<std::unique_ptr<ucx::UcxWorker>> worker = ucx::UcxWorker::Create(
        {{ucx::kFetchReply, &Peer::OnReply, peer.get()}, {ucx::kPushReply, &Peer::OnReply, peer.get()}});
    Require(worker.ok(), absl::StrCat("the harness's UCX worker: ", worker.status().ToString()));
    peer->worker_ = std::move(*worker);
    absl::Notification connected;
    absl::Status status;
    peer->worker_->Post([&] {
      absl::StatusOr<ucx::Endpoint> ep =
          ucx::Connect(peer->worker_->worker(), server_address.data(), ucx::PeerFailure::kOwner, &Peer::OnError, nullptr);
      if (ep.ok()) peer->ep_ = ep->ep;
      status = ep.status();
      connected.Notify();
    });
    connected.WaitForNotification();
    Require(status.ok(), absl::StrCat("the harness's UCX endpoint: ", status.ToString()));
    return peer;
  }

  ~Peer() {
    worker_->Stop([this] {
      ucx::CloseNow(worker_->worker(), ep_);
    });
  }

  // Sends one active message; its bytes are copied first.
  void Send(uint16_t id, std::string header, std::string data) {
    auto bytes = std::make_shared<std::pair<std::string, std::string>>(std::move(header), std::move(data));
    absl::Notification sent;
    worker_->Post([&, bytes] {
      ucx::SendAm(ep_, id, bytes->first.data(), bytes->first.size(), bytes->second.data(), bytes->second.size(),
                  /*reply=*/true, [bytes](ucs_status_t) {});
      sent.Notify();
    });
    sent.WaitForNotification();
  }

  const std::string& address() const { return worker_->address(); }

  // The reply to `request_id`, once it came, or nothing by `deadline`.
  std::optional<Reply> Await(uint64_t request_id, absl::Duration deadline) {
    absl::MutexLock lock(&mu_);
    auto arrived = [&] { return replies_.count(request_id) > 0; };
    mu_.AwaitWithTimeout(absl::Condition(&arrived), deadline);
    auto it = replies_.find(request_id);
    if (it == replies_.end()) return std::nullopt;
    Reply reply = std::move(it->second);
    replies_.erase(it);
    return reply;
  }

 private:
  Peer() = default;

  static ucs_status_t OnReply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                              const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Peer*>(arg);
    Reply reply;
    Require(ucx::ReadHeader(header, header_length, &reply.header), "a reply's header has the wrong size");
    reply.rendezvous = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    if (!reply.rendezvous && length > 0) reply.data.assign(static_cast<const char*>(data), length);
    absl::MutexLock lock(&self->mu_);
    self->replies_[reply.header.request_id] = std::move(reply);
    return UCS_OK;  // rendezvous data not asked for is dropped
  }
  // A failed endpoint shows as answers that do not come.
  static void OnError(void*, ucp_ep_h, ucs_status_t) {}

  std::unique_ptr<ucx::UcxWorker> worker_;
  ucp_ep_h ep_ = nullptr;  // the worker's thread only
  absl::Mutex mu_;
  std::map<uint64_t, Reply> replies_ ABSL_GUARDED_BY(mu_);
};

constexpr absl::Duration kAnswerWithin = absl::Seconds(5);

void FuzzUcx(FuzzInput input) {
  InProcessShard shard;
  UcxService::Options options;
  options.fetch_wait_limit = kServerWaitLimit;
  absl::StatusOr<std::unique_ptr<UcxService>> service =
      UcxService::Start(&shard.state(), &shard.tokens(), &shard.metrics(), options);
  Require(service.ok(), absl::StrCat("UcxService::Start: ", service.status().ToString()));
  std::unique_ptr<Peer> peer = Peer::Connect((*service)->address());
  const uint64_t tokens[] = {shard.tokens().Issue(0).value(), shard.tokens().Issue(1).value(), shard.tokens().Issue(-1).value(),
                             0x5eed5eed5eed5eedull};
  uint64_t probe_count = 0;
  for (std::string_view record : input.Records(16)) {
    if (record.size() < 3) continue;
    const uint8_t which = static_cast<uint8_t>(record[0]);
    const uint16_t id = which == 0 ? ucx::kHello : which == 1 ? ucx::kFetchRequest
                        : which == 2 ? ucx::kPushRequest : static_cast<uint16_t>(which - 3);
    const uint8_t token_choice = static_cast<uint8_t>(record[1]);
    const size_t header_length = static_cast<uint8_t>(record[2]);
    std::string header(record.substr(3, header_length));
    header.resize(header_length, '\0');
    if (token_choice < 4 && header.size() >= sizeof(uint64_t)) {
      std::memcpy(header.data(), &tokens[token_choice], sizeof(uint64_t));
    }
    std::string data(record.size() > 3 + header_length ? record.substr(3 + header_length) : std::string_view());
    // A hello's data is a worker address, which UCX itself parses: the
    // harness's own, so that the server answers over an endpoint to it.
    if (id == ucx::kHello) data = peer->address();
    // The harness is on the server's host and reaches it without UCX's peer
    // failure mode, so its hello says so: a hello that says otherwise makes
    // the server's endpoint ask for that mode, and UCX 1.13 aborts the
    // process when two endpoints between the same workers differ in it
    // ("asymmetric endpoint configuration"; docs/security.md).
    if (id == ucx::kHello && header.size() == sizeof(ucx::HelloHeader)) {
      ucx::HelloHeader hello;
      std::memcpy(&hello, header.data(), sizeof(hello));
      hello.flags = ucx::kHelloSameHost;
      std::memcpy(header.data(), &hello, sizeof(hello));
    }

    const std::string pending = PendingContributions(shard.state());
    const bool is_fetch = id == ucx::kFetchRequest && header.size() == sizeof(ucx::FetchHeader);
    const bool is_push = id == ucx::kPushRequest && header.size() == sizeof(ucx::PushHeader);
    uint64_t request_id = 0;
    if (is_fetch || is_push) std::memcpy(&request_id, header.data() + sizeof(uint64_t), sizeof(request_id));
    peer->Send(id, header, data);
    if (!is_fetch && !is_push) {
      // No answer to wait for: a fetch that is refused at once, sent after
      // it on the same endpoint, is answered once the server has taken the
      // message in (UCX delivers one endpoint's messages in order).
      ucx::FetchHeader probe;
      probe.token = tokens[0];
      probe.request_id = ~0ull - probe_count++;
      probe.version = -1;
      std::string probe_bytes(reinterpret_cast<const char*>(&probe), sizeof(probe));
      peer->Send(ucx::kFetchRequest, probe_bytes, "");
      std::optional<Reply> answer = peer->Await(probe.request_id, kAnswerWithin);
      Require(answer.has_value() && answer->header.status_code != 0,
              absl::StrCat("the server stopped answering after a message of id ", id));
      continue;
    }
    std::optional<Reply> reply = peer->Await(request_id, kAnswerWithin);
    Require(reply.has_value(), absl::StrCat(is_fetch ? "fetch" : "push", " ", request_id, " got no answer within ",
                                            absl::FormatDuration(kAnswerWithin)));
    if (is_push) {
      if (reply->header.status_code != 0) {
        Require(PendingContributions(shard.state()) == pending, "a refused UCX push changed the step's contributions");
      }
      continue;
    }
    ucx::FetchHeader h;
    std::memcpy(&h, header.data(), sizeof(h));
    if (reply->header.status_code != 0) continue;
    Require(reply->header.version == h.version, "a slice was served at another version than asked");
    Require(h.unit >= 0 && h.unit < shard.state().num_units(), "a slice of a unit that does not exist was served");
    Require(reply->header.slice_length == shard.state().slice_length(h.unit), "a served slice is not whole");
    if (h.byte_length != 0) {
      // A piece: fp32 only, within the slice; its bytes are the slice's there.
      Require(h.encoding == static_cast<int32_t>(EncodingToProto(WireEncoding::kFp32)),
              "a piece of a slice was served in another encoding");
      const int64_t slice_bytes = shard.state().slice_length(h.unit) * static_cast<int64_t>(sizeof(float));
      Require(h.byte_offset >= 0 && h.byte_length > 0 && h.byte_offset <= slice_bytes - h.byte_length,
              "a piece outside its slice was served");
      if (!reply->rendezvous) {
        absl::StatusOr<std::shared_ptr<const PublishedSlice>> slice =
            shard.state().Published(h.unit, h.version, WireFormat(WireEncoding::kFp32));
        Require(slice.ok() && reply->data.size() == static_cast<size_t>(h.byte_length) &&
                    std::memcmp(reply->data.data(), (*slice)->bytes().data() + h.byte_offset, reply->data.size()) == 0,
                "a served piece is not the slice's bytes at its offset");
      }
    } else if (!reply->rendezvous) {
      Require(Crc32c(reply->data.data(), reply->data.size()) == reply->header.checksum,
              "a served slice does not match its checksum");
    }
  }
  if (shard.CloseStepIfComplete()) CheckClosedStep(shard, 1);
  peer.reset();
  service->reset();
  shard.StatusOrDie();
}

}  // namespace
}  // namespace pshard::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pshard::fuzz::FuzzUcx(pshard::fuzz::FuzzInput(data, size));
  return 0;
}
