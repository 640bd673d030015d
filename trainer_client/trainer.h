// One training step of a trainer: fetch each unit just in time (prefetching
// the next ones), compute, drop it, push its gradient to the owners; and the
// accounting of where the step's wall time went.
#ifndef PSHARD_TRAINER_CLIENT_TRAINER_H_
#define PSHARD_TRAINER_CLIENT_TRAINER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/reduction_tree.h"
#include "trainer_client/data/dataset.h"
#include "trainer_client/group/group_collective.h"
#include "trainer_client/prefetcher.h"
#include "trainer_client/model/unit_model.h"
#include "trainer_client/shard_client.h"

namespace pshard {

struct TrainerOptions {
  int batch = 8;            ///< sequences per micro-batch
  int seq_len = 64;         ///< tokens per sequence (<= model context)
  int prefetch_depth = 1;   ///< units fetched ahead of the one computing
  uint64_t data_seed = 1;   ///< data order is a function of (seed, step, rank, micro-batch)
  /// Keep only each block's input between forward and backward and
  /// recompute its internals in backward (CpuGpt's recompute_blocks):
  /// less activation memory for about one more forward of the blocks.
  bool recompute_blocks = false;
  /// Where the model runs: "cpu", "cuda" or "auto" (see CreateUnitModel).
  std::string device = "cpu";
  /// Run all of a step's micro-batches in one pass, so that each unit is
  /// fetched once per step (not once per micro-batch) and its gradient,
  /// summed over them by the model, pushed once: the traffic of one
  /// micro-batch for the activations of all of them. Needs a job that
  /// accumulates on the trainer.
  bool fetch_once_per_step = false;
  /// FSDP's reshard_after_forward. true (ZeRO stage 3): each unit's weights
  /// are dropped after its forward and fetched again for its backward.
  /// false: every unit is kept from its forward until its backward, so its
  /// weights cross the link once per pass instead of twice, for the memory
  /// of all units' weights held at the end of the forward.
  bool reshard_after_forward = true;
  /// The secondary shard (FSDP's reshard_after_forward = G, ZeRO++'s hpZ):
  /// with reshard_after_forward, each member of this trainer's fabric group
  /// (whose size this must be) keeps the 1/G of every unit it fetched in
  /// forward, and backward all-gathers the unit within the group, so
  /// backward fetches nothing over the slow link. 0: off.
  int secondary_shard = 0;
  /// The ZeRO stage of the weights: 3 (the default) fetches them pass by
  /// pass as reshard_after_forward says; 2 keeps a resident replica of
  /// every unit, fetched once per step (unit by unit, just in time in the
  /// step's first forward) and used by every pass of the step. Stage 1 is
  /// stage 2 in pshard: gradients always go to their owners.
  int stage = 3;
  /// The CUDA model's attention kernel: "auto", "fused", "materialized".
  std::string attention = "auto";
  /// The fabric group this trainer belongs to (not owned; null: none). Its
  /// members are consecutive ranks starting at rank - group->rank().
  GroupCollective* group = nullptr;
};

/// Disjoint phases of one step; compute + comm_exposed + data + other = wall.
struct StepTimes {
  absl::Duration wall;
  absl::Duration compute;       ///< the model computing forward and backward (on its device)
  /// Communication while the model did not compute: waiting for (or
  /// issuing) fetches, pushes, group collectives and host-device copies.
  absl::Duration comm_exposed;
  absl::Duration data;          ///< sampling the micro-batch, while neither of the above
  absl::Duration other;         ///< the rest (bookkeeping, gradient packing)
  absl::Duration comm_busy;     ///< time any transfer was in flight (not a phase)
};

struct StepReport {
  int64_t step = 0;
  double loss = 0.0;       ///< mean over the step's micro-batches
  /// RMS over the step's micro-batches of this rank's gradient L2 norm (with
  /// fetch_once_per_step: the L2 norm of their mean gradient).
  double grad_norm = 0.0;
  int64_t tokens = 0;
  double flops = 0.0;      ///< model FLOPs of the step's forward + backward
  int64_t bytes_fetched = 0;  ///< on the wire, framing included
  int64_t bytes_pushed = 0;
  /// The encoded slices alone (elements and block scales), as
  /// docs/levers.md's formulas count them.
  int64_t payload_fetched = 0;
  int64_t payload_pushed = 0;
  /// Bytes received from the fabric group's other members: unit parts
  /// all-gathered (forward, and backward with a secondary shard) and
  /// gradient parts reduce-scattered, fp32.
  int64_t fabric_gathered = 0;
  int64_t fabric_reduced = 0;
  StepTimes times;
  std::vector<absl::Duration> fetch_latencies;  ///< one per unit fetch
  std::vector<absl::Duration> push_latencies;   ///< one per unit push
};

struct EvalReport {
  int64_t version = 0;
  double loss = 0.0;  ///< mean cross-entropy over the batches, nats
  int batches = 0;    ///< micro-batches evaluated
  int64_t tokens = 0;
  absl::Duration wall;
  int64_t bytes_fetched = 0;
};

/// Runs steps for one trainer rank. Not thread-safe; one per thread.
class Trainer {
 public:
  /// `client` and `data` must outlive the trainer.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(ShardClient* client, const TokenDataset* data,
                                                         TrainerOptions options);
  /// With a model the caller made (from ModelOptions(); a test double, say)
  /// instead of the one `options` name.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(ShardClient* client, const TokenDataset* data,
                                                         TrainerOptions options, std::unique_ptr<UnitModel> model);
  /// The model options a trainer with these options on this client uses.
  static UnitModelOptions ModelOptions(const ShardClient& client, const TrainerOptions& options);

  /// Trains step `step` (fetching version `step` of every unit) and returns
  /// once every gradient push of the step is acknowledged.
  absl::StatusOr<StepReport> RunStep(int64_t step);

  /// The loss of version `version` of the weights on held-out data:
  /// forward only, over micro-batches 0..batches-1 of `data` (rounded up to
  /// whole passes of the model's lanes), sampled as a pure function of
  /// (`seed`, micro-batch) so that every evaluation sees the same text.
  /// Fetches every unit once per pass (through the fabric group, whose
  /// members must all evaluate alike) and pushes nothing; the time it takes
  /// is not counted in any step's report.
  absl::StatusOr<EvalReport> Evaluate(int64_t version, const TokenDataset& data, int batches, uint64_t seed);

  int rank() const { return client_->options().trainer_rank; }
  const UnitModel& model() const { return *model_; }

 private:
  Trainer(ShardClient* client, const TokenDataset* data, TrainerOptions options, std::unique_ptr<UnitModel> model);
  static absl::Status CheckOptions(const ShardClient& client, const TrainerOptions& options);

  /// Forward and backward of the model's lanes on micro-batches
  /// first_micro, first_micro + 1, ...; their gradients (summed over the
  /// lanes) are pushed, or added to `accumulated` (one reducer per unit)
  /// when not null.
  /// `resident` (stage 2: one per unit) holds the units already fetched
  /// this step and receives those this pass fetches; null at stage 3.
  absl::Status RunPass(int64_t step, int first_micro, StepReport* report, TransferLog* log, IntervalUnion* data,
                       std::vector<TreeReducer>* accumulated, std::vector<std::shared_ptr<UnitTransfer>>* pushes,
                       std::vector<std::shared_ptr<UnitTransfer>>* resident);
  /// The unit's weights rebuilt for backward from this member's part of
  /// them (kept from forward) and the group's other members' (all-gathered).
  absl::StatusOr<std::vector<float>> Regather(int unit, const std::vector<float>& part, TransferLog* log);
  /// Reduces `grads` within the group (if any) and starts pushing them.
  absl::Status PushUnit(int unit, int64_t step, int micro, std::vector<float> grads, TransferLog* log,
                        std::vector<std::shared_ptr<UnitTransfer>>* pushes);

  ShardClient* const client_;
  const TokenDataset* const data_;
  const TrainerOptions options_;
  std::unique_ptr<UnitModel> model_;
  std::vector<int32_t> tokens_, targets_;
};

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_TRAINER_H_
