// `pshard status`: one table of a running job, from the shard servers'
// GetStatus and the trainers' /metrics endpoints (which the servers list).
#ifndef PSHARD_TOOLS_CLUSTER_STATUS_H_
#define PSHARD_TOOLS_CLUSTER_STATUS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/security/security.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/metrics/metrics.h"

namespace pshard {

/// A page of the Prometheus text exposition format 0.0.4, parsed just
/// enough to read single samples and check names.
struct MetricsText {
  struct Sample {
    std::string name;  ///< as written, e.g. `pshard_trainer_step_seconds_bucket`
    metrics::Labels labels;
    double value = 0.0;
  };
  std::vector<Sample> samples;                ///< in page order
  std::map<std::string, std::string> help;    ///< family name -> `# HELP` text (unescaped)
  std::map<std::string, std::string> type;    ///< family name -> `# TYPE` word
};

/// Parses `text`. Other comments and blank lines are skipped; timestamps
/// after a value are ignored. A malformed line is an InvalidArgument error
/// that names its line number.
absl::StatusOr<MetricsText> ParseMetricsText(absl::string_view text);

/// The value of the one sample named `name` whose labels include every pair
/// of `labels` (more labels on the sample are fine). NotFound when there is
/// none, FailedPrecondition when several match.
absl::StatusOr<double> SampleValue(const MetricsText& page, absl::string_view name,
                                   const metrics::Labels& labels = {});

/// GET http://`address``path` ("host:port", IPv6 hosts in brackets) over
/// HTTP/1.0. The whole exchange (resolve, connect, send, read) ends by
/// `timeout`. Returns the body of a 200 response; any other status is an
/// error that carries the status line.
absl::StatusOr<std::string> HttpGet(const std::string& address, const std::string& path, absl::Duration timeout);

/// One shard server as `pshard status` shows it.
struct ShardServerStatus {
  std::string address;        ///< gRPC address queried
  absl::Status error;         ///< not OK: the server is DOWN and the rest is unset
  int shard = -1;
  int64_t step = 0;           ///< the step it collects gradients for
  int64_t state_bytes = 0;
  int64_t applied_updates = 0;
  int64_t skipped_steps = 0;
  std::string waiting_for;
  std::string metrics_address;  ///< its /metrics endpoint; empty if none
  std::map<int, std::string> joined_trainers;  ///< rank -> the trainer's /metrics endpoint
  /// Shard 0 only: every shard's address as announced ("" where unknown).
  std::vector<std::string> shard_addresses;
  /// The other shards: where they reach shard 0.
  std::string coordinator_address;
};

/// One trainer, read from its /metrics endpoint.
struct TrainerStatus {
  int rank = -1;
  std::string metrics_address;  ///< empty: the trainer reported no endpoint
  absl::Status error;           ///< not OK: the scrape or a sample failed
  int64_t step = 0;             ///< steps completed (the step it trains next)
  double tokens_per_second = 0.0;  ///< tokens / step wall time, since start
  double comm_exposed_fraction = 0.0;  ///< exposed comm / step wall time, since start
  double loss = 0.0;
  double grad_norm = 0.0;
  /// Its run settings (pshard_trainer_config_info's labels but rank), as
  /// "key=value" words; empty when the trainer does not export them.
  std::string settings;
};

struct ClusterStatus {
  std::vector<ShardServerStatus> servers;  ///< in the order given
  std::vector<TrainerStatus> trainers;     ///< every rank any server lists, by rank
  /// True when every server answered and every trainer was read.
  bool Healthy() const;
};

/// Reads a trainer's row from its scraped page. Errors name the missing sample.
absl::Status ReadTrainerStatus(const MetricsText& page, TrainerStatus* status);

/// Every shard's address in shard order, found from any one server of the
/// job (`address`): shard 0 lists what the shards announced to it, and the
/// other shards name shard 0. An error names what is missing.
/// `security`: the reader's credentials (null: plaintext, no token).
absl::StatusOr<std::vector<std::string>> DiscoverShardAddresses(const std::string& address,
                                                                absl::Duration timeout,
                                                                const ClientSecurity* security = nullptr);

/// Calls GetStatus on every server and scrapes every trainer they list, all
/// in parallel, each with `timeout`. Never fails: what did not answer is
/// reported in its row.
ClusterStatus QueryClusterStatus(const std::vector<std::string>& servers, absl::Duration timeout,
                                 const ClientSecurity* security = nullptr);

/// The two tables (servers, then trainers) as aligned text.
std::string FormatClusterStatus(const ClusterStatus& status);

}  // namespace pshard

#endif  // PSHARD_TOOLS_CLUSTER_STATUS_H_
