// Shard checkpoints: one file per shard and step holding the shard's fp32
// master slices and AdamW moments, written atomically (temporary file,
// fsync, rename) and checked by CRC-32C when read back. A checkpoint binds
// to the model's layout (shape, shard count, alignment) and records where
// the learning-rate schedule ends; not the other optimizer settings or the
// trainer count, so a job may resume with a new learning rate or more
// trainers, but never onto a different partition.
#ifndef PSHARD_SHARD_SERVER_CHECKPOINT_H_
#define PSHARD_SHARD_SERVER_CHECKPOINT_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pshard {

struct CheckpointHeader {
  /// The partition the slices belong to, in words: the layout's model
  /// words, its fingerprint, the shard count and the alignment
  /// (CheckpointLayoutWords).
  std::string layout;
  int32_t shard_index = 0;
  int32_t num_shards = 1;
  int64_t step = 0;  ///< the step the shard was about to reduce (= the version published)
  int64_t applied_updates = 0;
  int64_t skipped_steps = 0;
  /// The job's total_steps (end of the cosine decay; 0: none); -1 in files
  /// of the first format, which did not record it.
  int64_t schedule_end = 0;
  /// The layout itself (FormatLayoutJson, one line) and the slice
  /// alignment, so that a folder of checkpoints can be read, exported and
  /// resharded without the job's flags; empty and 0 in files of formats 1
  /// and 2, which did not record them.
  std::string layout_json;
  int64_t slice_alignment = 0;
};

/// CheckpointHeader::layout for a layout split over `num_shards` with
/// `slice_alignment`: "<model words> layout=0x<fingerprint> shards=N
/// alignment=A".
std::string CheckpointLayoutWords(const std::string& model, uint64_t layout_fingerprint, int num_shards,
                                  int64_t slice_alignment);

/// One unit's slice state, borrowed for writing.
struct CheckpointUnitView {
  std::span<const float> master, m, v;
};

/// One unit's slice state, owned after reading.
struct CheckpointUnit {
  std::vector<float> master, m, v;
};

struct Checkpoint {
  CheckpointHeader header;
  std::vector<CheckpointUnit> units;
  std::string path;
};

/// File name of shard `shard` of `num_shards` at `step` (zero-padded so
/// names sort by step).
std::string CheckpointFileName(int shard, int num_shards, int64_t step);

/// Writes the checkpoint into `dir` (created if missing) and then removes
/// this shard's older checkpoints beyond the newest `keep`, except
/// `protected_step` (the newest step every shard of the job is known to
/// hold; -1: none): it stays until a newer common step replaces it.
/// Returns the path.
absl::StatusOr<std::string> WriteCheckpoint(const std::string& dir, const CheckpointHeader& header,
                                            std::span<const CheckpointUnitView> units, int keep,
                                            int64_t protected_step = -1);

/// Writes a checkpoint held in memory (ShardState::Snapshot) into `dir` as
/// WriteCheckpoint does, but removes nothing.
absl::StatusOr<std::string> WriteCheckpointFile(const std::string& dir, const Checkpoint& checkpoint);

/// Removes shard `shard`'s checkpoints in `dir` beyond the newest `keep`,
/// except those of `protected_steps` and `written_step` (-1: none).
void PruneCheckpoints(const std::string& dir, int shard, int num_shards, int keep,
                      std::span<const int64_t> protected_steps, int64_t written_step = -1);

/// Reads and verifies one checkpoint file.
absl::StatusOr<Checkpoint> ReadCheckpoint(const std::string& path);
/// Reads only the header of a checkpoint file (not verified by its CRC).
absl::StatusOr<CheckpointHeader> ReadCheckpointHeader(const std::string& path);

/// A checkpoint file in a folder, by its name.
struct CheckpointFileEntry {
  std::string name;
  int shard = 0;
  int num_shards = 0;
  int64_t step = 0;
};
/// Every pshard checkpoint file in `dir`, of any shard and shard count,
/// sorted by (shard count, shard, step).
std::vector<CheckpointFileEntry> ListCheckpointFiles(const std::string& dir);

/// Refuses a folder that holds checkpoints of another layout than
/// `layout` (another shard count, model or alignment), naming both layouts
/// and how to proceed; OK for an empty or absent folder.
absl::Status CheckFolderLayout(const std::string& dir, int num_shards, const std::string& layout);

/// Moves every checkpoint in `dir` that shard `shard` of `num_shards` must
/// not read or overwrite (its own, and those of other shard counts) into a
/// new subfolder, and returns that subfolder ("" when nothing was there).
/// Nothing is deleted.
absl::StatusOr<std::string> SetAsideCheckpoints(const std::string& dir, int shard, int num_shards);

/// Moves a damaged checkpoint file out of the way, into the subfolder
/// `damaged` of its folder (created if missing; a file of the same name
/// there gets a time suffix), so that resume and retention no longer see
/// it. Nothing is deleted. Returns the new path.
absl::StatusOr<std::string> SetAsideDamagedCheckpoint(const std::string& path);

/// Steps of this shard's checkpoints in `dir`, ascending (empty when none or
/// no such folder).
std::vector<int64_t> ListCheckpointSteps(const std::string& dir, int shard, int num_shards);

}  // namespace pshard

#endif  // PSHARD_SHARD_SERVER_CHECKPOINT_H_
