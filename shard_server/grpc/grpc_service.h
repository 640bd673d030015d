// The gRPC face of a shard server (callback API). Status conversion happens
// here and nowhere below.
#ifndef PSHARD_SHARD_SERVER_GRPC_GRPC_SERVICE_H_
#define PSHARD_SHARD_SERVER_GRPC_GRPC_SERVICE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "common/security/caller_authenticator.h"
#include "proto/shard.grpc.pb.h"
#include "shard_server/norm_coordinator.h"
#include "shard_server/rendezvous.h"
#include "shard_server/server_metrics.h"
#include "shard_server/session_tokens.h"
#include "shard_server/connection_caps.h"
#include "shard_server/shard_state.h"

namespace pshard {

/// The generated callback service, with the data-carrying methods (Fetch,
/// Push) taking their messages as raw frames (proto/chunk_frame.h) so that
/// their bytes are not copied through protobuf.
using ShardServiceBase = v1::ShardService::WithCallbackMethod_Join<
    v1::ShardService::WithRawCallbackMethod_Fetch<v1::ShardService::WithRawCallbackMethod_Push<
        v1::ShardService::WithCallbackMethod_AgreeNorm<v1::ShardService::WithCallbackMethod_GetStatus<
            v1::ShardService::WithCallbackMethod_Announce<v1::ShardService::WithCallbackMethod_ReadMaster<
                v1::ShardService::WithCallbackMethod_Rendezvous<
                    v1::ShardService::WithCallbackMethod_RollBack<v1::ShardService::Service>>>>>>>>>;

/// Serves one ShardState. Does not own it. Thread-safe.
class ShardServiceImpl final : public ShardServiceBase {
 public:
  struct Options {
    absl::Duration fetch_wait_limit = absl::Seconds(120);  ///< longest a fetch waits for a version
    absl::Duration norm_wait_limit = absl::Seconds(120);   ///< longest AgreeNorm waits (coordinator)
    int64_t fetch_chunk_bytes = 1 << 20;                   ///< bytes per streamed fetch chunk
    std::string metrics_address;                           ///< reported by GetStatus
    std::string ucx_address;  ///< JoinResponse.ucx_address: the UCX worker's; empty: no UCX
    SessionTokens* tokens = nullptr;  ///< issues JoinResponse.session_token; not owned, required
    /// Bound the fetches held unanswered and the bytes of pushes not yet
    /// complete; not owned; null: no bound.
    ConnectionCaps* waiting_fetches = nullptr;
    ConnectionCaps* push_bytes = nullptr;
    /// Where this shard reaches shard 0 (empty on shard 0), and the address
    /// shard 0 gives for itself in GetStatus (its listening address).
    std::string coordinator_address;
    std::string own_address;
    /// Checks every call's caller (not owned); null: every caller is served.
    CallerAuthenticator* authenticator = nullptr;
    /// Takes the server back to its checkpoint of `step` for trainer `rank`
    /// (the RollBack RPC; blocks while the step driver stops and restarts)
    /// and returns the step it is at; empty: RollBack is refused.
    /// `restarted`: the RollBack's restarted_addresses (checked by the callee).
    std::function<absl::StatusOr<int64_t>(int64_t step, int rank, const std::vector<std::string>& restarted)>
        roll_back;
    /// GetStatus.restored_step: the step restored from a checkpoint at start
    /// (-1: none).
    int64_t restored_step = -1;
    /// Shard 0 of a job without TLS or tokens, where anyone may call
    /// Announce: true when shard `shard` answers at `address` (a probe with
    /// a short deadline). An Announce that would move a shard to another
    /// address is refused while it still answers at its old one. Empty: no
    /// probe (callers are authenticated as servers).
    std::function<bool(const std::string& address, int shard)> answers_as_shard;
  };
  /// `coordinator` is null except on shard 0. `metrics` must outlive the service.
  ShardServiceImpl(ShardState* state, NormCoordinator* coordinator, ServerMetrics* metrics, Options options);

  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* ctx, const v1::JoinRequest* request,
                                 v1::JoinResponse* response) override;
  /// A FetchRequest in; FetchChunk frames out.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Fetch(grpc::CallbackServerContext* ctx,
                                                    const grpc::ByteBuffer* request) override;
  /// PushChunk frames in; a PushResponse out.
  grpc::ServerReadReactor<grpc::ByteBuffer>* Push(grpc::CallbackServerContext* ctx,
                                                  grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* AgreeNorm(grpc::CallbackServerContext* ctx,
                                      const v1::NormReport* request,
                                      v1::NormAgreement* response) override;
  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* ctx,
                                      const v1::StatusRequest* request,
                                      v1::StatusResponse* response) override;
  grpc::ServerUnaryReactor* Announce(grpc::CallbackServerContext* ctx, const v1::AnnounceRequest* request,
                                      v1::AnnounceResponse* response) override;
  grpc::ServerUnaryReactor* ReadMaster(grpc::CallbackServerContext* ctx,
                                       const v1::ReadMasterRequest* request,
                                       v1::ReadMasterResponse* response) override;
  grpc::ServerUnaryReactor* Rendezvous(grpc::CallbackServerContext* ctx,
                                       const v1::RendezvousRequest* request,
                                       v1::RendezvousResponse* response) override;

  grpc::ServerUnaryReactor* RollBack(grpc::CallbackServerContext* ctx, const v1::RollBackRequest* request,
                                     v1::RollBackResponse* response) override;

  /// Answers waiting rendezvous calls (before the gRPC server shuts down,
  /// which waits for every call to finish).
  void StopWaiting() { rendezvous_.Close(); }

  /// The wait deadline for a call: the sooner of the server's limit and a
  /// moment before the client's deadline, so that the client receives the
  /// server's explanation rather than a bare DEADLINE_EXCEEDED.
  static absl::Time WaitDeadline(const grpc::CallbackServerContext* ctx, absl::Duration limit);

 private:
  /// The refusal of a call whose caller may not make it (counted), or OK.
  /// Who may call what: trainers join, fetch, push and meet in rendezvous;
  /// servers agree norms and announce themselves; readers (tools) join
  /// without a rank, fetch and read masters; every role reads the status.
  /// `needs_trainer`: only the trainer role will do (a Join with a rank).
  /// `role`, when given, is set to the caller's (nullopt without
  /// authentication: every caller is trusted as a trainer).
  absl::Status Authorize(const grpc::CallbackServerContext* ctx, RpcMethod method, bool needs_trainer = false,
                         std::optional<Role>* role = nullptr);
  /// Finishes a unary call, recording its duration and any refusal.
  void FinishUnary(grpc::ServerUnaryReactor* reactor, RpcMethod method, absl::Time start,
                   const absl::Status& status);

  ShardState* const state_;
  NormCoordinator* const coordinator_;
  ServerMetrics* const metrics_;
  const Options options_;
  const uint64_t fingerprint_;
  absl::Mutex joined_mu_;
  std::map<int, std::string> joined_ ABSL_GUARDED_BY(joined_mu_);  // rank -> metrics address
  RendezvousTable rendezvous_;
  absl::Mutex shards_mu_;
  std::vector<std::string> shard_addresses_ ABSL_GUARDED_BY(shards_mu_);  // shard 0: as announced
};

}  // namespace pshard

#endif  // PSHARD_SHARD_SERVER_GRPC_GRPC_SERVICE_H_
