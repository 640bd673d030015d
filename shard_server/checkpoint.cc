#include "shard_server/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <tuple>

#include "absl/algorithm/container.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/checksum.h"
#include "common/status_macros.h"

namespace pshard {
namespace {

// Format 2 adds the schedule's end after the counts, format 3 the layout
// document and the slice alignment after that; files of formats 1 and 2
// are still read.
constexpr char kMagic[8] = {'P', 'S', 'H', 'D', 'C', 'K', 'P', '3'};
constexpr char kMagicV2[8] = {'P', 'S', 'H', 'D', 'C', 'K', 'P', '2'};
constexpr char kMagicV1[8] = {'P', 'S', 'H', 'D', 'C', 'K', 'P', '1'};
// Guards against absurd lengths in a damaged file before allocating.
constexpr int64_t kMaxLayoutBytes = 4096;
constexpr int64_t kMaxLayoutJsonBytes = int64_t{1} << 30;
constexpr int64_t kMaxUnits = 1 << 20;

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

absl::Status ErrnoError(const std::string& what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

// Writes bytes and folds them into the running CRC.
class Writer {
 public:
  Writer(std::FILE* f, std::string path) : f_(f), path_(std::move(path)) {}
  absl::Status Put(const void* data, size_t size) {
    if (size == 0) return absl::OkStatus();
    if (std::fwrite(data, 1, size, f_) != size) return ErrnoError("cannot write", path_);
    crc_ = Crc32c(data, size, crc_);
    return absl::OkStatus();
  }
  template <typename T>
  absl::Status PutValue(T value) {
    return Put(&value, sizeof(value));
  }
  uint32_t crc() const { return crc_; }

 private:
  std::FILE* f_;
  std::string path_;
  uint32_t crc_ = 0;
};

class Reader {
 public:
  Reader(std::FILE* f, std::string path) : f_(f), path_(std::move(path)) {}
  absl::Status Get(void* data, size_t size) {
    if (size == 0) return absl::OkStatus();
    if (std::fread(data, 1, size, f_) != size) {
      return absl::DataLossError(absl::StrCat("checkpoint ", path_, " is truncated"));
    }
    crc_ = Crc32c(data, size, crc_);
    return absl::OkStatus();
  }
  template <typename T>
  absl::StatusOr<T> GetValue() {
    T value;
    if (absl::Status s = Get(&value, sizeof(value)); !s.ok()) return s;
    return value;
  }
  uint32_t crc() const { return crc_; }

 private:
  std::FILE* f_;
  std::string path_;
  uint32_t crc_ = 0;
};

absl::Status WriteAll(Writer& w, const CheckpointHeader& header, std::span<const CheckpointUnitView> units) {
  if (absl::Status s = w.Put(kMagic, sizeof(kMagic)); !s.ok()) return s;
  if (absl::Status s = w.PutValue<uint32_t>(static_cast<uint32_t>(header.layout.size())); !s.ok()) return s;
  if (absl::Status s = w.Put(header.layout.data(), header.layout.size()); !s.ok()) return s;
  for (const int32_t v : {header.shard_index, header.num_shards}) {
    if (absl::Status s = w.PutValue(v); !s.ok()) return s;
  }
  for (const int64_t v : {header.step, header.applied_updates, header.skipped_steps, header.schedule_end}) {
    if (absl::Status s = w.PutValue(v); !s.ok()) return s;
  }
  if (absl::Status s = w.PutValue<uint64_t>(header.layout_json.size()); !s.ok()) return s;
  if (absl::Status s = w.Put(header.layout_json.data(), header.layout_json.size()); !s.ok()) return s;
  if (absl::Status s = w.PutValue<int64_t>(header.slice_alignment); !s.ok()) return s;
  if (absl::Status s = w.PutValue<int32_t>(static_cast<int32_t>(units.size())); !s.ok()) return s;
  for (const CheckpointUnitView& unit : units) {
    if (unit.m.size() != unit.master.size() || unit.v.size() != unit.master.size()) {
      return absl::InternalError("checkpoint: a unit's master and moments differ in length");
    }
    if (absl::Status s = w.PutValue<int64_t>(static_cast<int64_t>(unit.master.size())); !s.ok()) return s;
    for (const std::span<const float> part : {unit.master, unit.m, unit.v}) {
      if (absl::Status s = w.Put(part.data(), part.size_bytes()); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

// Parses "shard-<i>-of-<n>.step-<s>.ckpt", or nullopt.
std::optional<CheckpointFileEntry> ParseName(const std::string& name) {
  if (!absl::StartsWith(name, "shard-") || !absl::EndsWith(name, ".ckpt")) return std::nullopt;
  const std::string middle = name.substr(6, name.size() - 6 - 5);  // "<i>-of-<n>.step-<s>"
  const size_t of = middle.find("-of-");
  const size_t dot = middle.find(".step-");
  if (of == std::string::npos || dot == std::string::npos || dot < of) return std::nullopt;
  CheckpointFileEntry entry;
  entry.name = name;
  if (!absl::SimpleAtoi(middle.substr(0, of), &entry.shard) ||
      !absl::SimpleAtoi(middle.substr(of + 4, dot - of - 4), &entry.num_shards) ||
      !absl::SimpleAtoi(middle.substr(dot + 6), &entry.step) || entry.shard < 0 || entry.num_shards < 1 ||
      entry.step < 0) {
    return std::nullopt;
  }
  return entry;
}

// Reads the header fields after the magic.
absl::StatusOr<CheckpointHeader> ReadHeader(Reader& r, const std::string& path) {
  char magic[sizeof(kMagic)];
  if (absl::Status s = r.Get(magic, sizeof(magic)); !s.ok()) return s;
  const bool v1 = std::memcmp(magic, kMagicV1, sizeof(kMagic)) == 0;
  const bool v2 = std::memcmp(magic, kMagicV2, sizeof(kMagic)) == 0;
  if (!v1 && !v2 && std::memcmp(magic, kMagic, sizeof(kMagic)) != 0) {
    return absl::DataLossError(absl::StrCat(path, " is not a pshard checkpoint (bad magic)"));
  }
  CheckpointHeader header;
  absl::StatusOr<uint32_t> layout_len = r.GetValue<uint32_t>();
  if (!layout_len.ok()) return layout_len.status();
  if (*layout_len > kMaxLayoutBytes) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path, " is damaged: layout description too long"));
  }
  header.layout.resize(*layout_len);
  if (absl::Status s = r.Get(header.layout.data(), *layout_len); !s.ok()) return s;
  for (int32_t* v : {&header.shard_index, &header.num_shards}) {
    absl::StatusOr<int32_t> got = r.GetValue<int32_t>();
    if (!got.ok()) return got.status();
    *v = *got;
  }
  std::vector<int64_t*> counts = {&header.step, &header.applied_updates, &header.skipped_steps};
  if (v1) {
    header.schedule_end = -1;
  } else {
    counts.push_back(&header.schedule_end);
  }
  for (int64_t* v : counts) {
    absl::StatusOr<int64_t> got = r.GetValue<int64_t>();
    if (!got.ok()) return got.status();
    *v = *got;
  }
  if (v1 || v2) return header;
  absl::StatusOr<uint64_t> json_len = r.GetValue<uint64_t>();
  if (!json_len.ok()) return json_len.status();
  std::error_code ec;
  const uint64_t file_bytes = std::filesystem::file_size(path, ec);
  if (*json_len > static_cast<uint64_t>(kMaxLayoutJsonBytes) || (!ec && *json_len > file_bytes)) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path, " is damaged: layout document too long"));
  }
  header.layout_json.resize(*json_len);
  if (absl::Status s = r.Get(header.layout_json.data(), *json_len); !s.ok()) return s;
  absl::StatusOr<int64_t> alignment = r.GetValue<int64_t>();
  if (!alignment.ok()) return alignment.status();
  header.slice_alignment = *alignment;
  return header;
}

}  // namespace

std::string CheckpointLayoutWords(const std::string& model, uint64_t layout_fingerprint, int num_shards,
                                  int64_t slice_alignment) {
  return absl::StrCat(model, " layout=", absl::StrFormat("0x%016x", layout_fingerprint), " shards=", num_shards,
                      " alignment=", slice_alignment);
}

std::string CheckpointFileName(int shard, int num_shards, int64_t step) {
  return absl::StrFormat("shard-%d-of-%d.step-%010d.ckpt", shard, num_shards, step);
}

std::vector<CheckpointFileEntry> ListCheckpointFiles(const std::string& dir) {
  std::vector<CheckpointFileEntry> files;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (!entry.is_regular_file()) continue;
    if (auto file = ParseName(entry.path().filename().string())) files.push_back(std::move(*file));
  }
  std::sort(files.begin(), files.end(), [](const CheckpointFileEntry& a, const CheckpointFileEntry& b) {
    return std::tie(a.num_shards, a.shard, a.step) < std::tie(b.num_shards, b.shard, b.step);
  });
  return files;
}

std::vector<int64_t> ListCheckpointSteps(const std::string& dir, int shard, int num_shards) {
  std::vector<int64_t> steps;
  for (const CheckpointFileEntry& file : ListCheckpointFiles(dir)) {
    if (file.shard == shard && file.num_shards == num_shards) steps.push_back(file.step);
  }
  return steps;
}

absl::Status CheckFolderLayout(const std::string& dir, int num_shards, const std::string& layout) {
  const std::vector<CheckpointFileEntry> files = ListCheckpointFiles(dir);
  // The newest file of each shard count speaks for its job.
  for (size_t i = 0; i < files.size(); ++i) {
    if (i + 1 < files.size() && files[i + 1].num_shards == files[i].num_shards) continue;
    const std::string path = (std::filesystem::path(dir) / files[i].name).string();
    absl::StatusOr<CheckpointHeader> header = ReadCheckpointHeader(path);
    if (!header.ok()) return header.status();
    if (files[i].num_shards == num_shards && header->layout == layout) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint folder ", dir, " holds checkpoints of another layout (", files[i].name, ": ", header->layout,
        "); this server runs ", layout,
        ". Use another --checkpoint_dir, `pshard reshard` to write that job's checkpoints for another shard "
        "count, or pass --start_fresh to move that folder's checkpoints into a subfolder (nothing is deleted) "
        "and start from step 0"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> SetAsideCheckpoints(const std::string& dir, int shard, int num_shards) {
  std::vector<CheckpointFileEntry> moved;
  for (CheckpointFileEntry& file : ListCheckpointFiles(dir)) {
    if (file.num_shards != num_shards || file.shard == shard) moved.push_back(std::move(file));
  }
  if (moved.empty()) return std::string();
  const std::string aside =
      (std::filesystem::path(dir) / absl::StrCat("set-aside-", absl::FormatTime("%Y%m%d-%H%M%S", absl::Now(),
                                                                                absl::UTCTimeZone())))
          .string();
  std::error_code ec;
  std::filesystem::create_directories(aside, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", aside, ": ", ec.message()));
  for (const CheckpointFileEntry& file : moved) {
    const std::filesystem::path from = std::filesystem::path(dir) / file.name;
    std::filesystem::rename(from, std::filesystem::path(aside) / file.name, ec);
    // Servers sharing the folder may set the same files aside at once.
    if (ec && std::filesystem::exists(from)) {
      return absl::InternalError(absl::StrCat("cannot move ", from.string(), " to ", aside, ": ", ec.message()));
    }
  }
  return aside;
}

absl::StatusOr<std::string> SetAsideDamagedCheckpoint(const std::string& path) {
  const std::filesystem::path from(path);
  const std::filesystem::path aside = from.parent_path() / "damaged";
  std::error_code ec;
  std::filesystem::create_directories(aside, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", aside.string(), ": ", ec.message()));
  std::filesystem::path to = aside / from.filename();
  if (std::filesystem::exists(to, ec)) {
    to += absl::StrCat(".", absl::FormatTime("%Y%m%d-%H%M%S", absl::Now(), absl::UTCTimeZone()));
  }
  std::filesystem::rename(from, to, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot move ", path, " to ", to.string(), ": ", ec.message()));
  return to.string();
}

absl::StatusOr<std::string> WriteCheckpoint(const std::string& dir, const CheckpointHeader& header,
                                            std::span<const CheckpointUnitView> units, int keep,
                                            int64_t protected_step) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create checkpoint folder ", dir, ": ", ec.message()));
  const std::string path =
      (std::filesystem::path(dir) / CheckpointFileName(header.shard_index, header.num_shards, header.step)).string();
  const std::string tmp = path + ".partial";
  {
    File f(std::fopen(tmp.c_str(), "wb"));
    if (!f) return ErrnoError("cannot create", tmp);
    Writer w(f.get(), tmp);
    absl::Status s = WriteAll(w, header, units);
    if (s.ok()) s = w.PutValue<uint32_t>(w.crc());
    if (s.ok() && std::fflush(f.get()) != 0) s = ErrnoError("cannot write", tmp);
    if (s.ok() && ::fsync(::fileno(f.get())) != 0) s = ErrnoError("cannot sync", tmp);
    if (!s.ok()) {
      f.reset();
      std::remove(tmp.c_str());
      return s;
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const absl::Status s = ErrnoError("cannot rename checkpoint to", path);
    std::remove(tmp.c_str());
    return s;
  }
  // Make the rename itself durable.
  if (const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY); fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
  PruneCheckpoints(dir, header.shard_index, header.num_shards, keep, {&protected_step, 1}, header.step);
  return path;
}

void PruneCheckpoints(const std::string& dir, int shard, int num_shards, int keep,
                      std::span<const int64_t> protected_steps, int64_t written_step) {
  std::error_code ec;
  std::vector<int64_t> steps = ListCheckpointSteps(dir, shard, num_shards);
  const int surplus = static_cast<int>(steps.size()) - std::max(keep, 1);
  for (int i = 0; i < surplus; ++i) {
    if (steps[i] == written_step || absl::c_linear_search(protected_steps, steps[i])) continue;
    std::filesystem::remove(std::filesystem::path(dir) / CheckpointFileName(shard, num_shards, steps[i]), ec);
  }
}

absl::StatusOr<std::string> WriteCheckpointFile(const std::string& dir, const Checkpoint& checkpoint) {
  std::vector<CheckpointUnitView> views;
  for (const CheckpointUnit& unit : checkpoint.units) views.push_back(CheckpointUnitView{unit.master, unit.m, unit.v});
  // No file is older than none: nothing is pruned.
  return WriteCheckpoint(dir, checkpoint.header, views, std::numeric_limits<int>::max());
}

absl::StatusOr<Checkpoint> ReadCheckpoint(const std::string& path) {
  File f(std::fopen(path.c_str(), "rb"));
  if (!f) return absl::NotFoundError(absl::StrCat("cannot open checkpoint ", path, ": ", std::strerror(errno)));
  Reader r(f.get(), path);
  Checkpoint out;
  out.path = path;
  ASSIGN_OR_RETURN(out.header, ReadHeader(r, path));
  auto corrupt = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path, " is damaged: ", what));
  };
  absl::StatusOr<int32_t> num_units = r.GetValue<int32_t>();
  if (!num_units.ok()) return num_units.status();
  if (*num_units < 0 || *num_units > kMaxUnits) return corrupt("unit count out of range");
  // Lengths are checked against the file size before allocating.
  std::error_code ec;
  const int64_t file_bytes = static_cast<int64_t>(std::filesystem::file_size(path, ec));
  out.units.resize(*num_units);
  for (CheckpointUnit& unit : out.units) {
    absl::StatusOr<int64_t> length = r.GetValue<int64_t>();
    if (!length.ok()) return length.status();
    if (*length < 0) return corrupt("negative slice length");
    if (*length > file_bytes / 12) {  // three fp32 parts; `*length * 12` could overflow
      return absl::DataLossError(absl::StrCat("checkpoint ", path, " is truncated: a unit declares ", *length,
                                              " elements, more than the file holds"));
    }
    for (std::vector<float>* part : {&unit.master, &unit.m, &unit.v}) {
      part->resize(*length);
      if (absl::Status s = r.Get(part->data(), part->size() * sizeof(float)); !s.ok()) return s;
    }
  }
  const uint32_t computed = r.crc();
  uint32_t stored = 0;
  if (std::fread(&stored, 1, sizeof(stored), f.get()) != sizeof(stored)) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path, " is truncated"));
  }
  if (stored != computed) return corrupt("CRC-32C mismatch");
  if (std::fgetc(f.get()) != EOF) return corrupt("trailing bytes after the checksum");
  return out;
}

absl::StatusOr<CheckpointHeader> ReadCheckpointHeader(const std::string& path) {
  File f(std::fopen(path.c_str(), "rb"));
  if (!f) return absl::NotFoundError(absl::StrCat("cannot open checkpoint ", path, ": ", std::strerror(errno)));
  Reader r(f.get(), path);
  return ReadHeader(r, path);
}

}  // namespace pshard
