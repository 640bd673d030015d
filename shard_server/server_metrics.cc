#include "shard_server/server_metrics.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "pshard/config.h"

namespace pshard {
namespace {

using metrics::Labels;

Labels Shard(int shard) { return {{"shard", absl::StrCat(shard)}}; }

Labels With(Labels labels, const std::string& key, const std::string& value) {
  labels[key] = value;
  return labels;
}

metrics::Gauge& StateBytes(metrics::Registry& r, int shard, const char* kind) {
  return r.AddGauge("pshard_server_state_bytes", "Memory held for model state, by kind.")
      .Add(With(Shard(shard), "kind", kind));
}

constexpr const char* kReasonNames[kNumRejectReasons] = {"unknown_unit", "stale",  "future_step", "bad_request",
                                                         "wait_timeout", "cancelled",   "limit",       "other"};
constexpr const char* kMethodNames[kNumRpcMethods] = {"Join", "Fetch", "Push", "AgreeNorm", "GetStatus", "ReadMaster", "Rendezvous",
                                                       "Announce", "RollBack"};

}  // namespace

const char* RpcMethodName(RpcMethod method) { return kMethodNames[static_cast<int>(method)]; }

ServerMetrics::ServerMetrics(metrics::Registry& r, int shard, int num_trainers, int num_units,
                             const std::vector<std::string>& transports)
    : duplicate_pushes(r.AddCounter("pshard_server_duplicate_pushes_total",
                                    "Pushes acknowledged and ignored because the contribution was already in.")
                           .Add(Shard(shard))),
      non_finite_pushes(r.AddCounter("pshard_server_non_finite_pushes_total",
                                     "Pushes that carried NaN or Inf (their step is skipped on every shard).")
                            .Add(Shard(shard))),
      optimizer_step_seconds(r.AddHistogram("pshard_server_optimizer_step_seconds",
                                            "Time to apply (or skip) one step's update on this shard's slices; _sum is the optimizer time, _count the steps closed.",
                                            metrics::Histogram::ExponentialBounds(0.0001, 2.0, 18))
                                 .Add(Shard(shard))),
      wait_contributions_seconds(r.AddCounter("pshard_server_wait_seconds_total",
                                              "Time a step waited, by what it waited for.")
                                     .Add(With(Shard(shard), "for", "contributions"))),
      wait_norm_seconds(r.AddCounter("pshard_server_wait_seconds_total", "Time a step waited, by what it waited for.")
                            .Add(With(Shard(shard), "for", "norm_agreement"))),
      applied_updates(r.AddCounter("pshard_server_applied_updates_total", "Optimizer updates applied.")
                          .Add(Shard(shard))),
      skipped_steps(r.AddCounter("pshard_server_skipped_steps_total",
                                 "Steps skipped because a gradient was not finite.")
                        .Add(Shard(shard))),
      step(r.AddGauge("pshard_server_step", "The step this shard is collecting gradients for.").Add(Shard(shard))),
      grad_norm(r.AddGauge("pshard_server_grad_norm", "Global gradient norm agreed for the last step.")
                    .Add(Shard(shard))),
      update_weight_ratio(r.AddGauge("pshard_server_update_weight_ratio",
                                     "Norm of the last update over the norm of the weights, this shard's slices.")
                              .Add(Shard(shard))),
      learning_rate(r.AddGauge("pshard_server_learning_rate", "Learning rate of the last update.").Add(Shard(shard))),
      state_master_bytes(StateBytes(r, shard, "master")),
      state_m_bytes(StateBytes(r, shard, "adam_m")),
      state_v_bytes(StateBytes(r, shard, "adam_v")),
      state_grad_bytes(StateBytes(r, shard, "grad")),
      state_published_bytes(StateBytes(r, shard, "published")),
      expected_state_bytes(r.AddGauge("pshard_server_expected_state_bytes",
                                      "16 bytes per parameter over the number of shards: mixed-precision AdamW "
                                      "state as ZeRO counts it.")
                               .Add(Shard(shard))),
      checkpoint_step(r.AddGauge("pshard_server_checkpoint_step",
                                 "Step of the newest checkpoint this shard wrote (-1: none yet).")
                          .Add(Shard(shard))),
      checkpoint_write_seconds(r.AddCounter("pshard_server_checkpoint_write_seconds_total",
                                            "Time spent writing checkpoints.")
                                   .Add(Shard(shard))),
      checkpoint_failures(r.AddCounter("pshard_server_checkpoint_failures_total",
                                       "Checkpoints this shard was to write and could not (a full disk, a "
                                       "folder deleted while the job ran).")
                              .Add(Shard(shard))),
      rollbacks(r.AddCounter("pshard_server_rollbacks_total",
                             "Times this shard went back to one of its checkpoints so that every shard of the job "
                             "resumes at one step (after another shard restarted).")
                    .Add(Shard(shard))),
      rolled_back_steps(r.AddCounter("pshard_server_rolled_back_steps_total",
                                     "Steps those rollbacks undid; the trainers redo them.")
                            .Add(Shard(shard))),
      refused_rollbacks(r.AddCounter("pshard_server_refused_rollbacks_total",
                                     "RollBacks this shard refused because no shard of the job had restarted from "
                                     "a checkpoint of their step and was still there.")
                            .Add(Shard(shard))),
      waiting_fetches(r.AddGauge("pshard_server_waiting_fetches",
                                 "Fetches this shard holds, not yet answered (most wait for their version); "
                                 "capped per connection and in all, past which fetches are refused (reason limit).")
                          .Add(Shard(shard))),
      unfinished_push_bytes(r.AddGauge("pshard_server_unfinished_push_bytes",
                                       "Bytes held by gradient pushes whose last chunk has not arrived; capped per "
                                       "connection and in all, past which a push is refused (reason limit).")
                                .Add(Shard(shard))),
      open_connections(r.AddGauge("pshard_server_open_connections",
                                  "Connections to this shard's gRPC port open now, from the moment they are "
                                  "accepted (before their TLS handshake); capped per peer host and in all.")
                           .Add(Shard(shard))),
      refused_connections(r.AddCounter("pshard_server_refused_connections_total",
                                       "Connections this shard closed unanswered, as soon as they were accepted, "
                                       "because their host or the shard had as many open as its caps allow.")
                              .Add(Shard(shard))) {
  checkpoint_step.Set(-1);
  auto& out = r.AddCounter("pshard_server_transfer_bytes_total", "Bytes moved on the wire, by direction (fetch: to trainers, push: from them) and trainer rank.");
  for (const std::string& transport : transports) {
    TransportBytes& bytes = bytes_.emplace_back(TransportBytes{transport, {}, {}});
    for (int t = -1; t < num_trainers; ++t) {
      const std::string peer = t < 0 ? std::string("tool") : absl::StrCat(t);
      const Labels base = With(With(Shard(shard), "rank", peer), "transport", transport);
      bytes.out.push_back(&out.Add(With(base, "direction", "fetch")));
      bytes.in.push_back(&out.Add(With(base, "direction", "push")));
    }
  }
  auto& rpc = r.AddHistogram("pshard_server_rpc_seconds", "Duration of RPCs handled, by method.",
                             metrics::Histogram::ExponentialBounds(0.0001, 2.0, 20));
  for (int m = 0; m < kNumRpcMethods; ++m) rpc_seconds_[m] = &rpc.Add(With(Shard(shard), "method", kMethodNames[m]));
  auto& rejected = r.AddCounter("pshard_server_rejected_requests_total", "Requests refused, by reason.");
  for (int i = 0; i < kNumRejectReasons; ++i) rejected_[i] = &rejected.Add(With(Shard(shard), "reason", kReasonNames[i]));
  auto& missing = r.AddCounter("pshard_server_missing_trainer_seconds_total",
                               "Time steps waited for a trainer's gradients while it had not pushed them (counted "
                               "for steps that waited over 1 s), by trainer rank.");
  for (int t = 0; t < std::max(1, num_trainers); ++t) {
    missing_trainer_seconds_.push_back(&missing.Add(With(Shard(shard), "rank", absl::StrCat(t))));
  }
  auto& refused = r.AddCounter("pshard_server_refused_calls_total",
                               "Calls refused for their caller (missing or wrong credentials, or a role not allowed "
                               "the method), by method and reason.");
  for (int m = 0; m < kNumRpcMethods; ++m) {
    for (int f = 0; f < kNumAuthFailures; ++f) {
      refused_calls_[m][f] = &refused.Add(With(With(Shard(shard), "method", kMethodNames[m]), "reason",
                                               AuthFailureName(static_cast<AuthFailure>(f))));
    }
  }
  auto& version = r.AddGauge("pshard_server_unit_version", "Published version of each unit on this shard.");
  for (int u = 0; u < num_units; ++u) unit_version.push_back(&version.Add(With(Shard(shard), "unit", absl::StrCat(u))));
  r.AddGauge("pshard_build_info", "Build and role of this process (value 1).")
      .Add({{"version", PSHARD_VERSION}, {"role", "server"}, {"transport", absl::StrJoin(transports, ",")}, {"device", "cpu"}})
      .Set(1);
}

const ServerMetrics::TransportBytes& ServerMetrics::Bytes(std::string_view transport) const {
  for (const TransportBytes& b : bytes_) {
    if (b.transport == transport) return b;
  }
  return bytes_.front();
}

metrics::Counter& ServerMetrics::bytes_out(int trainer, std::string_view transport) {
  const std::vector<metrics::Counter*>& out = Bytes(transport).out;
  const size_t i = static_cast<size_t>(trainer + 1);
  return *out[i < out.size() ? i : 0];
}

metrics::Counter& ServerMetrics::bytes_in(int trainer, std::string_view transport) {
  const std::vector<metrics::Counter*>& in = Bytes(transport).in;
  const size_t i = static_cast<size_t>(trainer + 1);
  return *in[i < in.size() ? i : 0];
}

void ServerMetrics::Reject(const absl::Status& status) {
  RejectReason reason = RejectReason::kOther;
  switch (status.code()) {
    case absl::StatusCode::kNotFound: reason = RejectReason::kUnknownUnit; break;
    case absl::StatusCode::kFailedPrecondition: reason = RejectReason::kStale; break;
    case absl::StatusCode::kOutOfRange: reason = RejectReason::kFutureStep; break;
    case absl::StatusCode::kInvalidArgument: reason = RejectReason::kBadRequest; break;
    case absl::StatusCode::kDeadlineExceeded: reason = RejectReason::kWaitTimeout; break;
    case absl::StatusCode::kCancelled: reason = RejectReason::kCancelled; break;
    case absl::StatusCode::kResourceExhausted: reason = RejectReason::kLimit; break;
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kPermissionDenied:
      return;  // counted by refused_calls, with the method and the reason
    default: break;
  }
  rejected_[static_cast<int>(reason)]->Increment();
}

}  // namespace pshard
