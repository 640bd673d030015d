// The UCX face of a shard server: fetch and push as active messages on one
// UCP worker, next to the gRPC service (which stays the control plane).
// Compiled only with UCX.
#ifndef PSHARD_SHARD_SERVER_UCX_UCX_SERVICE_H_
#define PSHARD_SHARD_SERVER_UCX_UCX_SERVICE_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "shard_server/server_metrics.h"
#include "shard_server/session_tokens.h"
#include "shard_server/connection_caps.h"
#include "shard_server/shard_state.h"

namespace pshard {

/// Serves one ShardState over UCX. Requests must carry a session token that
/// `tokens` knows (issued at Join); others are refused and change nothing.
/// Does not own `state`, `tokens` or `metrics`, which must outlive it.
class UcxService {
 public:
  struct Options {
    absl::Duration fetch_wait_limit = absl::Seconds(120);  ///< longest a fetch waits for a version
    /// Bounds the fetches held unanswered (per session); not owned; null: none.
    ConnectionCaps* waiting_fetches = nullptr;
  };
  static absl::StatusOr<std::unique_ptr<UcxService>> Start(ShardState* state, SessionTokens* tokens,
                                                           ServerMetrics* metrics, Options options);
  /// Stops serving; fetches still waiting for a version are dropped.
  ~UcxService();

  /// The worker address trainers connect to (JoinResponse.ucx_address).
  const std::string& address() const;

 private:
  struct Impl;
  explicit UcxService(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;  // shared with callbacks that may outlive a request
};

}  // namespace pshard

#endif  // PSHARD_SHARD_SERVER_UCX_UCX_SERVICE_H_
