// Weights out and checkpoints moved: `pshard export` from live servers and
// from checkpoint folders of any N gives the servers' master weights in a
// safetensors file that a reader sharing no code with pshard reads back;
// `pshard reshard` turns N shards' checkpoints into N' shards', and training
// resumed from them is bit-identical to training that never changed N; a
// damaged or foreign folder is refused and nothing is written.
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/bf16.h"
#include "common/layout_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "shard_server/checkpoint.h"
#include "shard_server/checkpoint_set.h"
#include "tests/testutil/cluster_training.h"
#include "tests/testutil/local_cluster.h"
#include "tests/testutil/reference_training.h"
#include "tests/testutil/tiny_job.h"
#include "tools/weights.h"
#include "trainer_client/model/gpt_spec.h"

namespace pshard::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr int64_t kTotalSteps = 6;

std::string FreshDir(const std::string& name) {
  const fs::path dir = fs::path(::testing::TempDir()) / absl::StrCat("pshard_weights_", name, "_", ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Trains `job` (2 trainers) to `steps` with checkpoints in `dir`, which the
// shutdown completes at `steps`; returns the master weights there.
std::vector<std::vector<float>> TrainWithCheckpoints(const JobConfig& job, const std::string& dir, int64_t steps) {
  LocalCluster::Options options;
  options.checkpoint_dir = dir;
  auto cluster = LocalCluster::Start(job, options);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  if (!cluster.ok()) return {};
  EXPECT_TRUE(TrainTinySteps(**cluster, 2, 0, steps).ok());
  absl::StatusOr<std::vector<std::vector<float>>> weights = (*cluster)->ReadMasterWeights(steps);
  EXPECT_TRUE(weights.ok()) << weights.status();
  return weights.ok() ? *weights : std::vector<std::vector<float>>();
}

// A reader that shares no code with pshard (Python's json and struct):
// prints the metadata, then a line per tensor (name, dtype, shape, offsets)
// in the order of the data, and writes the data section to argv[2].
constexpr char kReader[] = R"PY(
import json, struct, sys
raw = open(sys.argv[1], "rb").read()
(n,) = struct.unpack("<Q", raw[:8])
header = json.loads(raw[8:8 + n])
open(sys.argv[2], "wb").write(raw[8 + n:])
meta = header.pop("__metadata__")
print("meta", json.dumps({k: meta[k] for k in ("layout_fingerprint", "model", "step")}, sort_keys=True))
print("keys", " ".join(sorted(meta)))
print("layout", json.loads(meta["layout"])["model"], len(json.loads(meta["layout"])["units"]))
for name, t in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
    b, e = t["data_offsets"]
    print(name, t["dtype"], "x".join(map(str, t["shape"])), b, e)
)PY";

struct ReadBack {
  std::string meta;    // step, layout_fingerprint and model
  std::string keys;    // every metadata key, sorted
  std::string layout;  // the "layout" document's model words and unit count
  struct Tensor {
    std::string name, dtype, shape;
    size_t begin = 0, end = 0;
  };
  std::vector<Tensor> tensors;
  std::string data;
};

ReadBack ReadIndependently(const std::string& path) {
  const std::string script = path + ".reader.py";
  const std::string data = path + ".data";
  std::ofstream(script) << kReader;
  ReadBack out;
  FILE* p = popen(absl::StrCat("/usr/bin/python3 ", script, " ", path, " ", data, " 2>&1").c_str(), "r");
  EXPECT_NE(p, nullptr);
  if (p == nullptr) return out;
  std::string text;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, p)) text.append(buf, n);
  EXPECT_EQ(pclose(p), 0) << text;
  for (const std::string& line : std::vector<std::string>(absl::StrSplit(text, '\n', absl::SkipEmpty()))) {
    if (line.rfind("meta ", 0) == 0) {
      out.meta = line.substr(5);
      continue;
    }
    if (line.rfind("keys ", 0) == 0) {
      out.keys = line.substr(5);
      continue;
    }
    if (line.rfind("layout ", 0) == 0) {
      out.layout = line.substr(7);
      continue;
    }
    std::vector<std::string> f = absl::StrSplit(line, ' ');
    EXPECT_EQ(f.size(), 5u) << line;
    if (f.size() == 5) out.tensors.push_back({f[0], f[1], f[2], std::stoul(f[3]), std::stoul(f[4])});
  }
  out.data = ReadBytes(data);
  return out;
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::vector<std::string> dims;
  for (int64_t d : shape) dims.push_back(absl::StrCat(d));
  return absl::StrJoin(dims, "x");
}

// The file holds every tensor of the layout, in order, with the masters'
// bytes (bf16: rounded).
void ExpectFileHolds(const std::string& path, const ModelSpec& layout, const std::vector<std::vector<float>>& masters,
                     int64_t step, bool bf16) {
  const ReadBack got = ReadIndependently(path);
  EXPECT_EQ(got.meta, absl::StrCat("{\"layout_fingerprint\": \"", FingerprintHex(LayoutFingerprint(layout)),
                                   "\", \"model\": \"", layout.model, "\", \"step\": \"", step, "\"}"));
  // The layout itself, and (a GPT's) the architecture and sizes, docs/gpt.md.
  EXPECT_EQ(got.keys, "architecture gpt.context gpt.d_model gpt.heads gpt.layer_norm_eps gpt.layers gpt.vocab layout "
                      "layout_fingerprint model step");
  EXPECT_EQ(got.layout, absl::StrCat(layout.model, " ", layout.units.size()));
  ASSERT_EQ(static_cast<int>(got.tensors.size()), layout.num_tensors());
  size_t k = 0;
  for (size_t u = 0; u < layout.units.size(); ++u) {
    for (const TensorSpec& t : layout.units[u].tensors) {
      const ReadBack::Tensor& r = got.tensors[k++];
      EXPECT_EQ(r.name, t.name);
      EXPECT_EQ(r.dtype, bf16 ? "BF16" : "F32") << t.name;
      EXPECT_EQ(r.shape, ShapeText(t.shape)) << t.name;
      std::string want;
      for (int64_t i = 0; i < t.numel; ++i) {
        const float x = masters[u][t.offset + i];
        if (bf16) {
          const uint16_t h = FloatToBf16(x);
          want.append(reinterpret_cast<const char*>(&h), 2);
        } else {
          want.append(reinterpret_cast<const char*>(&x), 4);
        }
      }
      ASSERT_LE(r.end, got.data.size()) << t.name;
      EXPECT_TRUE(got.data.substr(r.begin, r.end - r.begin) == want) << t.name << ": bytes differ";
    }
  }
}

TEST(ExportTest, AnIndependentReaderSeesTheServersMasterWeightsLiveAndFromCheckpoints) {
  const JobConfig job = TinyGptJob(3, 2, kTotalSteps);
  const std::string dir = FreshDir("export");
  LocalCluster::Options options;
  options.checkpoint_dir = dir;
  std::vector<std::vector<float>> masters;
  {
    auto cluster = LocalCluster::Start(job, options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    ASSERT_TRUE(TrainTinySteps(**cluster, 2, 0, 3).ok());
    absl::StatusOr<std::vector<std::vector<float>>> read = (*cluster)->ReadMasterWeights(3);
    ASSERT_TRUE(read.ok()) << read.status();
    masters = *read;
    // Live, from any one server: it finds the others.
    absl::StatusOr<JobWeights> live = WeightsFromServers((*cluster)->addresses()[1], nullptr, absl::Seconds(30));
    ASSERT_TRUE(live.ok()) << live.status();
    EXPECT_EQ(live->step, 3);
    ASSERT_TRUE(WriteWeightsFile(*live, SafetensorsDtype::kF32, dir + "/live.safetensors").ok());
    ASSERT_TRUE(WriteWeightsFile(*live, SafetensorsDtype::kBF16, dir + "/live-bf16.safetensors").ok());
  }  // the shutdown writes the checkpoint of step 3
  ASSERT_NO_FATAL_FAILURE(ExpectFileHolds(dir + "/live.safetensors", job.model, masters, 3, false));
  ASSERT_NO_FATAL_FAILURE(ExpectFileHolds(dir + "/live-bf16.safetensors", job.model, masters, 3, true));
  absl::StatusOr<JobWeights> offline = WeightsFromCheckpoints(dir);
  ASSERT_TRUE(offline.ok()) << offline.status();
  ASSERT_TRUE(WriteWeightsFile(*offline, SafetensorsDtype::kF32, dir + "/offline.safetensors").ok());
  EXPECT_EQ(ReadBytes(dir + "/offline.safetensors"), ReadBytes(dir + "/live.safetensors"));
}

TEST(ExportTest, CheckpointsOfThreeAndFiveShardsOfTheSameJobExportTheSameFile) {
  std::vector<std::string> files;
  for (int shards : {3, 5}) {
    const std::string dir = FreshDir(absl::StrCat("export_n", shards));
    ASSERT_FALSE(TrainWithCheckpoints(TinyGptJob(shards, 2, kTotalSteps), dir, 4).empty());
    absl::StatusOr<JobWeights> weights = WeightsFromCheckpoints(dir);
    ASSERT_TRUE(weights.ok()) << weights.status();
    files.push_back(dir + "/model.safetensors");
    ASSERT_TRUE(WriteWeightsFile(*weights, SafetensorsDtype::kF32, files.back()).ok());
  }
  const std::string a = ReadBytes(files[0]), b = ReadBytes(files[1]);
  EXPECT_GT(a.size(), 50000u);  // 15k parameters in fp32
  EXPECT_TRUE(a == b) << "the exports of N = 3 and N = 5 differ";
}

TEST(ReshardTest, TrainingResumedOnAnotherNIsBitIdenticalToAnUnchangedRun) {
  const std::string from = FreshDir("reshard_from");
  ASSERT_FALSE(TrainWithCheckpoints(TinyGptJob(3, 2, kTotalSteps), from, 3).empty());
  absl::StatusOr<std::vector<std::vector<float>>> unchanged =
      TrainReference(TinyGptJob(3, 2, kTotalSteps), WireEncoding::kFp32, TinyTrainerOptions(7), TestCorpus(),
                     kTotalSteps);
  ASSERT_TRUE(unchanged.ok()) << unchanged.status();
  for (int shards : {2, 5}) {
    SCOPED_TRACE(absl::StrCat("N' = ", shards));
    const std::string to = FreshDir(absl::StrCat("reshard_to", shards)) + "/checkpoints";
    ASSERT_TRUE(ReshardCheckpoints(from, 0, -1, to, shards).ok());
    ASSERT_EQ(ListCheckpointFiles(to).size(), static_cast<size_t>(shards));
    LocalCluster::Options options;
    options.checkpoint_dir = to;
    auto cluster = LocalCluster::Start(TinyGptJob(shards, 2, kTotalSteps), options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    for (int s = 0; s < shards; ++s) EXPECT_EQ((*cluster)->server(s).state().current_step(), 3);
    ASSERT_TRUE(TrainTinySteps(**cluster, 2, 3, kTotalSteps).ok());
    absl::StatusOr<std::vector<std::vector<float>>> got = (*cluster)->ReadMasterWeights(kTotalSteps);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(BitIdentical(*got, *unchanged));
  }
}

class ReshardRefusalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    from_ = FreshDir("refuse_from");
    ASSERT_FALSE(TrainWithCheckpoints(TinyGptJob(3, 2, kTotalSteps), from_, 2).empty());
    to_ = FreshDir("refuse_to") + "/new";
  }
  // Reshards `from_` and expects `code` with `text`, and nothing written.
  void ExpectRefused(absl::StatusCode code, const std::string& text, int from_shards = 0) {
    const absl::Status s = ReshardCheckpoints(from_, from_shards, -1, to_, 2);
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_THAT(s.message(), HasSubstr(text));
    EXPECT_FALSE(fs::exists(to_));
    for (const auto& entry : fs::directory_iterator(fs::path(to_).parent_path())) {
      ADD_FAILURE() << "left behind: " << entry.path();
    }
  }
  std::string File(int shard, int n = 3, int64_t step = 2) { return from_ + "/" + CheckpointFileName(shard, n, step); }

  std::string from_, to_;
};

TEST_F(ReshardRefusalTest, ADamagedFile) {
  std::string bytes = ReadBytes(File(1));
  bytes[bytes.size() / 2] ^= 0x20;
  std::ofstream(File(1), std::ios::binary | std::ios::trunc) << bytes;
  ExpectRefused(absl::StatusCode::kDataLoss, "CRC-32C");
}

TEST_F(ReshardRefusalTest, AMissingShard) {
  fs::remove(File(2));
  ExpectRefused(absl::StatusCode::kFailedPrecondition, CheckpointFileName(2, 3, 2));
}

TEST_F(ReshardRefusalTest, AShardOfAnotherJob) {
  JobConfig other = TinyGptJob(3, 2, kTotalSteps);
  other.model = MakeGptSpec(GptConfig{.num_layers = 3, .d_model = 16, .num_heads = 2, .context = 8, .vocab = 256})
                    .value();
  const std::string elsewhere = FreshDir("refuse_other");
  ASSERT_FALSE(TrainWithCheckpoints(other, elsewhere, 2).empty());
  fs::copy_file(elsewhere + "/" + CheckpointFileName(1, 3, 2), File(1), fs::copy_options::overwrite_existing);
  ExpectRefused(absl::StatusCode::kFailedPrecondition, "another job's layout");
}

TEST_F(ReshardRefusalTest, AFileThatDoesNotRecordItsLayout) {
  absl::StatusOr<Checkpoint> c = ReadCheckpoint(File(0));
  ASSERT_TRUE(c.ok());
  c->header.layout_json.clear();
  fs::remove(File(0));
  ASSERT_TRUE(WriteCheckpointFile(from_, *c).ok());
  ExpectRefused(absl::StatusCode::kFailedPrecondition, "did not record the layout");
}

TEST_F(ReshardRefusalTest, AFolderOfTwoShardCountsWithoutSayingWhich) {
  ASSERT_TRUE(ReshardCheckpoints(from_, 0, -1, from_ + "/../four", 4).ok());
  for (const auto& entry : fs::directory_iterator(from_ + "/../four")) {
    fs::copy_file(entry.path(), from_ + "/" + entry.path().filename().string());
  }
  fs::remove_all(from_ + "/../four");
  ExpectRefused(absl::StatusCode::kFailedPrecondition, "3, 4 shards: say which");
  EXPECT_TRUE(ReshardCheckpoints(from_, 4, -1, to_, 2).ok());
}

TEST_F(ReshardRefusalTest, NoCheckpointsOrAFullDestination) {
  EXPECT_EQ(ReshardCheckpoints(FreshDir("refuse_empty"), 0, -1, to_, 2).code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(fs::exists(to_));
  fs::create_directories(to_);
  std::ofstream(to_ + "/notes.txt") << "mine";
  const absl::Status s = ReshardCheckpoints(from_, 0, -1, to_, 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("not an empty folder"));
  EXPECT_EQ(ReadBytes(to_ + "/notes.txt"), "mine");
}

}  // namespace
}  // namespace pshard::testing
