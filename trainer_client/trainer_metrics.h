// The trainer's metrics, declared once and fed from each step's report.
#ifndef PSHARD_TRAINER_CLIENT_TRAINER_METRICS_H_
#define PSHARD_TRAINER_CLIENT_TRAINER_METRICS_H_

#include <string>
#include <span>

#include "common/metrics/metrics.h"
#include "common/partition.h"
#include "trainer_client/shard_client.h"
#include "trainer_client/trainer.h"

namespace pshard {

/// How a trainer runs, exported as the labels of
/// pshard_trainer_config_info (one series per trainer) so that runs can be
/// told apart on a dashboard.
struct TrainerSettings {
  int prefetch = 1;
  std::string encoding;      ///< wire encodings: "bf16", or "weights bf16, gradients fp32"
  std::string device;        ///< cpu, cuda
  std::string transport;     ///< grpc, ucx (shard 0's link)
  std::string link;          ///< emulated link, e.g. "100 Mbit/s 2ms" or "none"
  int micro_batches = 1;
  std::string accumulation;  ///< per_micro_batch, on_trainer, fetch_once_per_step
  bool recompute = false;
  int fabric_group_size = 1;
};

/// Host memory the levers hold (pshard_trainer_host_memory_bytes).
struct HostMemory {
  int64_t weights_held = 0;     ///< fp32 unit weights held at once at the peak of a pass
  int64_t secondary_shard = 0;  ///< this member's 1/G of every unit, kept from forward to backward
  int64_t residuals = 0;        ///< error-feedback residuals (fp32, one per padded parameter)
};
/// What a trainer with `options` holds for units partitioned as `units`;
/// `residuals`: it keeps error-feedback residuals (quantized gradients).
HostMemory HostMemoryOf(const TrainerOptions& options, std::span<const UnitPartition> units, bool residuals);
HostMemory HostMemoryOf(const TrainerOptions& options, const ShardClient& client);

/// One step's report as a JSON Lines record (`--step_log`): the step, its
/// loss and tokens, times in seconds (wall, compute, comm_exposed,
/// comm_busy, data, other) and bytes (wire and payload, fetched and pushed;
/// fabric gathered and reduced). Ends with a line break.
std::string StepLogLine(int rank, const StepReport& report);

/// The settings of a trainer that runs `model` with `options` over `client`.
TrainerSettings SettingsOf(const TrainerOptions& options, const ShardClient& client, const UnitModel& model);

/// Every metric a trainer exports, bound to its rank. Names follow
/// Prometheus conventions (pshard_ prefix, base units, _total counters);
/// docs/metrics.md describes each. Thread-safe (the metrics are).
class TrainerMetrics {
 public:
  /// `peak_flops` is the FLOP rate MFU is measured against (0: unknown,
  /// no MFU). `transport` and `device` label the bytes and build info.
  TrainerMetrics(metrics::Registry& registry, int rank, const std::string& transport, const std::string& device,
                 double peak_flops);

  void RecordStep(const StepReport& report);
  /// An evaluation on held-out data: its loss, the weights' version and its
  /// time (the series appear with the first evaluation). Its fetches count
  /// in the transfer bytes.
  void RecordEval(const EvalReport& report);
  /// The model's memory by kind (see ModelMemory).
  void SetModelMemory(const ModelMemory& memory);
  /// The levers' host memory by kind (see HostMemory).
  void SetHostMemory(const HostMemory& memory);
  /// Publishes pshard_trainer_config_info for these settings (once).
  void SetSettings(const TrainerSettings& settings);

 private:
  metrics::Counter& phase_compute_;
  metrics::Counter& phase_comm_exposed_;
  metrics::Counter& phase_data_;
  metrics::Counter& phase_other_;
  metrics::Counter& comm_busy_;
  metrics::Counter& tokens_;
  metrics::Counter& flops_;
  metrics::Counter& fetch_bytes_;
  metrics::Counter& push_bytes_;
  metrics::Counter& fetch_payload_;
  metrics::Counter& push_payload_;
  metrics::Counter& fabric_gathered_;
  metrics::Counter& fabric_reduced_;
  metrics::Histogram& step_seconds_;
  metrics::Histogram& fetch_seconds_;
  metrics::Histogram& push_seconds_;
  metrics::Gauge& loss_;
  metrics::Gauge& grad_norm_;
  metrics::Gauge& step_;
  metrics::Gauge* mfu_ = nullptr;  // only when the peak rate is known
  metrics::Gauge* val_loss_ = nullptr;  // from the first evaluation on
  metrics::Gauge* val_version_ = nullptr;
  metrics::Counter* eval_seconds_ = nullptr;
  metrics::Gauge& activation_bytes_;
  metrics::Gauge& weight_buffer_bytes_;
  metrics::Gauge& host_weight_bytes_;
  metrics::Gauge& secondary_shard_bytes_;
  metrics::Gauge& residual_bytes_;
  metrics::Gauge& gradient_buffer_bytes_;
  metrics::Gauge& device_bytes_;
  metrics::Registry& registry_;
  const int rank_;
  const double peak_flops_;
};

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_TRAINER_METRICS_H_
