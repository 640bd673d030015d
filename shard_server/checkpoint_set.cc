#include "shard_server/checkpoint_set.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/layout_file.h"
#include "common/partition.h"
#include "common/status_macros.h"
#include "shard_server/checkpoint.h"

namespace pshard {
namespace {

std::string Path(const std::string& dir, const std::string& name) {
  return (std::filesystem::path(dir) / name).string();
}

// The shard count to read: `wanted`, or the folder's only one.
absl::StatusOr<int> ChooseShardCount(const std::string& dir, const std::vector<CheckpointFileEntry>& files,
                                     int wanted) {
  std::set<int> counts;
  for (const CheckpointFileEntry& f : files) counts.insert(f.num_shards);
  if (counts.empty()) return absl::NotFoundError(absl::StrCat("no pshard checkpoints in ", dir));
  if (wanted > 0) {
    if (counts.count(wanted) == 0) {
      return absl::NotFoundError(absl::StrCat(dir, " holds no checkpoints of ", wanted, " shards (it holds ",
                                              absl::StrJoin(counts, ", "), "-shard ones)"));
    }
    return wanted;
  }
  if (counts.size() > 1) {
    return absl::FailedPreconditionError(absl::StrCat(dir, " holds checkpoints of ", absl::StrJoin(counts, ", "),
                                                      " shards: say which (--num_shards)"));
  }
  return *counts.begin();
}

// The step to read: `wanted`, or the newest every shard holds.
absl::StatusOr<int64_t> ChooseStep(const std::string& dir, const std::vector<CheckpointFileEntry>& files, int n,
                                   int64_t wanted) {
  std::map<int64_t, std::set<int>> shards_by_step;
  for (const CheckpointFileEntry& f : files) {
    if (f.num_shards == n) shards_by_step[f.step].insert(f.shard);
  }
  auto missing = [&](int64_t step) {
    std::vector<std::string> names;
    for (int s = 0; s < n; ++s) {
      if (shards_by_step[step].count(s) == 0) names.push_back(CheckpointFileName(s, n, step));
    }
    return names;
  };
  if (wanted >= 0) {
    if (shards_by_step.count(wanted) == 0) {
      std::vector<int64_t> steps;
      for (const auto& [step, shards] : shards_by_step) steps.push_back(step);
      return absl::NotFoundError(absl::StrCat(dir, " holds no ", n, "-shard checkpoint of step ", wanted,
                                              " (steps there: ", absl::StrJoin(steps, ", "), ")"));
    }
    if (const std::vector<std::string> lacking = missing(wanted); !lacking.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("the checkpoint of step ", wanted, " in ", dir,
                                                        " is incomplete: no ", absl::StrJoin(lacking, ", ")));
    }
    return wanted;
  }
  for (auto it = shards_by_step.rbegin(); it != shards_by_step.rend(); ++it) {
    if (static_cast<int>(it->second.size()) == n) return it->first;
  }
  const int64_t newest = shards_by_step.rbegin()->first;
  return absl::FailedPreconditionError(absl::StrCat("no step in ", dir, " has the checkpoints of all ", n,
                                                    " shards; the newest, step ", newest, ", lacks ",
                                                    absl::StrJoin(missing(newest), ", ")));
}

}  // namespace

absl::StatusOr<JobCheckpoint> ReadJobCheckpoint(const std::string& dir, int num_shards, int64_t step) {
  const std::vector<CheckpointFileEntry> files = ListCheckpointFiles(dir);
  ASSIGN_OR_RETURN(const int n, ChooseShardCount(dir, files, num_shards));
  ASSIGN_OR_RETURN(step, ChooseStep(dir, files, n, step));
  JobCheckpoint job;
  std::vector<UnitPartition> partitions;
  CheckpointHeader first;
  for (int s = 0; s < n; ++s) {
    const std::string path = Path(dir, CheckpointFileName(s, n, step));
    ASSIGN_OR_RETURN(Checkpoint c, ReadCheckpoint(path));
    const CheckpointHeader& h = c.header;
    auto refuse = [&](const std::string& what) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint ", path, ": ", what));
    };
    if (h.shard_index != s || h.num_shards != n || h.step != step) {
      return refuse(absl::StrCat("its header says shard ", h.shard_index, " of ", h.num_shards, " at step ", h.step,
                                 "; its name says shard ", s, " of ", n, " at step ", step));
    }
    if (h.layout_json.empty()) {
      return refuse("written by an older pshard that did not record the layout in its checkpoints; resume the job "
                    "with this version to write checkpoints that can be read on their own");
    }
    if (s == 0) {
      first = h;
      absl::StatusOr<ModelSpec> layout = ParseLayoutJson(h.layout_json);
      if (!layout.ok()) return refuse(absl::StrCat("its layout is damaged: ", layout.status().message()));
      job.layout = *std::move(layout);
      if (h.slice_alignment < 1) return refuse(absl::StrCat("slice alignment ", h.slice_alignment));
      const std::string words =
          CheckpointLayoutWords(job.layout.model, LayoutFingerprint(job.layout), n, h.slice_alignment);
      if (h.layout != words) return refuse(absl::StrCat("its layout words (", h.layout, ") do not match its layout (", words, ")"));
      ASSIGN_OR_RETURN(partitions, PartitionUnits(job.layout.UnitNumels(), n, h.slice_alignment));
      job.slice_alignment = h.slice_alignment;
      job.num_shards = n;
      job.step = step;
      job.applied_updates = h.applied_updates;
      job.skipped_steps = h.skipped_steps;
      job.schedule_end = h.schedule_end;
      for (const UnitPartition& p : partitions) {
        job.master.emplace_back(p.padded_numel(), 0.0f);
        job.m.emplace_back(p.padded_numel(), 0.0f);
        job.v.emplace_back(p.padded_numel(), 0.0f);
      }
    } else if (h.layout_json != first.layout_json || h.slice_alignment != first.slice_alignment) {
      return refuse(absl::StrCat("another job's layout than shard 0's (", h.layout, " against ", first.layout, ")"));
    } else if (h.applied_updates != first.applied_updates || h.skipped_steps != first.skipped_steps ||
               h.schedule_end != first.schedule_end) {
      return refuse(absl::StrCat("its counts (", h.applied_updates, " updates, ", h.skipped_steps,
                                 " skipped, schedule to ", h.schedule_end, ") differ from shard 0's (",
                                 first.applied_updates, ", ", first.skipped_steps, ", ", first.schedule_end, ")"));
    }
    if (c.units.size() != partitions.size()) {
      return refuse(absl::StrCat(c.units.size(), " units; the layout has ", partitions.size()));
    }
    for (size_t u = 0; u < partitions.size(); ++u) {
      const SliceRange slice = partitions[u].Slice(s);
      if (static_cast<int64_t>(c.units[u].master.size()) != slice.length) {
        return refuse(absl::StrCat("unit ", u, " holds ", c.units[u].master.size(), " elements; its slice has ",
                                   slice.length));
      }
      std::copy(c.units[u].master.begin(), c.units[u].master.end(), job.master[u].begin() + slice.begin);
      std::copy(c.units[u].m.begin(), c.units[u].m.end(), job.m[u].begin() + slice.begin);
      std::copy(c.units[u].v.begin(), c.units[u].v.end(), job.v[u].begin() + slice.begin);
    }
  }
  for (size_t u = 0; u < partitions.size(); ++u) {
    for (std::vector<float>* part : {&job.master[u], &job.m[u], &job.v[u]}) part->resize(partitions[u].numel);
  }
  return job;
}

absl::Status WriteJobCheckpoint(const JobCheckpoint& job, int num_shards, const std::string& dir) {
  ASSIGN_OR_RETURN(const std::vector<UnitPartition> partitions,
                   PartitionUnits(job.layout.UnitNumels(), num_shards, job.slice_alignment));
  for (size_t u = 0; u < partitions.size(); ++u) {
    if (static_cast<int64_t>(job.master[u].size()) != partitions[u].numel ||
        job.m[u].size() != job.master[u].size() || job.v[u].size() != job.master[u].size()) {
      return absl::InvalidArgumentError(absl::StrCat("unit ", u, " does not hold its layout's elements"));
    }
  }
  const std::string layout_json = FormatLayoutJson(job.layout, /*one_line=*/true);
  const std::string words =
      CheckpointLayoutWords(job.layout.model, LayoutFingerprint(job.layout), num_shards, job.slice_alignment);
  for (int s = 0; s < num_shards; ++s) {
    Checkpoint c;
    c.header.layout = words;
    c.header.shard_index = s;
    c.header.num_shards = num_shards;
    c.header.step = job.step;
    c.header.applied_updates = job.applied_updates;
    c.header.skipped_steps = job.skipped_steps;
    c.header.schedule_end = job.schedule_end;
    c.header.layout_json = layout_json;
    c.header.slice_alignment = job.slice_alignment;
    for (size_t u = 0; u < partitions.size(); ++u) {
      const SliceRange slice = partitions[u].Slice(s);
      CheckpointUnit unit;
      for (auto [from, to] : {std::pair{&job.master[u], &unit.master}, std::pair{&job.m[u], &unit.m},
                              std::pair{&job.v[u], &unit.v}}) {
        to->assign(slice.length, 0.0f);  // padding is zero
        std::copy_n(from->begin() + slice.begin, slice.valid, to->begin());
      }
      c.units.push_back(std::move(unit));
    }
    RETURN_IF_ERROR(WriteCheckpointFile(dir, c).status());
  }
  return absl::OkStatus();
}

}  // namespace pshard
