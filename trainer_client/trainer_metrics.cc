#include "trainer_client/trainer_metrics.h"

#include "common/json.h"

#include "absl/strings/str_cat.h"
#include "pshard/config.h"

namespace pshard {
namespace {

using metrics::Histogram;
using metrics::Labels;

Labels Rank(int rank) { return {{"rank", absl::StrCat(rank)}}; }

Labels With(Labels labels, const std::string& key, const std::string& value) {
  labels[key] = value;
  return labels;
}

// Step times from 1 ms to ~65 s; transfers from 100 us to ~52 s.
std::vector<double> StepBounds() { return Histogram::ExponentialBounds(0.001, 2.0, 17); }
std::vector<double> TransferBounds() { return Histogram::ExponentialBounds(0.0001, 2.0, 20); }

metrics::Counter& Phase(metrics::Registry& r, int rank, const char* phase) {
  return r.AddCounter("pshard_trainer_phase_seconds_total",
                      "Step wall time by disjoint phase (compute, comm_exposed, data, other); the phases sum "
                      "to pshard_trainer_step_seconds_sum.")
      .Add(With(Rank(rank), "phase", phase));
}

metrics::Counter& PayloadCounter(metrics::Registry& r, int rank, const char* direction) {
  return r.AddCounter("pshard_trainer_payload_bytes_total",
                      "Encoded elements and block scales moved by direction, without framing.")
      .Add(With(Rank(rank), "direction", direction));
}

metrics::Counter& FabricCounter(metrics::Registry& r, int rank, const char* collective) {
  return r.AddCounter("pshard_trainer_fabric_bytes_total",
                      "Bytes received from the fabric group's other members, by collective.")
      .Add(With(Rank(rank), "collective", collective));
}

metrics::Gauge& HostMemoryGauge(metrics::Registry& r, int rank, const char* kind) {
  return r.AddGauge("pshard_trainer_host_memory_bytes",
                    "Host memory the slow-link levers hold, by kind: the fp32 weights of the units held at once "
                    "at the peak of a pass (prefetch depth + 1 units, or every unit when kept from forward to "
                    "backward or at stage 2), the secondary shard's parts kept from forward, and the "
                    "error-feedback residuals of quantized gradients.")
      .Add(With(Rank(rank), "kind", kind));
}

metrics::Gauge& ModelMemoryGauge(metrics::Registry& r, int rank, const char* kind) {
  return r.AddGauge("pshard_trainer_model_memory_bytes",
                    "Memory the model holds, by kind: activations (with gradient scratch), device buffers for "
                    "units' weights (prefetch depth + 1) and gradients (2), and everything on its device (0 on "
                    "the CPU).")
      .Add(With(Rank(rank), "kind", kind));
}

}  // namespace

TrainerMetrics::TrainerMetrics(metrics::Registry& r, int rank, const std::string& transport,
                               const std::string& device, double peak_flops)
    : phase_compute_(Phase(r, rank, "compute")),
      phase_comm_exposed_(Phase(r, rank, "comm_exposed")),
      phase_data_(Phase(r, rank, "data")),
      phase_other_(Phase(r, rank, "other")),
      comm_busy_(r.AddCounter("pshard_trainer_comm_busy_seconds_total",
                              "Wall time during which any fetch or push was in flight; minus comm_exposed it "
                              "is the communication hidden behind compute.")
                     .Add(Rank(rank))),
      tokens_(r.AddCounter("pshard_trainer_tokens_total", "Tokens trained on.").Add(Rank(rank))),
      flops_(r.AddCounter("pshard_trainer_model_flops_total", "Model FLOPs of forward and backward passes.")
                 .Add(Rank(rank))),
      fetch_bytes_(r.AddCounter("pshard_trainer_transfer_bytes_total", "Bytes moved on the wire by direction.")
                       .Add(With(With(Rank(rank), "direction", "fetch"), "transport", transport))),
      push_bytes_(r.AddCounter("pshard_trainer_transfer_bytes_total", "Bytes moved on the wire by direction.")
                      .Add(With(With(Rank(rank), "direction", "push"), "transport", transport))),
      fetch_payload_(PayloadCounter(r, rank, "fetch")),
      push_payload_(PayloadCounter(r, rank, "push")),
      fabric_gathered_(FabricCounter(r, rank, "all_gather")),
      fabric_reduced_(FabricCounter(r, rank, "reduce_scatter")),
      step_seconds_(r.AddHistogram("pshard_trainer_step_seconds",
                                   "Wall time of training steps (its _sum is the total the phases add up to, its "
                                   "_count the steps completed).",
                                   StepBounds())
                        .Add(Rank(rank))),
      fetch_seconds_(r.AddHistogram("pshard_trainer_fetch_seconds",
                                    "Latency of fetching one unit from all shards.", TransferBounds())
                         .Add(With(Rank(rank), "transport", transport))),
      push_seconds_(r.AddHistogram("pshard_trainer_push_seconds",
                                   "Latency of pushing one unit's gradient to all shards.", TransferBounds())
                        .Add(With(Rank(rank), "transport", transport))),
      loss_(r.AddGauge("pshard_trainer_loss", "Cross-entropy of the last step (mean over its micro-batches), in nats.").Add(Rank(rank))),
      grad_norm_(r.AddGauge("pshard_trainer_grad_norm",
                            "L2 norm of this rank's gradient in the last step (RMS over its micro-batches).")
                     .Add(Rank(rank))),
      step_(r.AddGauge("pshard_trainer_step", "The step this trainer completed last, plus one.").Add(Rank(rank))),
      activation_bytes_(ModelMemoryGauge(r, rank, "activations")),
      weight_buffer_bytes_(ModelMemoryGauge(r, rank, "weights")),
      host_weight_bytes_(HostMemoryGauge(r, rank, "weights_held")),
      secondary_shard_bytes_(HostMemoryGauge(r, rank, "secondary_shard")),
      residual_bytes_(HostMemoryGauge(r, rank, "residuals")),
      gradient_buffer_bytes_(ModelMemoryGauge(r, rank, "gradients")),
      device_bytes_(ModelMemoryGauge(r, rank, "device")),
      registry_(r),
      rank_(rank),
      peak_flops_(peak_flops) {
  r.AddGauge("pshard_build_info", "Build and role of this process (value 1).")
      .Add({{"version", PSHARD_VERSION}, {"role", "trainer"}, {"transport", transport}, {"device", device}})
      .Set(1);
  if (peak_flops > 0) {
    r.AddGauge("pshard_trainer_peak_flops", "FLOP rate that MFU is measured against.").Add(Rank(rank)).Set(peak_flops);
    mfu_ = &r.AddGauge("pshard_trainer_mfu", "Model FLOPs utilisation of the last step (0..1).").Add(Rank(rank));
  }
}

void TrainerMetrics::RecordEval(const EvalReport& report) {
  if (val_loss_ == nullptr) {
    val_loss_ = &registry_.AddGauge("pshard_trainer_val_loss",
                                    "Cross-entropy on the held-out data (--val_data) at the last evaluation, in nats.")
                     .Add(Rank(rank_));
    val_version_ = &registry_.AddGauge("pshard_trainer_val_step",
                                       "The weights' version (steps applied) the last evaluation measured.")
                        .Add(Rank(rank_));
    eval_seconds_ = &registry_.AddCounter("pshard_trainer_eval_seconds_total",
                                          "Wall time spent evaluating on held-out data, outside every step.")
                         .Add(Rank(rank_));
  }
  val_loss_->Set(report.loss);
  val_version_->Set(static_cast<double>(report.version));
  eval_seconds_->Increment(absl::ToDoubleSeconds(report.wall));
  fetch_bytes_.Increment(static_cast<double>(report.bytes_fetched));
}

void TrainerMetrics::RecordStep(const StepReport& report) {
  const double wall = absl::ToDoubleSeconds(report.times.wall);
  phase_compute_.Increment(absl::ToDoubleSeconds(report.times.compute));
  phase_comm_exposed_.Increment(absl::ToDoubleSeconds(report.times.comm_exposed));
  phase_data_.Increment(absl::ToDoubleSeconds(report.times.data));
  phase_other_.Increment(absl::ToDoubleSeconds(report.times.other));
  comm_busy_.Increment(absl::ToDoubleSeconds(report.times.comm_busy));
  tokens_.Increment(static_cast<double>(report.tokens));
  flops_.Increment(report.flops);
  fetch_bytes_.Increment(static_cast<double>(report.bytes_fetched));
  push_bytes_.Increment(static_cast<double>(report.bytes_pushed));
  fetch_payload_.Increment(static_cast<double>(report.payload_fetched));
  push_payload_.Increment(static_cast<double>(report.payload_pushed));
  fabric_gathered_.Increment(static_cast<double>(report.fabric_gathered));
  fabric_reduced_.Increment(static_cast<double>(report.fabric_reduced));
  step_seconds_.Observe(wall);
  for (absl::Duration d : report.fetch_latencies) fetch_seconds_.Observe(absl::ToDoubleSeconds(d));
  for (absl::Duration d : report.push_latencies) push_seconds_.Observe(absl::ToDoubleSeconds(d));
  loss_.Set(report.loss);
  grad_norm_.Set(report.grad_norm);
  step_.Set(static_cast<double>(report.step + 1));
  if (mfu_ != nullptr && wall > 0) mfu_->Set(report.flops / wall / peak_flops_);
}

void TrainerMetrics::SetModelMemory(const ModelMemory& memory) {
  activation_bytes_.Set(static_cast<double>(memory.activations));
  weight_buffer_bytes_.Set(static_cast<double>(memory.weights));
  gradient_buffer_bytes_.Set(static_cast<double>(memory.gradients));
  device_bytes_.Set(static_cast<double>(memory.device));
}

void TrainerMetrics::SetHostMemory(const HostMemory& memory) {
  host_weight_bytes_.Set(static_cast<double>(memory.weights_held));
  secondary_shard_bytes_.Set(static_cast<double>(memory.secondary_shard));
  residual_bytes_.Set(static_cast<double>(memory.residuals));
}

HostMemory HostMemoryOf(const TrainerOptions& options, std::span<const UnitPartition> units, bool residuals) {
  HostMemory m;
  int64_t all = 0, largest = 0;
  for (const UnitPartition& p : units) {
    all += 4 * p.padded_numel();
    largest = std::max<int64_t>(largest, 4 * p.padded_numel());
  }
  const int64_t window = static_cast<int64_t>(options.prefetch_depth + 1) * largest;
  m.weights_held = options.reshard_after_forward && options.stage == 3 ? std::min(all, window) : all;
  // The secondary shard keeps this member's 1/G of every unit besides.
  if (options.reshard_after_forward && options.stage == 3 && options.secondary_shard > 0) {
    m.secondary_shard = all / options.secondary_shard;
  }
  // Error feedback keeps an fp32 residual of every (padded) element it pushes.
  m.residuals = residuals ? all : 0;
  return m;
}

HostMemory HostMemoryOf(const TrainerOptions& options, const ShardClient& client) {
  return HostMemoryOf(options, client.layout().partitions,
                      client.options().error_feedback && client.options().encodings.grad_format().quantized());
}

std::string StepLogLine(int rank, const StepReport& r) {
  auto n = [](double v) { return JsonValue::Number(v); };
  auto s = [](absl::Duration d) { return JsonValue::Number(absl::ToDoubleSeconds(d)); };
  return FormatJson(JsonValue::MakeObject({{"rank", n(rank)},
                                           {"step", n(static_cast<double>(r.step))},
                                           {"loss", n(r.loss)},
                                           {"tokens", n(static_cast<double>(r.tokens))},
                                           {"wall_seconds", s(r.times.wall)},
                                           {"compute_seconds", s(r.times.compute)},
                                           {"comm_exposed_seconds", s(r.times.comm_exposed)},
                                           {"comm_busy_seconds", s(r.times.comm_busy)},
                                           {"data_seconds", s(r.times.data)},
                                           {"other_seconds", s(r.times.other)},
                                           {"bytes_fetched", n(static_cast<double>(r.bytes_fetched))},
                                           {"bytes_pushed", n(static_cast<double>(r.bytes_pushed))},
                                           {"payload_fetched", n(static_cast<double>(r.payload_fetched))},
                                           {"payload_pushed", n(static_cast<double>(r.payload_pushed))},
                                           {"fabric_gathered", n(static_cast<double>(r.fabric_gathered))},
                                           {"fabric_reduced", n(static_cast<double>(r.fabric_reduced))}}),
                    /*one_line=*/true);
}

TrainerSettings SettingsOf(const TrainerOptions& options, const ShardClient& client, const UnitModel& model) {
  TrainerSettings s;
  s.prefetch = options.prefetch_depth;
  s.encoding = client.options().encodings.ToString();
  s.device = model.DeviceName() == "cpu" ? "cpu" : "cuda";
  s.transport = client.transport_name(0);
  s.link = client.options().link.ToString();
  s.micro_batches = client.job().micro_batches;
  s.accumulation = options.fetch_once_per_step      ? "fetch_once_per_step"
                   : client.job().accumulate_on_trainer ? "on_trainer"
                                                        : "per_micro_batch";
  s.recompute = options.recompute_blocks;
  s.fabric_group_size = options.group != nullptr ? options.group->size() : 1;
  return s;
}

void TrainerMetrics::SetSettings(const TrainerSettings& s) {
  Labels labels = Rank(rank_);
  labels["prefetch"] = absl::StrCat(s.prefetch);
  labels["encoding"] = s.encoding;
  labels["device"] = s.device;
  labels["transport"] = s.transport;
  labels["link"] = s.link;
  labels["micro_batches"] = absl::StrCat(s.micro_batches);
  labels["accumulation"] = s.accumulation;
  labels["recompute"] = s.recompute ? "true" : "false";
  labels["fabric_group_size"] = absl::StrCat(s.fabric_group_size);
  registry_
      .AddGauge("pshard_trainer_config_info",
                "Run settings of this trainer as labels (value 1): prefetch, encoding, device, transport, link, "
                "micro_batches, accumulation, recompute, fabric_group_size.")
      .Add(labels)
      .Set(1);
}

}  // namespace pshard
