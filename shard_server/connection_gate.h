// The shard server's listening socket, owned here rather than by gRPC, so
// that connections are counted and capped before gRPC spends memory on
// them: each one costs the server about 150 KiB from its TLS handshake on
// (buffers, TLS and HTTP/2 state), whether or not its caller ever proves
// who it is. A connection past the caps is closed at once, unanswered;
// the rest are handed to gRPC (an external connection acceptor), which
// closes any that has not finished its TLS handshake and HTTP/2 settings
// within the handshake deadline.
#ifndef PSHARD_SHARD_SERVER_CONNECTION_GATE_H_
#define PSHARD_SHARD_SERVER_CONNECTION_GATE_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "common/metrics/metrics.h"
#include "grpcpp/server_builder.h"
#include "shard_server/connection_caps.h"

namespace pshard {

class ConnectionGate {
 public:
  /// Listens on `address` (host:port; port 0 picks a free one; every
  /// address the host resolves to, on one port). Open connections are
  /// counted in `caps` (one per connection, per peer host and in all);
  /// `refused` (may be null) counts those closed for a cap.
  static absl::StatusOr<std::unique_ptr<ConnectionGate>> Listen(const std::string& address, ConnectionCaps* caps,
                                                                metrics::Counter* refused);
  ConnectionGate(const ConnectionGate&) = delete;
  ConnectionGate& operator=(const ConnectionGate&) = delete;
  ~ConnectionGate();  // stops accepting and closes the listening sockets

  int port() const { return port_; }
  /// Starts accepting, handing connections to `acceptor` (of a started
  /// gRPC server, which must outlive this gate).
  void Start(grpc::experimental::ExternalConnectionAcceptor* acceptor);

 private:
  ConnectionGate(std::vector<int> listeners, int port, ConnectionCaps* caps, metrics::Counter* refused);
  void Run();
  void Accept(int listener);
  void ForgetClosed();

  const std::vector<int> listeners_;
  const int port_;
  ConnectionCaps* const caps_;
  metrics::Counter* const refused_;
  int wake_ = -1;  // an eventfd: written to stop Run
  grpc::experimental::ExternalConnectionAcceptor* acceptor_ = nullptr;
  // Connections handed to gRPC, by descriptor: the socket's inode tells
  // whether the descriptor still holds it (gRPC closes it, and the number
  // may be reused). The thread of Run only.
  struct Open {
    ino_t inode = 0;
    std::shared_ptr<ConnectionCaps::Place> place;
  };
  absl::flat_hash_map<int, Open> open_;
  int64_t refusals_logged_ = 0;
  std::thread thread_;
};

}  // namespace pshard

#endif  // PSHARD_SHARD_SERVER_CONNECTION_GATE_H_
