// A job's checkpoint as a whole: every shard's file of one step and one
// shard count, read, verified against each other and put back together
// into whole units; and written out again for any shard count. What
// export, reshard and sample read, with no server running.
#ifndef PSHARD_SHARD_SERVER_CHECKPOINT_SET_H_
#define PSHARD_SHARD_SERVER_CHECKPOINT_SET_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model_spec.h"

namespace pshard {

/// The model state of a job at one step, independent of N. A plain value.
struct JobCheckpoint {
  ModelSpec layout;
  int64_t slice_alignment = 0;
  int num_shards = 0;  ///< of the files it was read from
  int64_t step = 0;
  int64_t applied_updates = 0;
  int64_t skipped_steps = 0;
  int64_t schedule_end = 0;
  /// Per unit, unpadded: fp32 master weights and AdamW's m and v.
  std::vector<std::vector<float>> master, m, v;
};

/// Reads the checkpoint of `step` (-1: the newest step every shard of the
/// count holds) written by `num_shards` servers (0: the one shard count the
/// folder holds) from `dir`, checking every file's CRC and that the files
/// belong together: the same layout (recorded in the file, format 3),
/// step, counts and schedule, a shard each, and slices of the layout's
/// partition. FailedPrecondition or DataLoss naming the file and what is
/// wrong; NotFound when the folder holds no such checkpoint (naming what it
/// holds).
absl::StatusOr<JobCheckpoint> ReadJobCheckpoint(const std::string& dir, int num_shards = 0, int64_t step = -1);

/// Writes `checkpoint` into `dir` (created if missing) as the files of
/// `num_shards` servers with the checkpoint's alignment: what those
/// servers would have written at its step. Nothing else in `dir` changes.
absl::Status WriteJobCheckpoint(const JobCheckpoint& checkpoint, int num_shards, const std::string& dir);

}  // namespace pshard

#endif  // PSHARD_SHARD_SERVER_CHECKPOINT_SET_H_
