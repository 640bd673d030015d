// The container entrypoint's decisions, as a pure function of the arguments,
// the environment and the hostname: which program to start with which flags,
// whether to shape the link with tbf first, and which user to run as. The
// same image runs under docker-compose, Kubernetes and by hand because the
// usual variables are all understood:
//   role       first argument `server` | `trainer`, or PSHARD_ROLE
//   servers    PSHARD_SERVERS=host:port,...  or  PSHARD_SERVER_TEMPLATE with
//              `{i}` and PSHARD_NUM_SERVERS (1 to 4096; checked against
//              each other)
//   trainers   PSHARD_NUM_TRAINERS or WORLD_SIZE (must agree if both)
//   shard      PSHARD_SHARD_INDEX, else a StatefulSet ordinal (`name-3`)
//   rank       PSHARD_RANK, RANK, JOB_COMPLETION_INDEX (all that are set
//              must agree), else the hostname's ordinal
//   ports      PSHARD_PORT (7070), PSHARD_METRICS_PORT (9400)
//   config     <PSHARD_CONFIG_DIR, /etc/pshard>/<role>.flags as --flagfile
//   state      PSHARD_CHECKPOINT_DIR (/var/lib/pshard/checkpoints; empty:
//              none), PSHARD_CHECKPOINT_EVERY, PSHARD_RESUME_STEP
//   link       PSHARD_LINK_RATE shaped by tbf when the entrypoint can
//              (root with NET_ADMIN; PSHARD_LINK_SHAPER=auto|tc|process),
//              PSHARD_LINK_DELAY / _JITTER emulated in the trainer
//   trainer    PSHARD_JOIN_TIMEOUT (how long to wait for the servers)
//   security   PSHARD_TLS_DIR: a folder holding tls.crt, tls.key and ca.crt
//              (a Kubernetes TLS secret or cert-manager Certificate mounted
//              whole, so that rotated files are seen); PSHARD_TLS_SERVER_NAME
//              (the name in the servers' certificates, when it is not the
//              host dialled); PSHARD_AUTH_TOKEN_FILE (a token file)
// Arguments after the role are passed on last, so they override.
#ifndef PSHARD_TOOLS_ENTRYPOINT_H_
#define PSHARD_TOOLS_ENTRYPOINT_H_

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pshard::entrypoint {

using Environment = std::map<std::string, std::string>;

struct Facts {
  Environment env;
  std::string hostname;
  bool is_root = false;
  /// Whether a file exists (the flag files); injectable for tests.
  std::function<bool(const std::string&)> file_exists;
};

struct TrafficShaping {
  std::string device = "eth0";
  int64_t rate_bits_per_second = 0;
  int64_t burst_bytes = 0;
  /// The tc command line that applies it.
  std::vector<std::string> TcCommand() const;
};

struct LaunchPlan {
  std::string role;     ///< "server", "trainer" or "health"
  std::string program;  ///< pshard-server or pshard-trainer ("" for health)
  std::vector<std::string> args;
  /// Where the rank or shard index came from, for the start line.
  std::string index_source;
  /// Shape egress with tbf before starting (the entrypoint runs tc).
  std::optional<TrafficShaping> shaping;
  /// With `shaping`: when tc fails, go on with in-process rate emulation
  /// (auto) instead of stopping (tc).
  bool shaping_may_fall_back = false;
  /// Variables removed from the program's environment (the rate, once the
  /// kernel shapes it, so that it is not applied twice).
  std::vector<std::string> unset_env;
  /// Switch to this user and group before exec (-1: stay).
  int uid = -1;
  int gid = -1;
  /// For `health`: the address to check, and (PSHARD_TLS_DIR) the CA and
  /// the name to check the server's certificate against; the health
  /// service needs no client certificate or token.
  std::string health_address;
  std::string health_tls_ca;
  std::string health_tls_server_name;
  /// One line saying what was decided.
  std::string Summary() const;
};

/// Decides the launch from `args` (the entrypoint's arguments, without the
/// program name). Any bad, missing or contradictory value is an error that
/// names the variables involved.
absl::StatusOr<LaunchPlan> Plan(const std::vector<std::string>& args, const Facts& facts);

/// Parses a tc-style rate ("100mbit", "1gbit", "800kbit", "5000000bit",
/// "10mbps" for bytes) into bits per second; a limit is required (> 0).
absl::StatusOr<int64_t> ParseRate(const std::string& rate);

}  // namespace pshard::entrypoint

#endif  // PSHARD_TOOLS_ENTRYPOINT_H_
