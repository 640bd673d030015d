// A TCP proxy on 127.0.0.1 in front of one server, for network-fault tests:
// it forwards every connection's bytes both ways and, when armed, resets
// every connection (RST to both ends) once a given number of bytes more has
// crossed in one direction: a reset in the middle of a fetch's response or
// of a push's request.
#ifndef PSHARD_TESTS_TESTUTIL_FAULT_PROXY_H_
#define PSHARD_TESTS_TESTUTIL_FAULT_PROXY_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace pshard::testing {

class FaultProxy {
 public:
  enum class Direction { kToServer, kToClient };
  /// Listens on 127.0.0.1:0 and forwards to `upstream_port` on 127.0.0.1.
  static absl::StatusOr<std::unique_ptr<FaultProxy>> Start(int upstream_port);
  /// Closes every connection and stops.
  ~FaultProxy();

  std::string address() const;
  /// Resets every open connection after `bytes` more bytes have crossed in
  /// `direction` (over all connections); replaces an armed reset.
  void ResetAfter(Direction direction, int64_t bytes);
  /// Whether an armed reset is still waiting for its bytes.
  bool armed() const;
  /// Connections reset so far.
  int64_t resets() const { return resets_.load(); }

 private:
  struct Connection;
  FaultProxy() = default;
  void Accept();
  void Pump(std::shared_ptr<Connection> connection);
  /// Counts `bytes` in `direction`; true when that fires the armed reset.
  bool Count(Direction direction, int64_t bytes);
  void ResetEverything();

  int listen_fd_ = -1;
  int port_ = 0;
  int upstream_port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread acceptor_;
  mutable absl::Mutex mu_;
  std::vector<std::shared_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> pumps_ ABSL_GUARDED_BY(mu_);
  bool armed_ ABSL_GUARDED_BY(mu_) = false;
  Direction armed_direction_ ABSL_GUARDED_BY(mu_) = Direction::kToClient;
  int64_t armed_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<int64_t> resets_{0};
};

}  // namespace pshard::testing

#endif  // PSHARD_TESTS_TESTUTIL_FAULT_PROXY_H_
