// The shard server's metrics, declared once and injected into the service
// and the step driver.
#ifndef PSHARD_SHARD_SERVER_SERVER_METRICS_H_
#define PSHARD_SHARD_SERVER_SERVER_METRICS_H_

#include <array>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "common/metrics/metrics.h"
#include "common/security/caller_authenticator.h"

namespace pshard {

/// Why a request was refused (a bounded label).
enum class RejectReason { kUnknownUnit, kStale, kFutureStep, kBadRequest, kWaitTimeout, kCancelled, kLimit, kOther };
inline constexpr int kNumRejectReasons = 8;

/// RPC methods (a bounded label).
enum class RpcMethod {
  kJoin,
  kFetch,
  kPush,
  kAgreeNorm,
  kGetStatus,
  kReadMaster,
  kRendezvous,
  kAnnounce,
  kRollBack
};
inline constexpr int kNumRpcMethods = 9;
/// The method's name as the protocol spells it ("Join", "Push").
const char* RpcMethodName(RpcMethod method);

/// Every metric a shard server exports, bound to its shard. Thread-safe.
class ServerMetrics {
 public:
  /// `transports`: the data paths this server serves ("grpc" first, then
  /// e.g. "ucx"); each gets its own byte counters.
  ServerMetrics(metrics::Registry& registry, int shard, int num_trainers, int num_units,
                const std::vector<std::string>& transports);

  /// Bytes a trainer fetched from / pushed to this shard (rank -1: tools)
  /// over `transport` (one of those given at construction).
  metrics::Counter& bytes_out(int trainer, std::string_view transport = "grpc");
  metrics::Counter& bytes_in(int trainer, std::string_view transport = "grpc");
  metrics::Histogram& rpc_seconds(RpcMethod method) { return *rpc_seconds_[static_cast<int>(method)]; }
  /// Counts a refused request by the reason its status implies.
  void Reject(const absl::Status& status);
  /// Counts a call refused for its caller (credentials or role); UCX
  /// messages count as the RPC they stand for (Fetch, Push).
  /// Time steps waited while `trainer` had not pushed (steps slower than 1 s).
  metrics::Counter& missing_trainer_seconds(int trainer) {
    return *missing_trainer_seconds_[static_cast<size_t>(trainer) < missing_trainer_seconds_.size() ? trainer : 0];
  }
  metrics::Counter& refused_calls(RpcMethod method, AuthFailure failure) {
    return *refused_calls_[static_cast<int>(method)][static_cast<int>(failure)];
  }

  metrics::Counter& duplicate_pushes;
  metrics::Counter& non_finite_pushes;
  metrics::Histogram& optimizer_step_seconds;
  metrics::Counter& wait_contributions_seconds;
  metrics::Counter& wait_norm_seconds;
  metrics::Counter& applied_updates;
  metrics::Counter& skipped_steps;
  metrics::Gauge& step;
  metrics::Gauge& grad_norm;
  metrics::Gauge& update_weight_ratio;
  metrics::Gauge& learning_rate;
  metrics::Gauge& state_master_bytes;
  metrics::Gauge& state_m_bytes;
  metrics::Gauge& state_v_bytes;
  metrics::Gauge& state_grad_bytes;
  metrics::Gauge& state_published_bytes;  ///< encoded views of the published version (set each step)
  metrics::Gauge& expected_state_bytes;
  metrics::Gauge& checkpoint_step;
  metrics::Counter& checkpoint_write_seconds;
  metrics::Counter& checkpoint_failures;  ///< checkpoints asked for and not written
  metrics::Counter& rollbacks;          ///< times this shard went back to a checkpointed step
  metrics::Counter& rolled_back_steps;  ///< steps undone by them (redone by the trainers)
  metrics::Counter& refused_rollbacks;  ///< RollBacks refused: no shard restarted at their step
  metrics::Gauge& waiting_fetches;      ///< fetches not yet answered (ConnectionCaps)
  metrics::Gauge& unfinished_push_bytes;  ///< bytes held by pushes not yet complete
  metrics::Gauge& open_connections;       ///< connections open now (ConnectionGate)
  metrics::Counter& refused_connections;  ///< connections closed unanswered for a cap
  std::vector<metrics::Gauge*> unit_version;

 private:
  struct TransportBytes {
    std::string transport;
    std::vector<metrics::Counter*> out;  // index trainer + 1
    std::vector<metrics::Counter*> in;
  };
  const TransportBytes& Bytes(std::string_view transport) const;
  std::vector<TransportBytes> bytes_;  // in the order given; the first is the default
  std::array<metrics::Histogram*, kNumRpcMethods> rpc_seconds_{};
  std::array<metrics::Counter*, kNumRejectReasons> rejected_{};
  std::array<std::array<metrics::Counter*, kNumAuthFailures>, kNumRpcMethods> refused_calls_{};
  std::vector<metrics::Counter*> missing_trainer_seconds_;  // by rank
};

}  // namespace pshard

#endif  // PSHARD_SHARD_SERVER_SERVER_METRICS_H_
