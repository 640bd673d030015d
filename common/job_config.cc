#include "common/job_config.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pshard {

absl::Status JobConfig::Validate() const {
  RETURN_IF_ERROR(ValidateModelSpec(model));
  if (model.HasGivenValues() && init_fingerprint == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the layout (", model.model, ") takes some initial values from an initial-weights file, and the job has none"));
  }
  if (num_shards < 1) return absl::InvalidArgumentError(absl::StrCat("num_shards ", num_shards, " must be >= 1"));
  if (num_trainers < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_trainers ", num_trainers, " must be >= 1"));
  }
  if (micro_batches < 1) {
    return absl::InvalidArgumentError(absl::StrCat("micro_batches ", micro_batches, " must be >= 1"));
  }
  if (slice_alignment < 1) {
    return absl::InvalidArgumentError(absl::StrCat("slice_alignment ", slice_alignment, " must be >= 1"));
  }
  if (optimizer.lr <= 0 || optimizer.beta1 < 0 || optimizer.beta1 >= 1 || optimizer.beta2 < 0 ||
      optimizer.beta2 >= 1 || optimizer.eps <= 0 || optimizer.weight_decay < 0 ||
      optimizer.grad_clip < 0 || optimizer.warmup_steps < 0 || optimizer.total_steps < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad optimizer settings: lr=", optimizer.lr, " betas=(", optimizer.beta1, ", ",
        optimizer.beta2, ") eps=", optimizer.eps, " weight_decay=", optimizer.weight_decay,
        " grad_clip=", optimizer.grad_clip, " warmup=", optimizer.warmup_steps,
        " total=", optimizer.total_steps));
  }
  return absl::OkStatus();
}

absl::StatusOr<JobLayout> MakeJobLayout(const JobConfig& job) {
  RETURN_IF_ERROR(job.Validate());
  JobLayout layout;
  layout.spec = job.model;
  const std::vector<int64_t> numels = layout.spec.UnitNumels();
  ASSIGN_OR_RETURN(layout.partitions, PartitionUnits(numels, job.num_shards, job.slice_alignment));
  return layout;
}

}  // namespace pshard
