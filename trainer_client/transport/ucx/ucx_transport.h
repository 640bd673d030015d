// The UCX data path of a trainer: fetches and pushes as active messages to
// the shard servers' UCP workers (tcp, shared memory, RDMA where present).
// Compiled only with UCX (ShardClient uses it under PSHARD_WITH_UCX).
#ifndef PSHARD_TRAINER_CLIENT_TRANSPORT_UCX_UCX_TRANSPORT_H_
#define PSHARD_TRAINER_CLIENT_TRANSPORT_UCX_UCX_TRANSPORT_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/deadline_timer.h"
#include "common/serial_executor.h"
#include "common/ucx/ucx_endpoint.h"
#include "common/ucx/ucx_worker.h"
#include "grpcpp/channel.h"
#include "trainer_client/transport/transport.h"

namespace pshard {

/// One trainer's UCP context, worker and progress thread, shared by the
/// UcxTransports of all its links. Owns the requests in flight: replies are
/// matched to them by id. Destroy after every UcxTransport that uses it;
/// requests still in flight then end with Cancelled. Thread-safe.
class UcxContext {
 public:
  /// Starts UCX (reading its UCX_* environment). Fails when UCX cannot run
  /// here, e.g. when UCX_TLS names no usable transport.
  static absl::StatusOr<std::unique_ptr<UcxContext>> Create();
  ~UcxContext();

  struct Op;  // one request in flight (ucx_transport.cc)
  struct PiecedFetch;  // a slice fetched as pieces (ucx_transport.cc)
  /// The state of one transport's endpoint, shared by the transport, its
  /// requests and the watch of its control channel.
  struct Health {
    std::atomic<bool> failed{false};  // the connection failed: new ops fail at once
    bool was_ready = false;           // the control channel was ready once (timer thread only)
    bool closed = false;              // the context closed the endpoint (progress thread only)
  };

 private:
  friend struct Op;
  friend class UcxTransport;
  UcxContext() = default;
  /// On the progress thread: registers `op`, sends it, and arms its deadline.
  void Start(std::shared_ptr<Op> op);
  void Expire(uint64_t id);
  /// Ends a pending op with Cancelled (its CancelScope was cancelled).
  void Cancel(uint64_t id);
  /// Ends every pending op on `ep` (whose connection failed) with `status`,
  /// but those whose data is landing in their destination: the end of the
  /// receive ends them.
  void FailEndpoint(ucp_ep_h ep, const absl::Status& status);
  /// Fails `ep` (FailEndpoint) and closes it, forced, which ends the
  /// receives in flight on it with an error: the only way to end a receive
  /// from a server that stopped mid-transfer. Once per endpoint; the
  /// transport then no longer closes it.
  void CloseEndpoint(ucp_ep_h ep, Health& health, const absl::Status& status);
  std::shared_ptr<Op> Take(uint64_t id);
  static ucs_status_t OnReply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                              const ucp_am_recv_param_t* param);
  static void OnFetchData(void* request, ucs_status_t status, size_t length, void* user_data);
  // A rendezvous slice announced by its server, waiting to be received.
  struct Arrived {
    std::shared_ptr<Op> op;
    void* descriptor = nullptr;  // UCX's, for ucp_am_recv_data_nbx
    void* target = nullptr;
    size_t length = 0;
  };
  /// Starts receiving queued slices (or pieces) while fewer than
  /// kReceivesInFlight are.
  void StartReceives();
  void Receive(Arrived arrived);
  static constexpr int kReceivesInFlight = 4;

  std::unique_ptr<ucx::UcxWorker> worker_;
  std::atomic<uint64_t> next_id_{1};
  absl::flat_hash_map<uint64_t, std::shared_ptr<Op>> pending_;  // progress thread only
  std::deque<Arrived> arrived_;  // progress thread only
  int receiving_ = 0;            // progress thread only
  DeadlineTimer timer_;  // request deadlines; after worker_: destroyed first
  // Verifies and decodes rendezvous slices off the progress thread, so that
  // it keeps receiving the other slices meanwhile; drained first.
  SerialExecutor verifier_;
};

/// The data path to one shard server over UCX. Same semantics and error
/// texts as GrpcTransport (no link emulation). Thread-safe.
class UcxTransport final : public Transport {
 public:
  struct Spec {
    UcxContext* context = nullptr;  ///< not owned; outlives the transport
    int shard = 0;
    std::string address;      ///< the server's gRPC address (for messages)
    std::string ucx_address;  ///< JoinResponse.ucx_address
    uint64_t session_token = 0;  ///< JoinResponse.session_token
    absl::Duration rpc_timeout = absl::Seconds(120);  ///< deadline of each fetch or push
    /// The gRPC channel to the same server. Where the endpoint's transports
    /// cannot detect a dead peer (shared memory), the transport watches this
    /// channel instead: once it has been ready, leaving that state (the
    /// server's process is gone, or restarted) fails the link, and every
    /// transfer on it, at once. Null: no watch (transfers then end at their
    /// deadline when the server dies).
    std::shared_ptr<grpc::ChannelInterface> control_channel;
  };
  /// Creates the endpoint to the server's worker.
  static absl::StatusOr<std::unique_ptr<UcxTransport>> Create(Spec spec);
  /// Closes the endpoint; requests still in flight end with an error.
  ~UcxTransport() override;

  /// An fp32 slice of at least twice this is fetched in pieces of about it.
  static constexpr int64_t kFetchPieceBytes = 4 << 20;

  std::string name() const override { return "ucx"; }
  /// "ucx over sysv/memory + cma/memory (...)".
  std::string description() const override;
  /// The endpoint's transports, e.g. {"sysv/memory", "cma/memory"}.
  const std::vector<std::string>& ucx_transports() const { return endpoint_.transports; }
  /// fp32 slices arriving by rendezvous are received straight into `dest`,
  /// a large one as pieces of kFetchPieceBytes, each verified as soon as it
  /// is in (while it is still in the cache, and while later pieces move),
  /// their checksums joined into the slice's.
  void Fetch(const FetchArgs& args, float* dest, TransferDone done) override;
  void Push(const PushArgs& args, std::shared_ptr<const std::vector<float>> grads, TransferDone done) override;

 private:
  explicit UcxTransport(Spec spec) : spec_(std::move(spec)) {}
  void StartOp(std::shared_ptr<UcxContext::Op> op);
  /// UCX's error callback of the endpoint (progress thread).
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static constexpr absl::Duration kControlChannelCheck = absl::Milliseconds(100);
  /// A new op for the fetch of `args` (or of its piece of `length` bytes
  /// from byte `offset`) into `dest`.
  std::shared_ptr<UcxContext::Op> NewFetchOp(const FetchArgs& args, float* dest, TransferDone done, int64_t offset,
                                             int64_t length);
  using Health = UcxContext::Health;
  /// On the context's timer: checks the control channel, and fails the
  /// link or checks again soon. Ends with the transport.
  static void WatchControlChannel(std::weak_ptr<Health> health, UcxContext* context, ucp_ep_h ep,
                                  std::shared_ptr<grpc::ChannelInterface> channel, std::string where);
  const Spec spec_;
  ucx::Endpoint endpoint_;  // endpoint_.ep is used on the progress thread only
  std::shared_ptr<Health> health_ = std::make_shared<Health>();
};

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_TRANSPORT_UCX_UCX_TRANSPORT_H_
