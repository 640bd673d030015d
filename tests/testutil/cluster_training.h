// Training on a LocalCluster with every trainer of the job in its own thread.
#ifndef PSHARD_TESTS_TESTUTIL_CLUSTER_TRAINING_H_
#define PSHARD_TESTS_TESTUTIL_CLUSTER_TRAINING_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tests/testutil/local_cluster.h"
#include "trainer_client/data/dataset.h"
#include "trainer_client/trainer.h"

namespace pshard::testing {

/// The data paths this build has: {"grpc"} or {"grpc", "ucx"}.
std::vector<std::string> EnabledTransports();

struct ClusterTraining {
  WireEncodings encoding;  ///< per direction (one encoding: both)
  bool error_feedback = true;  ///< for quantized gradients
  std::string transport = "grpc";  ///< every link must end up on it
  TrainerOptions trainer;          ///< `group` is set per trainer when group_size > 1
  int group_size = 1;              ///< > 1: host fabric groups of consecutive ranks
  int64_t first_step = 0;
  int64_t steps = 1;  ///< train until this step (exclusive)
  /// Makes each trainer's model (null: the trainer's own, the GPT).
  UnitModelFactory model;
  /// When set: every rank's step reports, [rank][step - first_step].
  std::vector<std::vector<StepReport>>* reports = nullptr;
};

/// Trains steps first_step..steps-1 with trainers 0..M-1 of `cluster`'s job, each in
/// a thread. The first error of any trainer, naming it.
absl::Status TrainInThreads(const LocalCluster& cluster, int num_trainers, const TokenDataset& data,
                            const ClusterTraining& how);

/// Steps first..until-1 of a job of TinyGptJob's shape with `trainers`
/// trainers of TinyTrainerOptions(7), over gRPC in fp32.
absl::Status TrainTinySteps(const LocalCluster& cluster, int trainers, int64_t first, int64_t until);

}  // namespace pshard::testing

#endif  // PSHARD_TESTS_TESTUTIL_CLUSTER_TRAINING_H_
