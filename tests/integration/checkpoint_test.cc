// Shard checkpoints: the file round-trips and refuses damage; a job stopped
// and restarted from its checkpoints ends bit-identical to one that never
// stopped; restoring onto a different model, a missing step or shards at
// different steps fails with an error that says so.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/optimizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "shard_server/checkpoint.h"
#include "tests/testutil/cluster_training.h"
#include "tests/testutil/local_cluster.h"
#include "tests/testutil/reference_training.h"
#include "tests/testutil/tiny_job.h"

namespace pshard::testing {
namespace {

using ::testing::HasSubstr;

std::string FreshDir(const std::string& name) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) /
                                    absl::StrCat("pshard_ckpt_", name, "_", ::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

std::vector<char> ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}

void WriteBytes(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), bytes.size());
}

TEST(CheckpointFile, RoundTripsExactly) {
  const std::string dir = FreshDir("roundtrip");
  std::vector<float> a = {1.5f, -2.25f, 3e-20f}, am = {0.1f, 0.2f, 0.3f}, av = {1e-8f, 2e-8f, 3e-8f};
  std::vector<float> b = {7.0f}, bm = {0.5f}, bv = {0.25f};
  const CheckpointUnitView views[] = {{a, am, av}, {b, bm, bv}};
  CheckpointHeader header{"layers=1 d_model=2", 1, 3, 42, 40, 2};
  absl::StatusOr<std::string> path = WriteCheckpoint(dir, header, views, 2);
  ASSERT_TRUE(path.ok()) << path.status();
  EXPECT_EQ(std::filesystem::path(*path).filename(), CheckpointFileName(1, 3, 42));
  absl::StatusOr<Checkpoint> read = ReadCheckpoint(*path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->header.layout, header.layout);
  EXPECT_EQ(read->header.shard_index, 1);
  EXPECT_EQ(read->header.num_shards, 3);
  EXPECT_EQ(read->header.step, 42);
  EXPECT_EQ(read->header.applied_updates, 40);
  EXPECT_EQ(read->header.skipped_steps, 2);
  ASSERT_EQ(read->units.size(), 2u);
  EXPECT_EQ(read->units[0].master, a);
  EXPECT_EQ(read->units[0].m, am);
  EXPECT_EQ(read->units[0].v, av);
  EXPECT_EQ(read->units[1].master, b);
  EXPECT_EQ(read->units[1].v, bv);
  // No partial file is left behind.
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    ++files;
    EXPECT_THAT(entry.path().filename().string(), ::testing::EndsWith(".ckpt"));
  }
  EXPECT_EQ(files, 1);
}

TEST(CheckpointFile, KeepsOnlyTheNewest) {
  const std::string dir = FreshDir("keep");
  std::vector<float> w = {1.0f};
  const CheckpointUnitView views[] = {{w, w, w}};
  for (int64_t step : {2, 4, 6, 8}) {
    ASSERT_TRUE(WriteCheckpoint(dir, CheckpointHeader{"x", 0, 2, step, step, 0}, views, 2).ok());
  }
  // Another shard's files are not this shard's to remove.
  ASSERT_TRUE(WriteCheckpoint(dir, CheckpointHeader{"x", 1, 2, 2, 2, 0}, views, 2).ok());
  EXPECT_EQ(ListCheckpointSteps(dir, 0, 2), (std::vector<int64_t>{6, 8}));
  EXPECT_EQ(ListCheckpointSteps(dir, 1, 2), (std::vector<int64_t>{2}));
  EXPECT_TRUE(ListCheckpointSteps(dir + "/absent", 0, 2).empty());
}

TEST(CheckpointFile, RetentionKeepsTheNewestCommonStep) {
  const std::string dir = FreshDir("protected");
  std::vector<float> w = {1.0f};
  const CheckpointUnitView views[] = {{w, w, w}};
  ASSERT_TRUE(WriteCheckpoint(dir, CheckpointHeader{"x", 0, 2, 4, 4, 0}, views, 1).ok());
  // Step 4 is the newest step every shard holds: writing 6 and 7 keeps it.
  ASSERT_TRUE(WriteCheckpoint(dir, CheckpointHeader{"x", 0, 2, 6, 6, 0}, views, 1, /*protected_step=*/4).ok());
  ASSERT_TRUE(WriteCheckpoint(dir, CheckpointHeader{"x", 0, 2, 7, 7, 0}, views, 1, /*protected_step=*/4).ok());
  EXPECT_EQ(ListCheckpointSteps(dir, 0, 2), (std::vector<int64_t>{4, 7}));
  // Once 7 is common, 4 goes.
  ASSERT_TRUE(WriteCheckpoint(dir, CheckpointHeader{"x", 0, 2, 8, 8, 0}, views, 1, /*protected_step=*/7).ok());
  EXPECT_EQ(ListCheckpointSteps(dir, 0, 2), (std::vector<int64_t>{7, 8}));
}

TEST(CheckpointFile, FolderListingFindsEveryShardCountAndIgnoresOtherFiles) {
  const std::string dir = FreshDir("listing");
  std::vector<float> w = {1.0f};
  const CheckpointUnitView views[] = {{w, w, w}};
  ASSERT_TRUE(WriteCheckpoint(dir, CheckpointHeader{"x", 2, 3, 5, 5, 0}, views, 2).ok());
  ASSERT_TRUE(WriteCheckpoint(dir, CheckpointHeader{"x", 0, 4, 9, 9, 0}, views, 2).ok());
  for (const char* junk : {"notes.txt", "shard-1-of-x.step-3.ckpt", "shard-1-of-2.step-.ckpt",
                           "shard-0-of-4.step-0000000009.ckpt.partial"}) {
    WriteBytes((std::filesystem::path(dir) / junk).string(), {'x'});
  }
  const std::vector<CheckpointFileEntry> files = ListCheckpointFiles(dir);
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files[0].name, CheckpointFileName(2, 3, 5));
  EXPECT_EQ(files[0].shard, 2);
  EXPECT_EQ(files[0].num_shards, 3);
  EXPECT_EQ(files[0].step, 5);
  EXPECT_EQ(files[1].name, CheckpointFileName(0, 4, 9));
  absl::StatusOr<CheckpointHeader> header =
      ReadCheckpointHeader((std::filesystem::path(dir) / files[1].name).string());
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(header->step, 9);
  EXPECT_EQ(header->num_shards, 4);
}

TEST(CheckpointFile, DamageIsDetected) {
  const std::string dir = FreshDir("damage");
  std::vector<float> w(1000, 0.5f);
  const CheckpointUnitView views[] = {{w, w, w}};
  absl::StatusOr<std::string> path = WriteCheckpoint(dir, CheckpointHeader{"x", 0, 1, 3, 3, 0}, views, 2);
  ASSERT_TRUE(path.ok()) << path.status();
  const std::vector<char> good = ReadBytes(*path);

  std::vector<char> flipped = good;
  flipped[flipped.size() / 2] ^= 0x10;
  WriteBytes(*path, flipped);
  absl::StatusOr<Checkpoint> read = ReadCheckpoint(*path);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(read.status().message(), HasSubstr("CRC-32C"));

  WriteBytes(*path, std::vector<char>(good.begin(), good.end() - 100));
  read = ReadCheckpoint(*path);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(read.status().message(), HasSubstr("truncated"));

  WriteBytes(*path, std::vector<char>{'n', 'o', 'p', 'e', 0, 0, 0, 0, 0, 0, 0, 0});
  EXPECT_THAT(ReadCheckpoint(*path).status().message(), HasSubstr("not a pshard checkpoint"));
  EXPECT_EQ(ReadCheckpoint(dir + "/missing.ckpt").status().code(), absl::StatusCode::kNotFound);
}

// Found by fuzz/checkpoint_fuzzer (fuzz/corpus/checkpoint/crash_unit_length_overflow):
// a 56-byte format-1 file (no layout, counts of noise, 67 units) whose first
// unit declares 3836314062354473324 elements, twelve times which overflowed
// int64 in the check against the file's size. With 2^62 + 1 elements the
// product wrapped to 12, and the check let a 2^62-element allocation through.
TEST(CheckpointFile, AnAbsurdUnitLengthIsTruncationNotOverflow) {
  const std::string dir = FreshDir("absurd_length");
  const std::string path = dir + "/fuzzed.ckpt";
  constexpr char kFuzzed[] =
      "PSHDCKP1\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x31\x43\x00\x00\x00\x6c\x61\x79\x65\x50\x53\x3d"
      "\x35\x35\x00\x00\x00\x43\x3d\x8d\x00\x4b\x50\x31\x43\x00\x00\x00\x6c\x61\x79\x65\x50\x53\x3d\x35";
  std::vector<char> fuzzed(kFuzzed, kFuzzed + sizeof(kFuzzed) - 1);
  WriteBytes(path, fuzzed);
  absl::StatusOr<Checkpoint> read = ReadCheckpoint(path);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(read.status().message(), HasSubstr("a unit declares 3836314062354473324 elements"));

  const int64_t wraps = (int64_t{1} << 62) + 1;  // the unit's length is the file's last 8 bytes
  std::memcpy(fuzzed.data() + fuzzed.size() - sizeof(wraps), &wraps, sizeof(wraps));
  WriteBytes(path, fuzzed);
  read = ReadCheckpoint(path);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(read.status().message(), HasSubstr("a unit declares 4611686018427387905 elements"));
}

constexpr int64_t kTotalSteps = 7;

LocalCluster::Options WithCheckpoints(const std::string& dir, int64_t every, int64_t resume_step = -1) {
  LocalCluster::Options options;
  options.checkpoint_dir = dir;
  options.checkpoint_every = every;
  options.resume_step = resume_step;
  return options;
}

// Trains `job` with one trainer to `steps`, checkpointing into `dir` every
// `every` steps, and stops (the shutdown checkpoint is written too).
void TrainAndStop(const JobConfig& job, const std::string& dir, int64_t every, int64_t steps) {
  auto cluster = LocalCluster::Start(job, WithCheckpoints(dir, every));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ASSERT_TRUE(TrainTinySteps(**cluster, 1, 0, steps).ok());
  ASSERT_TRUE((*cluster)->ReadMasterWeights(steps).ok());
}

TEST(CheckpointResume, StoppedAndResumedTrainingEqualsUninterruptedBitForBit) {
  const JobConfig job = TinyGptJob(3, 2, kTotalSteps);
  const std::string dir = FreshDir("resume");
  {
    auto cluster = LocalCluster::Start(job, WithCheckpoints(dir, 2));
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    ASSERT_TRUE(TrainTinySteps(**cluster, 2, 0, 5).ok());
    ASSERT_TRUE((*cluster)->ReadMasterWeights(5).ok());  // step 4 applied everywhere
  }  // shutdown writes step 5 on top of the periodic 2 and 4; two are kept, and the
     // two newest steps every shard was known to hold (2 and 4: no agreement
     // followed the shutdown checkpoint)
  for (int s = 0; s < 3; ++s) EXPECT_EQ(ListCheckpointSteps(dir, s, 3), (std::vector<int64_t>{2, 4, 5})) << s;

  auto resumed = LocalCluster::Start(job, WithCheckpoints(dir, 2));
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ((*resumed)->server(s).state().current_step(), 5);
    EXPECT_THAT((*resumed)->server(s).restored_from(), HasSubstr(CheckpointFileName(s, 3, 5)));
  }
  auto client = (*resumed)->Connect(0, WireEncoding::kFp32);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ((*client)->joined_step(), 5);
  client->reset();
  absl::Status trained = TrainTinySteps(**resumed, 2, 5, kTotalSteps);
  ASSERT_TRUE(trained.ok()) << trained;
  auto got = (*resumed)->ReadMasterWeights(kTotalSteps);
  ASSERT_TRUE(got.ok()) << got.status();

  auto want = TrainReference(job, WireEncoding::kFp32, TinyTrainerOptions(7), TestCorpus(), kTotalSteps);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_TRUE(BitIdentical(*got, *want));
}

TEST(CheckpointResume, AnOlderStepCanBeChosen) {
  const JobConfig job = TinyGptJob(2, 1, kTotalSteps);
  const std::string dir = FreshDir("older");
  ASSERT_NO_FATAL_FAILURE(TrainAndStop(job, dir, /*every=*/1, /*steps=*/3));
  auto older = LocalCluster::Start(job, WithCheckpoints(dir, 1, /*resume_step=*/2));
  ASSERT_TRUE(older.ok()) << older.status();
  EXPECT_EQ((*older)->server(0).state().current_step(), 2);
  EXPECT_EQ((*older)->server(1).state().current_step(), 2);
  older->reset();

  auto missing = LocalCluster::Start(job, WithCheckpoints(dir, 1, /*resume_step=*/1));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("no checkpoint of step 1"));
  EXPECT_THAT(missing.status().message(), HasSubstr("2, 3"));
}

TEST(CheckpointResume, ADifferentModelIsRefusedAndTheFilesStay) {
  const JobConfig job = TinyGptJob(2, 1, kTotalSteps);
  const std::string dir = FreshDir("layout");
  ASSERT_NO_FATAL_FAILURE(TrainAndStop(job, dir, /*every=*/1, /*steps=*/2));
  const std::string file = (std::filesystem::path(dir) / CheckpointFileName(0, 2, 2)).string();
  const std::vector<char> before = ReadBytes(file);
  JobConfig wider = job;
  wider.model = MakeGptSpec(GptConfig{.num_layers = 2, .d_model = 32, .num_heads = 2, .context = 8, .vocab = 256})
                    .value();
  auto refused = LocalCluster::Start(wider, WithCheckpoints(dir, 1));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("d_model=16"));
  EXPECT_THAT(refused.status().message(), HasSubstr("d_model=32"));
  EXPECT_EQ(ReadBytes(file), before);

  // A damaged newest checkpoint is set aside, named, and the one before it
  // restored; nothing is deleted.
  std::vector<char> damaged = before;
  damaged[damaged.size() - 8] ^= 0x01;
  WriteBytes(file, damaged);
  {
    auto fell_back = LocalCluster::Start(job, WithCheckpoints(dir, 1));
    ASSERT_TRUE(fell_back.ok()) << fell_back.status();
    EXPECT_EQ((*fell_back)->server(0).state().current_step(), 1);
    EXPECT_THAT((*fell_back)->server(0).restored_from(), HasSubstr(CheckpointFileName(0, 2, 1)));
    const std::string aside = (std::filesystem::path(dir) / "damaged" / CheckpointFileName(0, 2, 2)).string();
    ASSERT_EQ((*fell_back)->server(0).start_notes().size(), 1u);
    EXPECT_THAT((*fell_back)->server(0).start_notes()[0], HasSubstr(file));
    EXPECT_THAT((*fell_back)->server(0).start_notes()[0], HasSubstr("set aside as " + aside));
    EXPECT_EQ(ReadBytes(aside), damaged);
    EXPECT_EQ((*fell_back)->server(1).state().current_step(), 2);  // its own files are intact
  }

  // With every file of a shard damaged there is nothing to resume from: refused.
  for (int64_t step : ListCheckpointSteps(dir, 0, 2)) {
    const std::string path = (std::filesystem::path(dir) / CheckpointFileName(0, 2, step)).string();
    std::vector<char> bytes = ReadBytes(path);
    bytes[bytes.size() - 8] ^= 0x01;
    WriteBytes(path, bytes);
  }
  auto refused_damaged = LocalCluster::Start(job, WithCheckpoints(dir, 1));
  ASSERT_FALSE(refused_damaged.ok());
  EXPECT_EQ(refused_damaged.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(refused_damaged.status().message(), HasSubstr("every checkpoint of shard 0"));
  EXPECT_THAT(refused_damaged.status().message(), HasSubstr("--start_fresh"));
}

// The probe's case: a shard's newest checkpoint is damaged after it was
// written (and reported), the shard crashes, and the survivor's shutdown
// checkpoint comes on top. Retention keeps the common step before the
// newest, the damaged shard falls back to it, the other rolls back to it,
// and the job ends bit-identical, even with --checkpoint_keep=1.
TEST(CheckpointResume, ADamagedNewestCheckpointFallsBackToTheCommonStepBeforeAndTheJobEndsBitIdentical) {
  const JobConfig job = TinyGptJob(2, 1, kTotalSteps);
  const std::string dir = FreshDir("damaged_newest");
  {
    LocalCluster::Options options = WithCheckpoints(dir, 1);
    options.checkpoint_keep = 1;
    auto cluster = LocalCluster::Start(job, options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    // A step at a time, with a pause: each checkpoint is on disk (and so in
    // the next step's norm report) before the next step.
    for (int64_t step = 0; step < 5; ++step) {
      ASSERT_TRUE(TrainTinySteps(**cluster, 1, step, step + 1).ok());
      ASSERT_TRUE((*cluster)->ReadMasterWeights(step + 1).ok());
      absl::SleepFor(absl::Milliseconds(300));
    }
  }
  // Shard 1 "crashed" before its checkpoint of step 5; its step 4 is damaged.
  std::filesystem::remove(std::filesystem::path(dir) / CheckpointFileName(1, 2, 5));
  const std::string damaged = (std::filesystem::path(dir) / CheckpointFileName(1, 2, 4)).string();
  std::vector<char> bytes = ReadBytes(damaged);
  bytes[bytes.size() / 2] ^= 0x10;
  WriteBytes(damaged, bytes);
  ASSERT_THAT(ListCheckpointSteps(dir, 0, 2), ::testing::Contains(3)) << "retention dropped the common step before";

  auto cluster = LocalCluster::Start(job, WithCheckpoints(dir, 1));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  EXPECT_EQ((*cluster)->server(0).state().current_step(), 5);
  EXPECT_EQ((*cluster)->server(1).state().current_step(), 3);
  EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(dir) / "damaged" / CheckpointFileName(1, 2, 4)));
  ShardClient::Options options;
  options.server_addresses = (*cluster)->addresses();
  options.trainer_rank = 0;
  options.encodings = WireEncodings(WireEncoding::kFp32);
  options.transport = "grpc";
  options.roll_back_to_common_step = true;
  {
    auto client = ShardClient::Connect(options);
    ASSERT_TRUE(client.ok()) << client.status();
    EXPECT_EQ((*client)->joined_step(), 3);
  }
  absl::Status trained = TrainTinySteps(**cluster, 1, 3, kTotalSteps);
  ASSERT_TRUE(trained.ok()) << trained;
  auto got = (*cluster)->ReadMasterWeights(kTotalSteps);
  ASSERT_TRUE(got.ok()) << got.status();
  auto want = TrainReference(job, WireEncoding::kFp32, TinyTrainerOptions(7), TestCorpus(), kTotalSteps);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_TRUE(BitIdentical(*got, *want));
}

// Waits up to 30 s for `server` to report a failure.
absl::Status FailureOf(ShardServer& server) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (server.failure().ok() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  return server.failure();
}

TEST(CheckpointFolder, AFolderDeletedWhileTheJobRunsStopsTheServerAndIsNotMadeAgain) {
  const JobConfig job = TinyGptJob(1, 1, kTotalSteps);
  const std::string dir = FreshDir("deleted");
  auto cluster = LocalCluster::Start(job, WithCheckpoints(dir, 1));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ASSERT_TRUE(TrainTinySteps(**cluster, 1, 0, 1).ok());
  ASSERT_TRUE((*cluster)->ReadMasterWeights(1).ok());
  EXPECT_TRUE((*cluster)->server(0).failure().ok());
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(TrainTinySteps(**cluster, 1, 1, 2).ok());
  const absl::Status failure = FailureOf((*cluster)->server(0));
  EXPECT_EQ(failure.code(), absl::StatusCode::kNotFound) << failure;
  EXPECT_THAT(failure.message(), HasSubstr("checkpoint of step 2"));
  EXPECT_THAT(failure.message(), HasSubstr("is gone"));
  EXPECT_FALSE(std::filesystem::exists(dir));
  EXPECT_THAT((*cluster)->server(0).registry().Serialize(),
              HasSubstr("pshard_server_checkpoint_failures_total{shard=\"0\"} 1"));
}

TEST(CheckpointFolder, AFailedWriteStopsTheServerUnlessTheJobChoseToContinue) {
  const JobConfig job = TinyGptJob(1, 1, kTotalSteps);
  for (const bool go_on : {false, true}) {
    SCOPED_TRACE(go_on ? "continue" : "stop");
    const std::string dir = FreshDir(go_on ? "write_fails_continue" : "write_fails_stop");
    // Where step 2's file is written first: a folder there makes the write fail.
    std::filesystem::create_directories(std::filesystem::path(dir) / (CheckpointFileName(0, 1, 2) + ".partial"));
    LocalCluster::Options options = WithCheckpoints(dir, 1);
    options.continue_on_checkpoint_failure = go_on;
    auto cluster = LocalCluster::Start(job, options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    ASSERT_TRUE(TrainTinySteps(**cluster, 1, 0, 3).ok());
    ASSERT_TRUE((*cluster)->ReadMasterWeights(3).ok());
    ShardServer& server = (*cluster)->server(0);
    const std::string metric = "pshard_server_checkpoint_failures_total{shard=\"0\"} 1";
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (server.registry().Serialize().find(metric) == std::string::npos && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    EXPECT_THAT(server.registry().Serialize(), HasSubstr(metric));
    if (go_on) {
      EXPECT_TRUE(server.failure().ok()) << server.failure();
    } else {
      EXPECT_THAT(server.failure().message(), HasSubstr("the checkpoint of step 2 could not be written"));
      EXPECT_THAT(server.failure().message(), HasSubstr(".partial"));
    }
    EXPECT_THAT(ListCheckpointSteps(dir, 0, 1), ::testing::Contains(1));
  }
}

TEST(CheckpointResume, ShardsAtDifferentStepsAreReportedToTrainers) {
  const JobConfig job = TinyGptJob(2, 1, kTotalSteps);
  const std::string dir = FreshDir("split");
  ASSERT_NO_FATAL_FAILURE(TrainAndStop(job, dir, /*every=*/1, /*steps=*/3));
  // Shard 1 loses its newest checkpoint.
  std::filesystem::remove(std::filesystem::path(dir) / CheckpointFileName(1, 2, 3));
  auto cluster = LocalCluster::Start(job, WithCheckpoints(dir, 1));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  EXPECT_EQ((*cluster)->server(0).state().current_step(), 3);
  EXPECT_EQ((*cluster)->server(1).state().current_step(), 2);
  auto client = (*cluster)->Connect(0, WireEncoding::kFp32);
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(client.status().message(), HasSubstr("different steps"));
  EXPECT_THAT(client.status().message(), HasSubstr("--resume_step"));
}

// A shard that restarts from an older checkpoint than the others hold (it
// died before writing its newest): a rejoining trainer has the shards ahead
// roll back to that step, and the steps redone from there give the weights
// of a job that never stopped, bit for bit.
TEST(CheckpointResume, ARejoiningTrainerRollsTheShardsAheadBackAndTheJobEndsBitIdentical) {
  const JobConfig job = TinyGptJob(2, 1, kTotalSteps);
  const std::string dir = FreshDir("rollback");
  ASSERT_NO_FATAL_FAILURE(TrainAndStop(job, dir, /*every=*/1, /*steps=*/3));
  std::filesystem::remove(std::filesystem::path(dir) / CheckpointFileName(1, 2, 3));
  auto cluster = LocalCluster::Start(job, WithCheckpoints(dir, 1));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ASSERT_EQ((*cluster)->server(0).state().current_step(), 3);
  ASSERT_EQ((*cluster)->server(1).state().current_step(), 2);

  // A step without a checkpoint (step 0, the seed's, is never written) is
  // refused, and nothing changes.
  absl::StatusOr<int64_t> refused = (*cluster)->server(0).RollBack(0, 0, (*cluster)->addresses());
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("cannot go back to step 0"));
  EXPECT_EQ((*cluster)->server(0).state().current_step(), 3);

  ShardClient::Options options;
  options.server_addresses = (*cluster)->addresses();
  options.trainer_rank = 0;
  options.encodings = WireEncodings(WireEncoding::kFp32);
  options.transport = "grpc";
  options.roll_back_to_common_step = true;
  {
    auto client = ShardClient::Connect(options);
    ASSERT_TRUE(client.ok()) << client.status();
    EXPECT_EQ((*client)->joined_step(), 2);
  }
  EXPECT_EQ((*cluster)->server(0).state().current_step(), 2);
  const std::string page = (*cluster)->server(0).registry().Serialize();
  EXPECT_THAT(page, HasSubstr("pshard_server_rollbacks_total{shard=\"0\"} 1"));
  EXPECT_THAT(page, HasSubstr("pshard_server_rolled_back_steps_total{shard=\"0\"} 1"));

  absl::Status trained = TrainTinySteps(**cluster, 1, 2, kTotalSteps);
  ASSERT_TRUE(trained.ok()) << trained;
  auto got = (*cluster)->ReadMasterWeights(kTotalSteps);
  ASSERT_TRUE(got.ok()) << got.status();
  auto want = TrainReference(job, WireEncoding::kFp32, TinyTrainerOptions(7), TestCorpus(), kTotalSteps);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_TRUE(BitIdentical(*got, *want));
}

// Names and modification times of everything under `dir`.
std::map<std::string, std::filesystem::file_time_type> FolderContents(const std::string& dir) {
  std::map<std::string, std::filesystem::file_time_type> out;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
    out[entry.path().lexically_relative(dir).string()] = entry.last_write_time();
  }
  return out;
}


TEST(CheckpointFolder, AnotherShardCountIsRefusedNamingBothLayoutsAndNothingIsWritten) {
  const std::string dir = FreshDir("other_n");
  ASSERT_NO_FATAL_FAILURE(TrainAndStop(TinyGptJob(3, 1, kTotalSteps), dir, /*every=*/1, /*steps=*/2));
  const auto before = FolderContents(dir);
  ASSERT_FALSE(before.empty());
  auto refused = LocalCluster::Start(TinyGptJob(4, 1, kTotalSteps), WithCheckpoints(dir, 1));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("holds checkpoints of another layout"));
  EXPECT_THAT(refused.status().message(), HasSubstr("shards=3"));
  EXPECT_THAT(refused.status().message(), HasSubstr("this server runs gpt layers=2"));
  EXPECT_THAT(refused.status().message(), HasSubstr("shards=4"));
  EXPECT_THAT(refused.status().message(), HasSubstr("another --checkpoint_dir"));
  EXPECT_THAT(refused.status().message(), HasSubstr("pshard reshard"));
  EXPECT_THAT(refused.status().message(), HasSubstr("--start_fresh"));
  EXPECT_EQ(FolderContents(dir), before);
}

TEST(CheckpointFolder, StartingFreshSetsTheOldCheckpointsAsideAndDeletesNothing) {
  const std::string dir = FreshDir("fresh");
  ASSERT_NO_FATAL_FAILURE(TrainAndStop(TinyGptJob(3, 1, kTotalSteps), dir, /*every=*/1, /*steps=*/2));
  const size_t old_files = ListCheckpointFiles(dir).size();
  ASSERT_EQ(old_files, 6u);  // steps 1 and 2 of three shards
  LocalCluster::Options options = WithCheckpoints(dir, 1);
  options.start_fresh = true;
  auto fresh = LocalCluster::Start(TinyGptJob(4, 1, kTotalSteps), options);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  for (int s = 0; s < 4; ++s) {
    EXPECT_EQ((*fresh)->server(s).state().current_step(), 0);
    EXPECT_TRUE((*fresh)->server(s).restored_from().empty());
  }
  EXPECT_THAT((*fresh)->server(0).start_notes().front(), HasSubstr("moved to " + dir + "/set-aside-"));
  EXPECT_TRUE(ListCheckpointFiles(dir).empty());
  size_t aside = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.is_directory()) aside += ListCheckpointFiles(entry.path().string()).size();
  }
  EXPECT_EQ(aside, old_files);
}

TEST(CheckpointResume, MovingTheScheduleEndIsRefusedUnlessAskedFor) {
  const JobConfig job = TinyGptJob(2, 1, kTotalSteps);
  const std::string dir = FreshDir("schedule");
  ASSERT_NO_FATAL_FAILURE(TrainAndStop(job, dir, /*every=*/1, /*steps=*/3));
  const auto before = FolderContents(dir);
  JobConfig longer = job;
  longer.optimizer.total_steps = 3 * kTotalSteps;
  auto refused = LocalCluster::Start(longer, WithCheckpoints(dir, 1));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr(absl::StrCat("whose learning-rate schedule ends at step ",
                                                                 kTotalSteps, ", this one's ends at step ",
                                                                 3 * kTotalSteps)));
  // It says how to train longer, both ways.
  EXPECT_THAT(refused.status().message(), HasSubstr(absl::StrCat("--schedule_steps=", kTotalSteps)));
  EXPECT_THAT(refused.status().message(), HasSubstr("--allow_schedule_change"));
  EXPECT_EQ(FolderContents(dir), before);

  LocalCluster::Options allow = WithCheckpoints(dir, 1);
  allow.allow_schedule_change = true;
  auto restretched = LocalCluster::Start(longer, allow);
  ASSERT_TRUE(restretched.ok()) << restretched.status();
  EXPECT_EQ((*restretched)->server(1).state().current_step(), 3);
  ASSERT_EQ((*restretched)->server(1).start_notes().size(), 1u);
  EXPECT_THAT((*restretched)->server(1).start_notes()[0], HasSubstr("schedule re-stretched"));
  EXPECT_THAT((*restretched)->server(1).start_notes()[0],
              HasSubstr(absl::StrFormat("the rate at step 3 is %.3g instead of %.3g",
                                        LearningRateAt(longer.optimizer, 3), LearningRateAt(job.optimizer, 3))));
}

}  // namespace
}  // namespace pshard::testing
