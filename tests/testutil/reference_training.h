// Unsharded training in one process: the parity oracle. It trains the same
// model on the same micro-batches as M trainers against N servers and
// applies the same roundings: the wire encoding on weights and gradients
// (quantized slice by slice, as each server's slice is, with each trainer's
// error-feedback residual carried from push to push), contributions summed in the canonical tree order (per micro-batch over
// ranks, then over micro-batches; or, when trainers accumulate, over their
// micro-batches first), the norm summed exactly.
#ifndef PSHARD_TESTS_TESTUTIL_REFERENCE_TRAINING_H_
#define PSHARD_TESTS_TESTUTIL_REFERENCE_TRAINING_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/job_config.h"
#include "common/wire_encoding.h"
#include "trainer_client/data/dataset.h"
#include "trainer_client/model/unit_model.h"
#include "trainer_client/trainer.h"

namespace pshard::testing {

class ReferenceTraining {
 public:
  /// `error_feedback`: as ShardClient::Options (for quantized gradients).
  /// `group_size` > 1: trainers form fabric groups of consecutive ranks,
  /// which sum their gradients in fp32 and push each slice once, encoded
  /// (and carrying its residual) by the one member that owns it.
  /// `model` makes the model that computes the gradients (one lane).
  static absl::StatusOr<ReferenceTraining> Create(const JobConfig& job, WireEncodings encoding,
                                                  const TrainerOptions& trainer, const TokenDataset* data,
                                                  bool error_feedback = true, int group_size = 1,
                                                  const UnitModelFactory& model = CreateUnitModel);

  /// The gradient of trainer `rank`'s micro-batch `micro` at `step` with the
  /// current weights as the wire delivers them (padded per unit; not rounded
  /// to the wire encoding).
  absl::StatusOr<std::vector<std::vector<float>>> MicroBatchGradient(int64_t step, int rank, int micro = 0);
  /// One optimizer step over all M micro-batches.
  absl::Status Step(int64_t step);

  /// Forgets trainer `rank`'s error-feedback residuals, as a restarted
  /// trainer does.
  void ResetResidual(int rank);

  /// Master weights per unit, unpadded.
  std::vector<std::vector<float>> MasterWeights() const;
  int64_t skipped_steps() const { return skipped_; }

 private:
  ReferenceTraining(JobConfig job, JobLayout layout, WireEncodings encoding, TrainerOptions trainer,
                    const TokenDataset* data, std::unique_ptr<UnitModel> model, bool error_feedback, int group_size);
  /// `values` (a padded unit) as the wire delivers it in `format`, slice by slice.
  void RoundTripBySlice(const WireFormat& format, size_t unit, std::vector<float>& values) const;

  JobConfig job_;
  JobLayout layout_;
  WireEncodings encoding_;
  TrainerOptions trainer_;
  const TokenDataset* data_;
  std::unique_ptr<UnitModel> model_;
  bool error_feedback_;
  int group_size_;
  std::vector<std::vector<float>> master_, m_, v_;  // padded per unit
  std::vector<std::vector<std::vector<float>>> residual_;  // [rank][unit], padded
  int64_t applied_ = 0;
  int64_t skipped_ = 0;
};

/// Master weights after unsharded training of steps 0..steps-1.
absl::StatusOr<std::vector<std::vector<float>>> TrainReference(const JobConfig& job, WireEncodings encoding,
                                                              const TrainerOptions& trainer,
                                                              const TokenDataset& data, int64_t steps,
                                                              bool error_feedback = true, int group_size = 1,
                                                              const UnitModelFactory& model = CreateUnitModel);

/// True when both hold the same units with the same bits (and are not empty).
bool BitIdentical(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b);

}  // namespace pshard::testing

#endif  // PSHARD_TESTS_TESTUTIL_REFERENCE_TRAINING_H_
