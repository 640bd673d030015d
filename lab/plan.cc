#include "lab/plan.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/link_rate.h"
#include "common/status_macros.h"
#include "lab/step_model.h"
#include "trainer_client/model/gpt_layout.h"
#include "trainer_client/group/group_collective.h"
#include "trainer_client/prefetcher.h"
#include "trainer_client/trainer.h"
#include "trainer_client/trainer_metrics.h"

namespace pshard {
namespace {

absl::StatusOr<std::vector<UnitPartition>> PartitionOf(const PlanInput& input) {
  return PartitionUnits(input.spec.UnitNumels(), input.servers, input.slice_alignment);
}

int64_t EncodedBytes(const WireFormat& format, int64_t elements) {
  return static_cast<int64_t>(format.EncodedBytes(static_cast<size_t>(elements)));
}

TrainerOptions TrainerOptionsOf(const PlanInput& input) {
  TrainerOptions options;
  options.batch = input.batch;
  options.seq_len = input.seq_len;
  options.prefetch_depth = input.prefetch;
  options.recompute_blocks = input.recompute;
  options.fetch_once_per_step = input.fetch_once_per_step;
  options.reshard_after_forward = input.reshard.reshard;
  options.secondary_shard = input.reshard.group;
  options.stage = input.stage;
  return options;
}

bool Residuals(const PlanInput& input) {
  return input.error_feedback && input.encodings.grad_format().quantized();
}

TrainerMemory TrainerMemoryOf(const PlanInput& input, std::span<const UnitPartition> units) {
  const HostMemory host = HostMemoryOf(TrainerOptionsOf(input), units, Residuals(input));
  TrainerMemory m;
  m.weights_held = host.weights_held;
  m.secondary_shard = host.secondary_shard;
  m.residuals = host.residuals;
  const int lanes = input.fetch_once_per_step ? input.micro_batches : 1;
  GptConfig shape = input.shape;
  shape.context = std::max(shape.context, input.seq_len);
  if (input.cuda) {
    // Lanes keep their own activations and share one workspace.
    const bool fused = GptGpuFusesAttention(shape);
    const GpuActivationBytes kept = GptGpuActivationBytes(shape, input.batch, input.seq_len, false, fused);
    const GpuActivationBytes recomputed = GptGpuActivationBytes(shape, input.batch, input.seq_len, true, fused);
    m.activations_kept = lanes * kept.lane + kept.workspace;
    m.activations_recomputed = lanes * recomputed.lane + recomputed.workspace;
  } else {
    m.activations_kept = lanes * GptActivationBytes(shape, input.batch, input.seq_len, false);
    m.activations_recomputed = lanes * GptActivationBytes(shape, input.batch, input.seq_len, true);
  }
  m.activations = input.recompute ? m.activations_recomputed : m.activations_kept;
  return m;
}

ServerMemory ServerMemoryOf(const PlanInput& input, std::span<const UnitPartition> units) {
  ServerMemory m;
  const WireFormat weights = input.encodings.weight_format();
  for (const UnitPartition& p : units) {
    const int64_t slice = p.slice_length;  // every shard's slice is as long
    m.master += 4 * slice;
    m.optimizer += 8 * slice;
    if (weights.encoding() != WireEncoding::kFp32) m.weight_views += EncodedBytes(weights, slice);
    m.reduction += 4 * slice;
  }
  return m;
}

// The x in [lo, hi] (log scale) where `bound(x)` turns from true to false,
// `bound` being true at lo and false at hi.
double Crossing(double lo, double hi, const std::function<bool(double)>& bound) {
  for (int i = 0; i < 60 && hi / lo > 1.0005; ++i) {
    const double mid = std::sqrt(lo * hi);
    (bound(mid) ? lo : hi) = mid;
  }
  return std::sqrt(lo * hi);
}

Knee KneeOf(const PlanInput& input, std::span<const UnitPartition> units, const StepBytes& bytes,
            int64_t padded_parameters) {
  Knee knee;
  knee.bytes_per_parameter =
      static_cast<double>(std::max(bytes.fetched, bytes.pushed)) / static_cast<double>(padded_parameters);
  const double flops = input.device_flops * input.mfu;
  if (input.slow.bytes_per_second > 0) {
    knee.bandwidth_tokens_per_step = flops / input.slow.bytes_per_second * knee.bytes_per_parameter / 6.0;
  }
  const bool limited = input.slow.bytes_per_second > 0 || input.slow.latency > absl::ZeroDuration();
  if (!limited) return knee;
  // More tokens per step at the same bytes is more compute per step: the
  // same as a device slower by that factor.
  auto bound_with_compute_times = [&](double factor) {
    PlanInput v = input;
    v.device_flops = input.device_flops / factor;
    return PredictStepTime(v, units).comm_bound();
  };
  constexpr double kFar = 1e9;
  const double tokens = static_cast<double>(input.tokens_per_step());
  if (bound_with_compute_times(1.0)) {
    knee.tokens_per_step = tokens * Crossing(1.0, kFar, bound_with_compute_times);
  } else {
    knee.tokens_per_step = tokens * (bound_with_compute_times(1.0 / kFar)
                                         ? Crossing(1.0 / kFar, 1.0, bound_with_compute_times)
                                         : 1.0 / kFar);
  }
  auto bound_at_rate = [&](double bytes_per_second) {
    PlanInput v = input;
    v.slow.bytes_per_second = bytes_per_second;
    return PredictStepTime(v, units).comm_bound();
  };
  constexpr double kSlowest = 1e3, kFastest = 1e14;  // bytes/s: 8 kbit/s .. 800 Tbit/s
  if (bound_at_rate(kFastest)) {
    knee.rate_bytes_per_second = std::numeric_limits<double>::infinity();
  } else if (!bound_at_rate(kSlowest)) {
    knee.rate_bytes_per_second = 0;
  } else {
    knee.rate_bytes_per_second = Crossing(kSlowest, kFastest, bound_at_rate);
  }
  return knee;
}

// The levers that apply to `input` and are not on yet, one at a time, and
// the byte levers all together: deeper prefetch (more fetches in flight
// hide more latency), the encodings, keeping units from forward, fabric
// groups, and accumulation (more micro-batches per step, each unit fetched
// once and its gradient pushed once: more tokens per byte, a larger batch).
std::vector<std::pair<std::string, PlanInput>> LeverVariants(const PlanInput& input) {
  std::vector<std::pair<std::string, PlanInput>> variants;
  auto add = [&](std::string flags, auto change) {
    PlanInput v = input;
    change(v);
    if (v.Validate().ok()) variants.emplace_back(std::move(flags), std::move(v));
  };
  const int units = static_cast<int>(input.spec.units.size());
  std::set<int> depths = {input.prefetch + 1, 3, 5, 8, units};
  for (int depth : depths) {
    if (depth <= input.prefetch || depth > units) continue;
    add(absl::StrCat("--prefetch=", depth), [depth](PlanInput& v) { v.prefetch = depth; });
  }
  if (input.encodings.weights != WireEncoding::kInt8) {
    add("--weight_encoding=int8", [](PlanInput& v) { v.encodings.weights = WireEncoding::kInt8; });
  }
  for (WireEncoding g : {WireEncoding::kInt8, WireEncoding::kInt4}) {
    if (input.encodings.grads == g || (g == WireEncoding::kInt8 && input.encodings.grads == WireEncoding::kInt4)) {
      continue;
    }
    add(absl::StrCat("--grad_encoding=", std::string(WireEncodingName(g))), [g](PlanInput& v) {
      v.encodings.grads = g;
      v.error_feedback = true;
    });
  }
  if (input.stage == 3 && input.reshard.reshard && input.reshard.group == 0) {
    add("--reshard_after_forward=false", [](PlanInput& v) { v.reshard.reshard = false; });
    if (input.group > 1) {
      add(absl::StrCat("--reshard_after_forward=", input.group), [](PlanInput& v) { v.reshard.group = v.group; });
    }
  }
  if (input.stage == 3 && input.micro_batches > 1 && !input.fetch_once_per_step) {
    add("--stage=2", [](PlanInput& v) { v.stage = 2; });
    add("--accumulate_on_trainer --fetch_once_per_step", [](PlanInput& v) {
      v.accumulate_on_trainer = true;
      v.fetch_once_per_step = true;
    });
  }
  if (input.group == 1 && input.trainers % 2 == 0) {
    add("--fabric_group_size=2", [](PlanInput& v) { v.group = 2; });
  }
  for (int k : {4, 16}) {
    const int micro = input.micro_batches * k;
    auto accumulate = [micro](PlanInput& v) {
      v.micro_batches = micro;
      v.stage = 2;
      v.accumulate_on_trainer = true;
    };
    add(absl::StrCat("--micro_batches=", micro, " --stage=2 --accumulate_on_trainer"), accumulate);
    if (k == 16) {
      add(absl::StrCat("--micro_batches=", micro,
                       " --stage=2 --accumulate_on_trainer --weight_encoding=int8 --grad_encoding=int4"),
          [accumulate](PlanInput& v) {
            accumulate(v);
            v.encodings.weights = WireEncoding::kInt8;
            v.encodings.grads = WireEncoding::kInt4;
            v.error_feedback = true;
          });
    }
  }
  add("--weight_encoding=int8 --grad_encoding=int4 --reshard_after_forward=false", [](PlanInput& v) {
    v.encodings.weights = WireEncoding::kInt8;
    v.encodings.grads = WireEncoding::kInt4;
    v.error_feedback = true;
    v.reshard = ReshardAfterForward{false, 0};
  });
  return variants;
}

}  // namespace

double LinkModel::Seconds(double bytes) const {
  if (!(bytes_per_second > 0)) return 0.0;
  return static_cast<double>(EthernetBytes(static_cast<int64_t>(std::ceil(bytes)))) / bytes_per_second;
}

absl::Status PlanInput::Validate() const {
  RETURN_IF_ERROR(shape.Validate());
  if (spec.units.empty()) return absl::InvalidArgumentError("the model has no units");
  if (servers < 1) return absl::InvalidArgumentError(absl::StrCat("--servers=", servers, ": need at least 1"));
  if (trainers < 1) return absl::InvalidArgumentError(absl::StrCat("--trainers=", trainers, ": need at least 1"));
  if (group < 1 || trainers % group != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--fabric_group_size=", group, " does not divide the ", trainers, " trainers"));
  }
  if (micro_batches < 1 || batch < 1 || seq_len < 1) {
    return absl::InvalidArgumentError(absl::StrCat("micro-batches (", micro_batches, "), batch (", batch,
                                                   ") and sequence length (", seq_len, ") must be positive"));
  }
  if (prefetch < 0) return absl::InvalidArgumentError(absl::StrCat("--prefetch=", prefetch, " < 0"));
  RETURN_IF_ERROR(CheckStage(stage));
  if (reshard.group > 0 && reshard.group != group) {
    return absl::InvalidArgumentError(absl::StrCat("--reshard_after_forward=", reshard.group,
                                                   " keeps a secondary shard within a fabric group of that size: "
                                                   "give --fabric_group_size=", reshard.group));
  }
  if (nodes) {
    if (paired) return absl::InvalidArgumentError("--placement=paired and --topology both place the processes: give one");
    if (static_cast<int>(nodes->of_server.size()) != servers || static_cast<int>(nodes->of_trainer.size()) != trainers) {
      return absl::InvalidArgumentError(absl::StrCat("the topology places ", nodes->of_server.size(), " servers and ",
                                                     nodes->of_trainer.size(), " trainers; the job has ", servers,
                                                     " and ", trainers));
    }
    for (const auto& [pair, link] : nodes->links) {
      if (link.bytes_per_second < 0 || link.latency < absl::ZeroDuration()) {
        return absl::InvalidArgumentError("a topology link's rate and latency must be >= 0");
      }
    }
  }
  if (paired && group > 1) {
    return absl::InvalidArgumentError("--placement=paired takes no fabric groups (--fabric_group_size=1)");
  }
  if (fetch_once_per_step && micro_batches > 1 && !accumulate_on_trainer) {
    return absl::InvalidArgumentError("--fetch_once_per_step needs --accumulate_on_trainer");
  }
  if (error_feedback && !encodings.grad_format().quantized()) {
    return absl::InvalidArgumentError("error feedback needs int8 or int4 gradients");
  }
  if (!(device_flops > 0) || !std::isfinite(device_flops)) {
    return absl::InvalidArgumentError("--device_flops: give the trainers' peak FLOP/s (e.g. 1e12), or auto");
  }
  if (!(mfu > 0) || mfu > 1) {
    return absl::InvalidArgumentError(absl::StrCat("--mfu=", mfu, " is not in (0, 1]"));
  }
  if (!(step_overhead >= 0) || !std::isfinite(step_overhead)) {
    return absl::InvalidArgumentError("--step_overhead must be a duration >= 0");
  }
  if (!(optimizer_state_bytes >= 0)) {
    return absl::InvalidArgumentError("optimizer state bytes per parameter must be >= 0");
  }
  for (const LinkModel* link : {&slow, &fabric}) {
    if (link->bytes_per_second < 0 || link->latency < absl::ZeroDuration()) {
      return absl::InvalidArgumentError("a link's rate and latency must be >= 0");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelSpec> MakeUniformSpec(int64_t parameters, int layers) {
  if (parameters < layers || layers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("a model of ", parameters, " parameters cannot fill ", layers, " layers"));
  }
  ModelSpecBuilder spec(absl::StrCat("uniform parameters=", parameters, " layers=", layers));
  for (int l = 0; l < layers; ++l) {
    // The first parameters % layers layers take one more.
    const int64_t numel = parameters / layers + (l < parameters % layers ? 1 : 0);
    spec.AddUnit(absl::StrCat("layer", l));
    spec.AddTensor(absl::StrCat("layer", l, ".w"), {numel}, InitKind::kZeros, 0.0, /*weight_decay=*/true);
  }
  return std::move(spec).Build();
}

ZeroMemory ZeroMemoryOf(double parameters, int devices, double k) {
  ZeroMemory z;
  z.devices = devices;
  const double psi = parameters, d = devices;
  z.data_parallel = (2 + 2 + k) * psi;
  z.stage1 = 4 * psi + k * psi / d;
  z.stage2 = 2 * psi + (2 + k) * psi / d;
  z.stage3 = (4 + k) * psi / d;
  return z;
}

absl::StatusOr<StepBytes> StepBytesOf(const PlanInput& input, int rank) {
  ASSIGN_OR_RETURN(const std::vector<UnitPartition> units, PartitionOf(input));
  const int g = input.group;
  const std::vector<int> mine = MemberShards(input.servers, g, rank % g);
  const WireFormat weights = input.encodings.weight_format(), grads = input.encodings.grad_format();
  const bool keep = !input.reshard.reshard || input.stage < 3;
  const bool regather = !keep && input.reshard.group > 0;
  const int lanes = input.fetch_once_per_step ? input.micro_batches : 1;
  const int passes = input.micro_batches / lanes;
  const int fetching_passes = input.stage < 3 ? 1 : passes;
  const int pushes = input.accumulate_on_trainer ? 1 : passes;
  StepBytes bytes;
  for (size_t u = 0; u < units.size(); ++u) {
    const bool last = u + 1 == units.size();
    int64_t fetch = 0, push = 0, others = 0;
    for (int s = 0; s < units[u].num_shards; ++s) {
      const int64_t n = units[u].Slice(s).length;
      if (std::find(mine.begin(), mine.end(), s) == mine.end()) {
        others += EncodedBytes(weights, n);
        continue;
      }
      fetch += EncodedBytes(weights, n);
      push += EncodedBytes(grads, n);
    }
    // Fetched in forward, and again in backward unless kept or regathered.
    const int fetches = keep || regather || last ? 1 : 2;
    // Gathered on the fabric with every fetch, and for every regather.
    const int gathers = keep || last ? 1 : 2;
    bytes.fetched += fetching_passes * fetches * fetch;
    bytes.pushed += pushes * push;
    if (g > 1) {
      // The fabric carries the wire's encodings: the other members' slices
      // as they were fetched, and every other member's part of this
      // member's slices as they are pushed.
      bytes.gathered += fetching_passes * gathers * others;
      bytes.reduced += pushes * (g - 1) * push;
    }
  }
  return bytes;
}

absl::StatusOr<Plan> MakePlan(const PlanInput& input) {
  RETURN_IF_ERROR(input.Validate());
  ASSIGN_OR_RETURN(const std::vector<UnitPartition> units, PartitionOf(input));
  Plan plan;
  plan.input = input;
  plan.parameters = input.spec.TotalParameters();
  for (const UnitPartition& p : units) plan.padded_parameters += p.padded_numel();
  plan.server = ServerMemoryOf(input, units);
  plan.trainer = TrainerMemoryOf(input, units);
  plan.zero = ZeroMemoryOf(static_cast<double>(plan.parameters), input.servers, input.optimizer_state_bytes);
  for (int r = 0; r < input.trainers; ++r) {
    ASSIGN_OR_RETURN(StepBytes b, StepBytesOf(input, r));
    plan.bytes.fetched = std::max(plan.bytes.fetched, b.fetched);
    plan.bytes.pushed = std::max(plan.bytes.pushed, b.pushed);
    plan.bytes.gathered = std::max(plan.bytes.gathered, b.gathered);
    plan.bytes.reduced = std::max(plan.bytes.reduced, b.reduced);
    plan.bytes_by_trainer.push_back(b);
  }
  plan.time = PredictStepTime(input, units);
  plan.knee = KneeOf(input, units, plan.bytes, plan.padded_parameters);
  for (auto& [flags, variant] : LeverVariants(input)) {
    ASSIGN_OR_RETURN(const std::vector<UnitPartition> vunits, PartitionOf(variant));
    LeverOption option;
    option.flags = flags;
    ASSIGN_OR_RETURN(option.bytes, StepBytesOf(variant, 0));
    option.time = PredictStepTime(variant, vunits);
    option.trainer_memory = TrainerMemoryOf(variant, vunits).total();
    // Tokens per second, not the step: accumulation trains more tokens a step.
    option.speedup =
        plan.time.tokens_per_second > 0 ? option.time.tokens_per_second / plan.time.tokens_per_second : 1.0;
    option.batch_factor = static_cast<double>(variant.tokens_per_step()) / static_cast<double>(input.tokens_per_step());
    option.keeps_numbers = variant.encodings == input.encodings;
    plan.levers.push_back(std::move(option));
  }
  std::stable_sort(plan.levers.begin(), plan.levers.end(),
                   [](const LeverOption& a, const LeverOption& b) { return a.speedup > b.speedup; });
  // Where the model cannot tell two apart, a lever that keeps the job's
  // numbers goes before one that quantizes them: it moves up past each
  // quantized lever it trails by less than kIndistinctSpeedup.
  for (size_t i = 1; i < plan.levers.size(); ++i) {
    for (size_t j = i; j > 0; --j) {
      const LeverOption& ahead = plan.levers[j - 1];
      const LeverOption& exact = plan.levers[j];
      if (!exact.keeps_numbers || ahead.keeps_numbers ||
          exact.speedup < ahead.speedup * (1 - kIndistinctSpeedup)) {
        break;
      }
      std::swap(plan.levers[j - 1], plan.levers[j]);
    }
  }
  return plan;
}

}  // namespace pshard
