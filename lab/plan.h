// The planner: what a pshard job holds and moves, and how long its steps
// take, from the job's shape and its links, without running it. Memory and
// bytes are exact (the formulas of docs/levers.md over the job's real
// partition); the step time comes from an event model of the trainer's
// schedule over token-bucket links (lab/step_model.h).
#ifndef PSHARD_LAB_PLAN_H_
#define PSHARD_LAB_PLAN_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/levers.h"
#include "common/model_spec.h"
#include "trainer_client/model/gpt_spec.h"
#include "common/partition.h"
#include "common/wire_encoding.h"

namespace pshard {

/// One direction of a link: a rate and a one-way latency.
struct LinkModel {
  double bytes_per_second = 0.0;  ///< 0: unlimited
  absl::Duration latency;
  /// Seconds that `bytes` of a TCP stream take to pass the link's rate, in
  /// Ethernet frames (EthernetBytes; 0 when unlimited).
  double Seconds(double bytes) const;
};

/// What is trained, and how.
struct PlanInput {
  /// The units fetched. A GPT's (MakeGptSpec), or `layers` equal units of
  /// a given parameter count (MakeUniformSpec).
  ModelSpec spec;
  /// The model's shape for FLOPs and activations. With a parameter count,
  /// its layers, width and heads; the FLOPs then count 6 per parameter and
  /// token plus attention.
  GptConfig shape;
  bool gpt = true;  ///< spec is the GPT of `shape` (false: a parameter count)

  int servers = 4;       ///< N
  int trainers = 2;      ///< M
  int group = 1;         ///< G: fabric group size (1: none)
  int micro_batches = 1; ///< K
  int batch = 8;         ///< sequences per micro-batch
  int seq_len = 64;      ///< tokens per sequence
  bool accumulate_on_trainer = false;
  bool fetch_once_per_step = false;
  bool recompute = false;
  int prefetch = 1;
  int stage = 3;
  ReshardAfterForward reshard;
  WireEncodings encodings{WireEncoding::kBf16};
  bool error_feedback = false;  ///< with quantized gradients
  int64_t slice_alignment = kSliceAlignment;
  /// Trainer R on one node with server R (`--placement=paired`): its own
  /// server's slice does not cross the network, and the node's interface
  /// carries both. Otherwise every server and trainer has its own node.
  bool paired = false;

  /// Where the processes run, from a topology file (servers named
  /// shard:K), in place of a node per process (or `paired`).
  struct Nodes {
    std::string file;                ///< the topology file
    std::vector<std::string> names;  ///< of each node
    std::vector<int> of_server;      ///< node of each shard
    std::vector<int> of_trainer;     ///< node of each trainer rank
    /// A node pair's own link (the topology's rate and delay, the same
    /// both ways), keyed (lower node, higher node): its transfers pass it
    /// instead of the two nodes' interfaces at `slow`.
    std::map<std::pair<int, int>, LinkModel> links;
  };
  std::optional<Nodes> nodes;

  LinkModel slow;    ///< each trainer's (and server's) network interface, per direction
  LinkModel fabric;  ///< between members of a fabric group
  /// Trainers run the CUDA model (--device=cuda): activations are its,
  /// on the device, bf16 (otherwise the CPU model's, fp32).
  bool cuda = false;
  double device_flops = 0.0;  ///< peak FLOP/s of a trainer's device
  double mfu = 0.0;           ///< model FLOPs utilisation achieved, (0, 1]
  /// Seconds of every step that the event model does not see (the servers'
  /// optimizer step and norm agreement, host work of the transfers), spent
  /// before the step's first fetch is served; a sweep measures it on an
  /// unshaped run.
  double step_overhead = 0.0;
  /// Optimizer state bytes per parameter, ZeRO's K (Adam with an fp32
  /// master copy: 12).
  double optimizer_state_bytes = 12.0;

  int64_t tokens_per_step() const { return int64_t{batch} * seq_len * micro_batches; }
  /// Checks counts, sizes and lever combinations the way the trainer and
  /// `pshard local` do; the message names the bad value.
  absl::Status Validate() const;
};

/// `layers` units of (nearly) equal size holding `parameters` parameters in
/// all; one tensor each, weight decay on.
absl::StatusOr<ModelSpec> MakeUniformSpec(int64_t parameters, int layers);

/// Model-state bytes per device under plain data parallelism and ZeRO's
/// stages on D devices, in mixed precision (2 bytes of weights and of
/// gradients per parameter, K of optimizer state), as ZeRO's paper counts
/// them for Ψ parameters.
struct ZeroMemory {
  int devices = 0;
  double data_parallel = 0;  ///< (2 + 2 + K) Ψ
  double stage1 = 0;         ///< P_os: 4Ψ + KΨ/D
  double stage2 = 0;         ///< P_os+g: 2Ψ + (2 + K)Ψ/D
  double stage3 = 0;         ///< P_os+g+p: (4 + K)Ψ/D
};
ZeroMemory ZeroMemoryOf(double parameters, int devices, double optimizer_state_bytes);

/// Bytes a server holds, at most (the largest shard).
struct ServerMemory {
  int64_t master = 0;           ///< fp32 master weights
  int64_t optimizer = 0;        ///< Adam's m and v
  int64_t weight_views = 0;     ///< the encoded view fetched, when not fp32
  int64_t reduction = 0;        ///< the step's fp32 gradient sums, at most
  int64_t total() const { return master + optimizer + weight_views + reduction; }
};

/// Bytes a trainer holds on the host (as its startup line and
/// pshard_trainer_host_memory_bytes give them) and for activations.
struct TrainerMemory {
  int64_t weights_held = 0;
  int64_t secondary_shard = 0;
  int64_t residuals = 0;
  int64_t activations = 0;             ///< with the input's recompute setting
  int64_t activations_kept = 0;        ///< without recomputation
  int64_t activations_recomputed = 0;  ///< with it
  int64_t total() const { return weights_held + secondary_shard + residuals + activations; }
};

/// Bytes per step of one trainer, by link and direction: what
/// StepReport's payload and fabric counts measure.
struct StepBytes {
  int64_t fetched = 0;   ///< slow link, server to trainer (encoded slices)
  int64_t pushed = 0;    ///< slow link, trainer to server
  int64_t gathered = 0;  ///< fabric, received by all-gathers (in the weights' encoding)
  int64_t reduced = 0;   ///< fabric, received by reduce-scatters (in the gradients' encoding)
};

/// The predicted times of one step (seconds).
struct StepTime {
  double compute = 0;  ///< the model computing, recomputation included
  double comm = 0;     ///< some transfer in flight (the trainer's comm_busy)
  double exposed = 0;  ///< the step minus compute: communication not hidden
  double step = 0;
  double tokens_per_second = 0;  ///< of the whole job
  bool comm_bound() const { return exposed > compute; }
};

/// Where compute starts to hide the slow link, by the step model itself
/// (PredictStepTime, latency included): the knee agrees with the step's
/// own comm_bound() on either side of it.
struct Knee {
  double bytes_per_parameter = 0;  ///< per step, the busier direction
  /// Per trainer: with more tokens per step (the same bytes, more compute)
  /// the step is compute-bound, with fewer communication-bound. 0 when the
  /// slow link is unlimited and has no latency.
  double tokens_per_step = 0;
  /// What the bandwidth alone asks: FLOP/s · mfu ÷ bytes/s, scaled by the
  /// bytes per parameter on the busier direction and divided by the 6 FLOPs
  /// per parameter and token (0 on an unlimited link). Latency raises the
  /// knee above it.
  double bandwidth_tokens_per_step = 0;
  /// The same knee as a slow-link rate at the link's latency: above it,
  /// this job is compute-bound. Infinite when latency alone keeps it
  /// communication-bound at any rate; 0 when it is compute-bound at any.
  double rate_bytes_per_second = 0;
};

/// What one lever alone would change.
struct LeverOption {
  std::string flags;  ///< the flags that turn it on, e.g. "--weight_encoding=int8"
  StepBytes bytes;
  StepTime time;
  int64_t trainer_memory = 0;
  double speedup = 0;  ///< this lever's tokens per second ÷ the baseline's
  /// Tokens per step ÷ the baseline's (accumulation: more micro-batches a
  /// step, a larger batch for the optimizer).
  double batch_factor = 1;
  /// The job's encodings unchanged: the lever changes when and how much
  /// moves, not the numbers trained (int8 or int4 blocks do).
  bool keeps_numbers = true;
};

/// Predicted tokens/s closer than this fraction are not told apart: the
/// step model is not that fine (measured lever speedups spread by about
/// ±8% from run to run on a shared 2-core machine, bench/README.md).
inline constexpr double kIndistinctSpeedup = 0.05;

struct Plan {
  PlanInput input;
  int64_t parameters = 0;         ///< of the model, unpadded
  int64_t padded_parameters = 0;  ///< Ψ: every unit padded to N slices
  ServerMemory server;
  TrainerMemory trainer;
  ZeroMemory zero;
  /// The largest of the trainers' bytes per step (members of a group differ
  /// when G does not divide N), and each trainer's.
  StepBytes bytes;
  std::vector<StepBytes> bytes_by_trainer;
  StepTime time;
  Knee knee;
  std::vector<LeverOption> levers;  ///< sorted by predicted tokens per second, most first
};

/// The plan of a valid input (Validate first).
absl::StatusOr<Plan> MakePlan(const PlanInput& input);

/// Bytes per step of trainer `rank` (exactly what training measures).
absl::StatusOr<StepBytes> StepBytesOf(const PlanInput& input, int rank);

}  // namespace pshard

#endif  // PSHARD_LAB_PLAN_H_
