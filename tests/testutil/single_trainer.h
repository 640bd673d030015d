// One trainer against a fresh in-process cluster, step by step: what the
// trainer-level tests (CPU and GPU models, synchronous or not) compare.
#ifndef PSHARD_TESTS_TESTUTIL_SINGLE_TRAINER_H_
#define PSHARD_TESTS_TESTUTIL_SINGLE_TRAINER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/job_config.h"
#include "trainer_client/trainer.h"

namespace pshard::testing {

struct SingleTrainerRun {
  std::vector<double> losses;  ///< one per step
  std::vector<StepReport> reports;
  std::vector<std::vector<float>> final_weights;  ///< the servers' master weights after the last step
  // The trainer's model, as it was made.
  ModelMemory memory;
  int lanes = 0;
  std::string device_name;
  int64_t largest_unit = 0;  ///< elements of the job's largest unit
};

/// Makes the trainer's model (instead of the one its options name).
using ModelMaker = std::function<absl::StatusOr<std::unique_ptr<UnitModel>>(const ShardClient&, const TrainerOptions&)>;

/// Trains steps 0..steps-1 with trainer 0 of `job` (fp32 on the wire) on a
/// fresh LocalCluster, its model from `make_model` when given.
absl::StatusOr<SingleTrainerRun> TrainSingleTrainer(const JobConfig& job, const TrainerOptions& options, int steps,
                                                    const ModelMaker& make_model = nullptr);

/// The same losses and the same final weights, bit for bit.
bool SameTraining(const SingleTrainerRun& a, const SingleTrainerRun& b);

}  // namespace pshard::testing

#endif  // PSHARD_TESTS_TESTUTIL_SINGLE_TRAINER_H_
