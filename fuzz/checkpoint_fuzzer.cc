// The checkpoint loader: the input after its choices byte is a checkpoint
// file, read back by ReadCheckpointHeader and ReadCheckpoint. With the
// choices' low bit set the harness appends the CRC-32C of the bytes, as
// the writer does, so that mutated files also get past the checksum to
// what a server does with a checkpoint it read: restore it. A checkpoint
// read whole has the header read alone, moments as long as its masters,
// and is written back to the same bytes (format 2); one restored onto a
// shard of the fuzz job puts the shard at its step with its weights.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "fuzz/harness.h"
#include "fuzz/in_process_shard.h"
#include "shard_server/checkpoint.h"
#include "shard_server/shard_state.h"

namespace pshard::fuzz {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

bool SameHeader(const CheckpointHeader& a, const CheckpointHeader& b) {
  return a.layout == b.layout && a.shard_index == b.shard_index && a.num_shards == b.num_shards &&
         a.step == b.step && a.applied_updates == b.applied_updates && a.skipped_steps == b.skipped_steps &&
         a.schedule_end == b.schedule_end;
}

// Writes the checkpoint again and compares the file with the one read.
void CheckRewrite(const Checkpoint& checkpoint, const std::string& file) {
  std::vector<CheckpointUnitView> views;
  for (const CheckpointUnit& u : checkpoint.units) views.push_back({u.master, u.m, u.v});
  const std::string dir = ScratchFolder() + "/rewritten";
  absl::StatusOr<std::string> path = WriteCheckpoint(dir, checkpoint.header, views, 1);
  Require(path.ok(), absl::StrCat("a checkpoint read cannot be written back: ", path.status().message()));
  Require(ReadFile(*path) == file, "a checkpoint written back differs from the file it was read from");
  std::filesystem::remove_all(dir);
}

void CheckRestore(Checkpoint checkpoint) {
  const JobConfig job = FuzzJob();
  const CheckpointHeader header = checkpoint.header;
  const int shard = header.shard_index >= 0 && header.shard_index < job.num_shards ? header.shard_index : 0;
  absl::StatusOr<std::unique_ptr<ShardState>> state = ShardState::Create(job, shard);
  Require(state.ok(), state.status().ToString());
  const std::vector<CheckpointUnit> units = checkpoint.units;
  if (!(*state)->RestoreCheckpoint(std::move(checkpoint)).ok()) return;
  Require((*state)->current_step() == header.step && (*state)->counters().applied_updates == header.applied_updates,
          "a restored shard is not at the checkpoint's step");
  for (int u = 0; u < (*state)->num_units(); ++u) {
    const auto [version, master] = (*state)->ReadMaster(u);
    Require(version == header.step && master.size() == units[u].master.size() &&
                std::memcmp(master.data(), units[u].master.data(), master.size() * sizeof(float)) == 0,
            "a restored unit differs from its checkpoint");
  }
}

void FuzzCheckpoint(const uint8_t* data, size_t size) {
  if (size == 0) return;
  std::string file(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] & 1) {
    const uint32_t crc = Crc32c(file.data(), file.size());
    file.append(reinterpret_cast<const char*>(&crc), sizeof(crc));
  }
  const std::string path = ScratchFolder() + "/input.ckpt";
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(file.data(), static_cast<std::streamsize>(file.size()));
  }
  const absl::StatusOr<CheckpointHeader> header = ReadCheckpointHeader(path);
  absl::StatusOr<Checkpoint> checkpoint = ReadCheckpoint(path);
  if (!checkpoint.ok()) return;
  Require(header.ok() && SameHeader(*header, checkpoint->header), "the header read alone differs from the whole");
  for (const CheckpointUnit& u : checkpoint->units) {
    Require(u.m.size() == u.master.size() && u.v.size() == u.master.size(), "moments of another length");
  }
  // Written back in the format the writer writes (3): an older file that
  // reads is written back as format 3, so only a format-3 file must come
  // back byte for byte.
  if (std::memcmp(file.data(), "PSHDCKP3", 8) == 0) CheckRewrite(*checkpoint, file);
  CheckRestore(std::move(*checkpoint));
}

}  // namespace
}  // namespace pshard::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pshard::fuzz::FuzzCheckpoint(data, size);
  return 0;
}
