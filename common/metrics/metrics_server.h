// Serves a Registry at /metrics over HTTP (civetweb), for Prometheus to scrape.
#ifndef PSHARD_COMMON_METRICS_METRICS_SERVER_H_
#define PSHARD_COMMON_METRICS_METRICS_SERVER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/metrics/metrics.h"

namespace pshard::metrics {

/// A running HTTP endpoint. GET /metrics returns registry->Serialize() with
/// Content-Type `text/plain; version=0.0.4`; other paths are 404.
class MetricsServer {
 public:
  /// Listens on `address` ("host:port"; port 0 picks a free port). The
  /// registry must outlive the server.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& address,
                                                              const Registry* registry);
  /// Stops serving; may block up to ~2 s (civetweb's poll interval).
  ~MetricsServer();
  int port() const { return port_; }
  std::string address() const;

 private:
  MetricsServer() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
  std::string host_;
};

}  // namespace pshard::metrics

#endif  // PSHARD_COMMON_METRICS_METRICS_SERVER_H_
