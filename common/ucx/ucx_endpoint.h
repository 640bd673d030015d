// Endpoints between pshard's UCP workers, on the transports UCX picks for the
// pair (shared memory on one host, tcp or RDMA between hosts), with UCX's
// peer failure detection wherever those transports support it. Compiled only
// when UCX is (this header includes ucp.h).
#ifndef PSHARD_COMMON_UCX_UCX_ENDPOINT_H_
#define PSHARD_COMMON_UCX_UCX_ENDPOINT_H_

#include <ucp/api/ucp.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pshard::ucx {

/// An endpoint and what carries it.
struct Endpoint {
  ucp_ep_h ep = nullptr;
  /// The endpoint's lanes, as "transport/device" (e.g. "sysv/memory",
  /// "cma/memory", "tcp/eth0"), in lane order, without repeats.
  std::vector<std::string> transports;
  /// True when the endpoint runs in UCX's peer failure mode: a peer that
  /// dies or stops answering is reported to the error handler (UCX's
  /// keepalive). UCX's shared-memory transports do not support that mode
  /// (asking for it makes UCX pick tcp instead, or nothing when UCX_TLS
  /// allows only shared memory), so their endpoints run without it: the
  /// error handler hears of transport errors only, and the owner must notice
  /// a dead peer by other means.
  bool detects_peer_failure = false;

  /// "sysv/memory + cma/memory (no peer failure detection)".
  std::string Describe() const;
};

/// On the worker's progress thread: connects to the worker whose address is
/// `address`. The endpoint is made without peer failure mode first, so that
/// UCX picks the fastest transports for the pair; when every one of them
/// supports peer failure detection it is made again in that mode.
/// `on_error` (with `arg`) hears of the endpoint's failures either way.
absl::StatusOr<Endpoint> Connect(ucp_worker_h worker, const void* address, ucp_err_handler_cb_t on_error,
                                 void* arg);

/// On the progress thread: closes `ep` at once (pending operations end with
/// an error), progressing the worker briefly until the close completes.
void CloseNow(ucp_worker_h worker, ucp_ep_h ep);

/// The "transport/device" of each lane in `ucp_ep_print_info`'s text, in
/// lane order, without repeats. Exposed for tests.
std::vector<std::string> LaneTransports(absl::string_view ep_info);

/// False for the transports UCX runs without peer failure detection
/// (shared memory and same-process ones: sysv, posix, cma, knem, xpmem,
/// self, and the GPU copy and IPC ones). `transport` is "name" or
/// "name/device".
bool SupportsPeerFailure(absl::string_view transport);

}  // namespace pshard::ucx

#endif  // PSHARD_COMMON_UCX_UCX_ENDPOINT_H_
