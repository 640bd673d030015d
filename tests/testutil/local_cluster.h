// N real shard servers in this process on 127.0.0.1:0, for tests.
#ifndef PSHARD_TESTS_TESTUTIL_LOCAL_CLUSTER_H_
#define PSHARD_TESTS_TESTUTIL_LOCAL_CLUSTER_H_

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/job_config.h"
#include "common/security/security.h"
#include "shard_server/server.h"
#include "trainer_client/shard_client.h"

namespace pshard::testing {

class LocalCluster {
 public:
  struct Options {
    absl::Duration fetch_wait_limit = absl::Seconds(60);
    absl::Duration step_timeout = absl::Seconds(30);
    int max_message_bytes = 4 << 20;
    int64_t fetch_chunk_bytes = 1 << 20;
    std::string metrics_address;  ///< e.g. "127.0.0.1:0"; empty: no endpoint
    std::string checkpoint_dir;   ///< shared by the shards (file names differ)
    int64_t checkpoint_every = 0;
    int64_t resume_step = -1;
    int checkpoint_keep = 2;
    bool continue_on_checkpoint_failure = false;
    bool start_fresh = false;
    bool allow_schedule_change = false;
    std::string init_from;  ///< the servers' initial-weights file (empty: none)
    /// The servers' TLS and token settings.
    SecurityOptions security;
    /// The credentials Connect and ReadMasterWeights use, by role (a rank
    /// connects as a trainer, -1 as a reader).
    std::array<SecurityOptions, kNumRoles> client_security;
  };
  /// Starts shard 0 (the coordinator) and then shards 1..N-1.
  static absl::StatusOr<std::unique_ptr<LocalCluster>> Start(const JobConfig& job, Options options);
  static absl::StatusOr<std::unique_ptr<LocalCluster>> Start(const JobConfig& job) {
    return Start(job, Options());
  }

  /// Addresses in shard order.
  std::vector<std::string> addresses() const;
  ShardServer& server(int shard) { return *servers_[shard]; }
  int num_shards() const { return static_cast<int>(servers_.size()); }

  /// A connected client for `rank` (-1: a reader that is not a trainer)
  /// whose links use `transport` ("grpc", "ucx", "auto").
  absl::StatusOr<std::unique_ptr<ShardClient>> Connect(int rank, WireEncodings encodings,
                                                       const std::string& transport = "grpc",
                                                       bool error_feedback = true) const;
  /// Every unit's fp32 master weights, unpadded, read through the protocol;
  /// with `version`, once every unit is published at it (a trainer's last
  /// step returns before the servers have applied it).
  absl::StatusOr<std::vector<std::vector<float>>> ReadMasterWeights(
      std::optional<int64_t> version = std::nullopt) const;

 private:
  std::vector<std::unique_ptr<ShardServer>> servers_;
  std::array<SecurityOptions, kNumRoles> client_security_;
};

}  // namespace pshard::testing

#endif  // PSHARD_TESTS_TESTUTIL_LOCAL_CLUSTER_H_
