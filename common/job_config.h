// What every shard server and trainer of one job must agree on.
#ifndef PSHARD_COMMON_JOB_CONFIG_H_
#define PSHARD_COMMON_JOB_CONFIG_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model_spec.h"
#include "common/partition.h"
#include "common/optimizer.h"

namespace pshard {

/// The job: layout, optimizer, seed and how it is spread. A plain value.
struct JobConfig {
  ModelSpec model;  ///< the layout: units of named tensors
  /// The job's initial-weights file (the servers' --init_from), as
  /// InitialWeights::fingerprint() has it; 0: the layout's rules alone
  /// give the initial weights.
  uint64_t init_fingerprint = 0;
  OptimizerConfig optimizer;
  uint64_t seed = 1234;
  int num_shards = 1;    ///< N
  int num_trainers = 1;  ///< M: contributions reduced per step
  int64_t slice_alignment = kSliceAlignment;
  bool deterministic = true;  ///< sum contributions in the canonical tree order
  /// Micro-batches each trainer computes per optimizer step (gradient accumulation).
  int micro_batches = 1;
  /// true: a trainer sums its micro-batches and pushes once per step (lean
  /// traffic); false: it pushes every micro-batch (lean memory).
  bool accumulate_on_trainer = false;

  /// Contribution slots the servers reduce per step: one per pushed micro-batch.
  int reduction_slots() const { return accumulate_on_trainer ? 1 : micro_batches; }

  /// Checks sizes and counts; returns a message naming the bad value.
  absl::Status Validate() const;
};

/// The model spec and unit partition a job implies.
struct JobLayout {
  ModelSpec spec;
  std::vector<UnitPartition> partitions;  ///< one per unit
};

absl::StatusOr<JobLayout> MakeJobLayout(const JobConfig& job);

}  // namespace pshard

#endif  // PSHARD_COMMON_JOB_CONFIG_H_
