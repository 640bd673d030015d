// Endpoints between pshard's UCP workers, on the transports UCX picks for the
// pair (shared memory on one host, tcp or RDMA between hosts): with UCX's
// peer failure detection between hosts, without it on one host (where
// shared memory cannot give it). Compiled only when UCX is (this header
// includes ucp.h).
#ifndef PSHARD_COMMON_UCX_UCX_ENDPOINT_H_
#define PSHARD_COMMON_UCX_UCX_ENDPOINT_H_

#include <ucp/api/ucp.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pshard::ucx {

/// How a dead or unreachable peer is noticed.
enum class PeerFailure {
  /// By UCX (its peer failure mode, with keepalive): for a peer on another
  /// host (tcp, RDMA). UCX 1.13's shared-memory transports do not support
  /// the mode: asked for it, UCX picks tcp instead, or fails to connect when
  /// UCX_TLS allows only shared memory.
  kUcx,
  /// By the endpoint's owner, by other means (a trainer watches the
  /// server's gRPC connection): for a peer on this host, so that UCX may
  /// use shared memory. UCX still reports the transport errors it sees to
  /// the error handler.
  kOwner,
};

/// An endpoint and what carries it.
struct Endpoint {
  ucp_ep_h ep = nullptr;
  /// The endpoint's lanes, as "transport/device" (e.g. "sysv/memory",
  /// "cma/memory", "tcp/eth0"), in lane order, without repeats.
  std::vector<std::string> transports;
  /// True in UCX's peer failure mode (PeerFailure::kUcx).
  bool detects_peer_failure = false;

  /// "sysv/memory + cma/memory (no peer failure detection)".
  std::string Describe() const;
};

/// On the worker's progress thread (in an active-message callback too: it
/// does not progress the worker): connects to the worker whose address is
/// `address`, over the transports UCX picks for the pair and `mode`.
/// `on_error` (with `arg`; null: none) hears of the endpoint's failures.
absl::StatusOr<Endpoint> Connect(ucp_worker_h worker, const void* address, PeerFailure mode,
                                 ucp_err_handler_cb_t on_error, void* arg);

/// On the progress thread, outside UCX's callbacks: closes `ep` at once
/// (pending operations end with an error), progressing the worker briefly
/// until the close completes.
void CloseNow(ucp_worker_h worker, ucp_ep_h ep);

/// Closes an endpoint at once, without progressing the worker (so also
/// inside UCX's callbacks): the close completes on its own. Null: nothing.
void CloseLater(ucp_ep_h ep);

/// The "transport/device" of each lane in `ucp_ep_print_info`'s text, in
/// lane order, without repeats. Exposed for tests.
std::vector<std::string> LaneTransports(absl::string_view ep_info);

}  // namespace pshard::ucx

#endif  // PSHARD_COMMON_UCX_UCX_ENDPOINT_H_
