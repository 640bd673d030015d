// End to end: `pshard local` runs real server and trainer processes on
// loopback, trains, and shuts every process down — at the end and on Ctrl-C.
#include <signal.h>
#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pshard/config.h"
#include "tests/e2e/e2e_util.h"

namespace pshard {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(LocalClusterE2E, TrainsAndShutsDownCleanly) {
  const std::string run_dir = MakeRunDir();
  auto launcher = StartLocal(run_dir, {"--servers=3", "--trainers=2", "--steps=60", "--layers=2",
                                       "--d_model=64", "--heads=2", "--context=32", "--seq_len=32",
                                       "--log_every=10"});
  ASSERT_TRUE(launcher.ok()) << launcher.status();
  std::optional<int> code = launcher->WaitUntil(absl::Now() + absl::Minutes(5));
  const std::string out = ReadFile(run_dir + "/launcher.log");
  ASSERT_TRUE(code.has_value()) << "launcher still running after 5 minutes:\n" << out;
  EXPECT_EQ(*code, 0) << out;
  const std::vector<double> losses = Losses(out);
  ASSERT_EQ(losses.size(), 6u) << out;
  EXPECT_LT(losses.back(), losses.front() - 0.3) << out;
  EXPECT_NE(out.find("trainer 0 summary: 60 steps"), std::string::npos) << out;
  EXPECT_NE(out.find("unigram entropy"), std::string::npos) << out;
  EXPECT_NE(out.find("3 shard servers shut down cleanly"), std::string::npos) << out;
  // Every trainer's output is in the run folder; trainer 0's was also shown.
  EXPECT_NE(ReadFile(run_dir + "/trainer0.log").find("trainer 0 summary: 60 steps"), std::string::npos);
  EXPECT_NE(ReadFile(run_dir + "/trainer1.log").find("pshard-trainer 1: metrics on"), std::string::npos);
  for (int s = 0; s < 3; ++s) {
    EXPECT_NE(ReadFile(absl::StrCat(run_dir, "/server", s, ".log")).find("shutting down at step 60"),
              std::string::npos);
  }
  EXPECT_EQ(CountProcessesMentioning(run_dir), 0);
}

TEST(LocalClusterE2E, CtrlCStopsEveryProcess) {
  const std::string run_dir = MakeRunDir();
  auto launcher = StartLocal(run_dir, {"--servers=2", "--trainers=2", "--steps=100000", "--layers=1",
                                       "--d_model=32", "--heads=2", "--context=16", "--seq_len=16",
                                       "--log_every=1"});
  ASSERT_TRUE(launcher.ok()) << launcher.status();
  // Interrupt once training is under way.
  const absl::Time deadline = absl::Now() + absl::Minutes(2);
  while (Losses(ReadFile(run_dir + "/launcher.log")).size() < 3 && absl::Now() < deadline) {
    ASSERT_FALSE(launcher->Poll().has_value()) << ReadFile(run_dir + "/launcher.log");
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_GE(CountProcessesMentioning(run_dir), 3);  // launcher + servers (+ trainers)
  launcher->Signal(SIGINT);
  std::optional<int> code = launcher->WaitUntil(absl::Now() + absl::Seconds(60));
  const std::string out = ReadFile(run_dir + "/launcher.log");
  ASSERT_TRUE(code.has_value()) << "launcher did not stop within 60 s of SIGINT:\n" << out;
  EXPECT_EQ(*code, 130) << out;
  EXPECT_NE(out.find("interrupted"), std::string::npos) << out;
  EXPECT_EQ(CountProcessesMentioning(run_dir), 0) << "processes left behind";
}

// A launcher killed outright cannot stop its children in order: they stop
// on their own when it dies (its children are in process groups of their own,
// so nothing else would reach them).
TEST(LocalClusterE2E, ASigkilledLauncherTakesItsChildrenWithIt) {
  const std::string run_dir = MakeRunDir();
  auto launcher = StartLocal(run_dir, {"--servers=2", "--trainers=2", "--steps=100000", "--layers=1",
                                       "--d_model=32", "--heads=2", "--context=16", "--seq_len=16",
                                       "--log_every=1"});
  ASSERT_TRUE(launcher.ok()) << launcher.status();
  const absl::Time deadline = absl::Now() + absl::Minutes(2);
  while (Losses(ReadFile(run_dir + "/launcher.log")).size() < 3 && absl::Now() < deadline) {
    ASSERT_FALSE(launcher->Poll().has_value()) << ReadFile(run_dir + "/launcher.log");
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_GE(CountProcessesMentioning(run_dir), 5);  // launcher, 2 servers, 2 trainers
  launcher->Signal(SIGKILL);
  ASSERT_EQ(launcher->WaitUntil(absl::Now() + absl::Seconds(10)), 128 + SIGKILL);
  const absl::Time gone_by = absl::Now() + absl::Seconds(60);
  while (CountProcessesMentioning(run_dir) > 0 && absl::Now() < gone_by) absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(CountProcessesMentioning(run_dir), 0) << "children outlived their SIGKILLed launcher";
}

// The "MiB on the wire" per step of trainer 0's summary.
double WireMibPerStep(const std::string& out) {
  const std::string marker = " MiB on the wire";
  const size_t end = out.find(marker);
  if (end == std::string::npos) return -1;
  const size_t begin = out.rfind("= ", end);  // "fetched F + pushed P = T MiB on the wire"
  return std::stod(out.substr(begin + 2, end - begin - 2));
}

// Runs `pshard local` with `flags` to the end; its launcher log, or why it
// did not exit 0 within 3 minutes.
absl::StatusOr<std::string> TrainLocally(const std::vector<std::string>& flags) {
  const std::string run_dir = MakeRunDir();
  absl::StatusOr<ChildProcess> launcher = StartLocal(run_dir, flags);
  if (!launcher.ok()) return launcher.status();
  std::optional<int> code = launcher->WaitUntil(absl::Now() + absl::Minutes(3));
  const std::string out = ReadFile(run_dir + "/launcher.log");
  if (!code.has_value()) return absl::DeadlineExceededError("still running after 3 minutes:\n" + out);
  if (*code != 0) return absl::InternalError(absl::StrCat("exit code ", *code, ":\n", out));
  return out;
}

// Accumulating on the trainer, per micro-batch passes against one pass per
// step: the same training, bit for bit (the same printed losses), for a
// quarter of the fetches.
TEST(LocalClusterE2E, FetchOncePerStepTrainsTheSameForLessTraffic) {
  std::string out[2];
  for (int once = 0; once < 2; ++once) {
    std::vector<std::string> flags = {"--servers=2", "--trainers=2", "--steps=12", "--layers=2", "--d_model=64",
                                      "--heads=2", "--context=32", "--seq_len=32", "--log_every=4",
                                      "--micro_batches=4", "--accumulate_on_trainer", "--encoding=fp32"};
    if (once) flags.push_back("--fetch_once_per_step");
    absl::StatusOr<std::string> trained = TrainLocally(flags);
    ASSERT_TRUE(trained.ok()) << trained.status();
    out[once] = *trained;
  }
  EXPECT_NE(out[1].find("(4 micro-batches held at once)"), std::string::npos) << out[1];
  const std::vector<double> per_micro = Losses(out[0]);
  ASSERT_EQ(per_micro.size(), 3u) << out[0];
  EXPECT_EQ(Losses(out[1]), per_micro) << out[1];
  // Per micro-batch passes fetch 4 times and push once; one pass fetches once.
  const double wire_per_micro = WireMibPerStep(out[0]);
  const double wire_once = WireMibPerStep(out[1]);
  EXPECT_GT(wire_once, 0) << out[1];
  EXPECT_LT(wire_once, 0.5 * wire_per_micro) << out[0] << out[1];
}

// Each direction takes its own encoding: fp32 weights with bf16 gradients
// move fewer bytes per step than fp32 both ways and more than bf16 both ways
// (weights cross twice per step, forward and backward; gradients once).
TEST(LocalClusterE2E, EachDirectionTakesItsOwnEncoding) {
  const std::vector<std::vector<std::string>> encodings = {
      {"--encoding=fp32"}, {"--weight_encoding=fp32", "--grad_encoding=bf16"}, {"--encoding=bf16"}};
  std::vector<double> wire;
  std::string mixed;
  for (const std::vector<std::string>& e : encodings) {
    std::vector<std::string> flags = {"--servers=2", "--trainers=1", "--steps=4", "--layers=2", "--d_model=64",
                                      "--heads=2", "--context=32", "--seq_len=32", "--log_every=2"};
    flags.insert(flags.end(), e.begin(), e.end());
    absl::StatusOr<std::string> out = TrainLocally(flags);
    ASSERT_TRUE(out.ok()) << out.status();
    wire.push_back(WireMibPerStep(*out));
    if (e.size() == 2) mixed = *out;
  }
  EXPECT_NE(mixed.find("weights fp32, gradients bf16 on the wire"), std::string::npos) << mixed;
  EXPECT_GT(wire[2], 0) << mixed;
  EXPECT_LT(wire[1], wire[0]) << mixed;
  EXPECT_GT(wire[1], wire[2]) << mixed;
}

// `pshard local` with `flags` exits with `code`, saying `message`, and
// leaves no process behind.
void ExpectRefused(const std::vector<std::string>& flags, int code, const std::string& message) {
  const std::string run_dir = MakeRunDir();
  auto launcher = StartLocal(run_dir, flags);
  ASSERT_TRUE(launcher.ok());
  std::optional<int> exit_code = launcher->WaitUntil(absl::Now() + absl::Seconds(60));
  ASSERT_TRUE(exit_code.has_value());
  EXPECT_EQ(*exit_code, code);
  EXPECT_NE(ReadFile(run_dir + "/launcher.log").find(message), std::string::npos)
      << ReadFile(run_dir + "/launcher.log");
  EXPECT_EQ(CountProcessesMentioning(run_dir), 0);
}

TEST(LocalClusterE2E, UnknownAttentionIsRefusedBeforeStarting) {
  ExpectRefused({"--servers=2", "--trainers=1", "--attention=flash"}, 2, "expected auto, fused or materialized");
}

// Keeping every unit from forward to backward trains the same bits (the
// same printed losses) for fewer bytes: weights cross once per step, not
// twice.
TEST(LocalClusterE2E, UnitsKeptFromForwardTrainTheSameForLessTraffic) {
  std::string out[2];
  for (int keep = 0; keep < 2; ++keep) {
    std::vector<std::string> flags = {"--servers=2", "--trainers=2", "--steps=6", "--layers=2", "--d_model=64",
                                      "--heads=2", "--context=32", "--seq_len=32", "--log_every=2"};
    if (keep) flags.push_back("--reshard_after_forward=false");
    absl::StatusOr<std::string> trained = TrainLocally(flags);
    ASSERT_TRUE(trained.ok()) << trained.status();
    out[keep] = *trained;
  }
  EXPECT_NE(out[1].find("every unit kept from forward to backward"), std::string::npos) << out[1];
  const std::vector<double> resharded = Losses(out[0]);
  ASSERT_EQ(resharded.size(), 3u) << out[0];
  EXPECT_EQ(Losses(out[1]), resharded) << out[1];
  EXPECT_GT(WireMibPerStep(out[1]), 0) << out[1];
  EXPECT_LT(WireMibPerStep(out[1]), WireMibPerStep(out[0])) << out[0] << out[1];
}

// Stage 2 keeps a resident replica for the step: with 2 micro-batches it
// trains the same bits for fewer bytes (one fetch of each unit per step
// instead of two per micro-batch).
TEST(LocalClusterE2E, StageTwoTrainsTheSameForLessTraffic) {
  std::string out[2];
  for (int stage2 = 0; stage2 < 2; ++stage2) {
    std::vector<std::string> flags = {"--servers=2", "--trainers=2", "--steps=6", "--layers=2", "--d_model=64",
                                      "--heads=2", "--context=32", "--seq_len=32", "--log_every=2",
                                      "--micro_batches=2"};
    if (stage2) flags.push_back("--stage=2");
    absl::StatusOr<std::string> trained = TrainLocally(flags);
    ASSERT_TRUE(trained.ok()) << trained.status();
    out[stage2] = *trained;
  }
  EXPECT_NE(out[1].find("stage 2: a resident replica of every unit"), std::string::npos) << out[1];
  const std::vector<double> stage3 = Losses(out[0]);
  ASSERT_EQ(stage3.size(), 3u) << out[0];
  EXPECT_EQ(Losses(out[1]), stage3) << out[1];
  EXPECT_GT(WireMibPerStep(out[1]), 0) << out[1];
  EXPECT_LT(WireMibPerStep(out[1]), WireMibPerStep(out[0])) << out[0] << out[1];
}

TEST(LocalClusterE2E, AnUnknownStageIsRefusedBeforeStarting) {
  ExpectRefused({"--servers=2", "--trainers=1", "--stage=4"}, 2, "ZeRO stages are 1, 2 and 3");
}

TEST(LocalClusterE2E, AReshardingGroupNeedsFabricGroupsOfItsSize) {
  ExpectRefused({"--servers=2", "--trainers=2", "--reshard_after_forward=2"}, 2, "needs --fabric_group_size=2");
}

// The secondary shard: in fabric groups of 2, backward all-gathers each unit
// within the group instead of fetching it again; the same bits, fewer bytes
// over the slow link than the groups alone.
TEST(LocalClusterE2E, TheSecondaryShardTrainsTheSameForLessTraffic) {
  std::string out[2];
  for (int secondary = 0; secondary < 2; ++secondary) {
    std::vector<std::string> flags = {"--servers=2", "--trainers=2", "--steps=6", "--layers=2", "--d_model=64",
                                      "--heads=2", "--context=32", "--seq_len=32", "--log_every=2",
                                      "--fabric_group_size=2"};
    if (secondary) flags.push_back("--reshard_after_forward=2");
    absl::StatusOr<std::string> trained = TrainLocally(flags);
    ASSERT_TRUE(trained.ok()) << trained.status();
    out[secondary] = *trained;
  }
  EXPECT_NE(out[1].find("secondary shard: 1/2 of every unit kept from forward"), std::string::npos) << out[1];
  // The summary gives the parts' memory, and what the fabric carried.
  std::smatch kept;
  ASSERT_TRUE(std::regex_search(out[1], kept, std::regex(R"(([0-9.]+) MiB of secondary shard)"))) << out[1];
  EXPECT_GT(std::stod(kept[1]), 0.0) << out[1];
  EXPECT_NE(out[1].find("fabric group: "), std::string::npos) << out[1];
  const std::vector<double> groups = Losses(out[0]);
  ASSERT_EQ(groups.size(), 3u) << out[0];
  EXPECT_EQ(Losses(out[1]), groups) << out[1];
  EXPECT_GT(WireMibPerStep(out[1]), 0) << out[1];
  EXPECT_LT(WireMibPerStep(out[1]), WireMibPerStep(out[0])) << out[0] << out[1];
}

TEST(LocalClusterE2E, AnUnknownEncodingIsRefusedBeforeStarting) {
  ExpectRefused({"--servers=2", "--trainers=1", "--grad_encoding=int3"}, 2,
                "--grad_encoding: unknown wire encoding 'int3'");
}

TEST(LocalClusterE2E, FetchOncePerStepNeedsAccumulationOnTheTrainer) {
  ExpectRefused({"--servers=2", "--trainers=1", "--micro_batches=2", "--fetch_once_per_step"}, 2,
                "add --accumulate_on_trainer");
}

TEST(LocalClusterE2E, BadFlagsGiveAClearError) {
  ExpectRefused({"--servers=2", "--trainers=1", "--d_model=30", "--heads=4"}, 1, "not divisible by heads");
}

TEST(LocalClusterE2E, LinkFlagsAreTakenAndARateInBytesIsFlagged) {
  const std::string run_dir = MakeRunDir();
  auto launcher = StartLocal(run_dir, {"--servers=2", "--trainers=1", "--steps=2", "--layers=1", "--d_model=32",
                                       "--heads=2", "--context=16", "--seq_len=16", "--log_every=1",
                                       "--link_rate=50mbps", "--link_delay=1ms"});
  ASSERT_TRUE(launcher.ok()) << launcher.status();
  std::optional<int> code = launcher->WaitUntil(absl::Now() + absl::Minutes(3));
  const std::string out = ReadFile(run_dir + "/launcher.log");
  ASSERT_TRUE(code.has_value()) << out;
  EXPECT_EQ(*code, 0) << out;
  EXPECT_NE(out.find("rate 50mbps = 400 Mbit/s = 50 MB/s"), std::string::npos) << out;
  EXPECT_NE(out.find("8x 50mbit"), std::string::npos) << out;
  // The trainers got the link: their startup line says so.
  EXPECT_NE(out.find("links 400.0 Mbit/s, 1ms latency"), std::string::npos) << out;
}

TEST(LocalClusterE2E, ABadLinkRateIsRefusedBeforeStarting) {
  ExpectRefused({"--servers=2", "--trainers=1", "--link_rate=fast"}, 2, "link rate 'fast' is not a number");
  ExpectRefused({"--servers=2", "--trainers=1", "--link_delay=soon"}, 2, "--link_delay=soon is not a duration");
  ExpectRefused({"--servers=2", "--trainers=1", "--link_scope=wire"}, 2, "--link_scope=wire is not node or connection");
  ExpectRefused({"--servers=2", "--trainers=1", "--placement=rack"}, 2, "--placement=rack is not separate or paired");
  ExpectRefused({"--servers=2", "--trainers=2", "--fabric_rate=10gbit"}, 2, "need --fabric_group_size of 2 or more");
  ExpectRefused({"--servers=2", "--trainers=2", "--fabric_group_size=2", "--fabric_rate=fast"}, 2,
                "--fabric_rate: link rate 'fast' is not a number");
  ExpectRefused({"--servers=2", "--trainers=2", "--fabric_group_size=2", "--fabric_delay=soon"}, 2,
                "--fabric_delay=soon is not a duration");
}

// Paired placement: trainer R and server R on one emulated node, whose
// interface both share (one bucket file per node), the rest alone.
TEST(LocalClusterE2E, PairedPlacementPutsEachTrainerOnANodeWithAServer) {
  const std::string run_dir = MakeRunDir();
  auto launcher = StartLocal(run_dir, {"--servers=3", "--trainers=2", "--steps=2", "--layers=1", "--d_model=32",
                                       "--heads=2", "--context=16", "--seq_len=16", "--log_every=1",
                                       "--link_rate=100mbit", "--placement=paired"});
  ASSERT_TRUE(launcher.ok()) << launcher.status();
  std::optional<int> code = launcher->WaitUntil(absl::Now() + absl::Minutes(3));
  const std::string out = ReadFile(run_dir + "/launcher.log");
  ASSERT_TRUE(code.has_value()) << out;
  EXPECT_EQ(*code, 0) << out;
  const std::vector<std::string> addresses = LocalServerAddresses(run_dir, 3);
  ASSERT_EQ(addresses.size(), 3u);
  const std::string topology = ReadFile(run_dir + "/topology.json");
  EXPECT_NE(topology.find("\"node-0\", \"servers\": [\"" + addresses[0] + "\"], \"trainers\": [0]"),
            std::string::npos)
      << topology;
  EXPECT_NE(topology.find("\"node-2\", \"servers\": [\"" + addresses[2] + "\"]}"), std::string::npos) << topology;
  for (const char* node : {"node-0", "node-1", "node-2"}) {
    EXPECT_TRUE(std::filesystem::exists(absl::StrCat(run_dir, "/links/", node, ".link"))) << node;
  }
}

// --topology: the file reaches every trainer, which puts itself and the
// servers on its nodes (servers named by shard) and shapes the node pair's
// own link with the pair's buckets.
TEST(LocalClusterE2E, ATopologyPlacesTheProcessesAndShapesItsLinks) {
  const std::string run_dir = MakeRunDir();
  const std::string file = run_dir + "/mine.json";
  std::ofstream(file) << R"({"nodes": [{"name": "east", "servers": ["shard:0"], "trainers": [0]},
                                       {"name": "west", "servers": ["shard:1"], "trainers": [1]}],
                             "links": [{"between": ["east", "west"], "kind": "ethernet", "rate": "100mbit",
                                        "delay": "1ms"}]})";
  auto launcher = StartLocal(run_dir, {"--servers=2", "--trainers=2", "--steps=2", "--layers=1", "--d_model=32",
                                       "--heads=2", "--context=16", "--seq_len=16", "--log_every=1",
                                       "--topology=" + file});
  ASSERT_TRUE(launcher.ok()) << launcher.status();
  std::optional<int> code = launcher->WaitUntil(absl::Now() + absl::Minutes(3));
  const std::string out = ReadFile(run_dir + "/launcher.log");
  ASSERT_TRUE(code.has_value()) << out;
  EXPECT_EQ(*code, 0) << out;
  EXPECT_THAT(ReadFile(run_dir + "/trainer0.log"),
              HasSubstr("links shaped by the topology (node east: to west 100.0 Mbit/s, 1ms latency"));
  EXPECT_THAT(ReadFile(run_dir + "/trainer1.log"),
              HasSubstr("links shaped by the topology (node west: to east 100.0 Mbit/s, 1ms latency"));
  // Both directions of the pair's link are one file, shared by the two.
  EXPECT_TRUE(std::filesystem::exists(run_dir + "/links/east~west.link"));
  EXPECT_FALSE(std::filesystem::exists(run_dir + "/topology.json"));  // theirs, not one written here
}

TEST(LocalClusterE2E, ATopologyThatIsNotTheJobsIsRefusedBeforeStarting) {
  const std::string file = MakeRunDir() + "/t.json";
  std::ofstream(file) << R"({"nodes": [{"name": "a", "servers": ["shard:0", "shard:1"], "trainers": [0, 1]}],
                             "fabric_groups": [[0, 1]]})";
  const std::string topology = "--topology=" + file;
  ExpectRefused({"--servers=3", "--trainers=2", topology}, 2, "shard:2 is on no node");
  ExpectRefused({"--servers=2", "--trainers=4", topology}, 2, "trainer 2 is on no node");
  ExpectRefused({"--servers=2", "--trainers=2", "--fabric_group_size=4", topology}, 2,
                "whose fabric groups are of 2: the topology's groups are the job's");
  ExpectRefused({"--servers=2", "--trainers=2", "--placement=paired", topology}, 2, "not with --placement=paired");
  ExpectRefused({"--servers=2", "--trainers=2", "--topology=/nonexistent.json"}, 2, "cannot read topology file");
  // The groups count: a secondary shard of another size is refused.
  ExpectRefused({"--servers=2", "--trainers=2", "--reshard_after_forward=4", topology}, 2,
                "needs --fabric_group_size=4 (now 2)");
}

// Steps of shard `shard` of `num_shards` whose checkpoint is in `dir`.
std::vector<int64_t> CheckpointSteps(const std::string& dir, int shard, int num_shards) {
  std::vector<int64_t> steps;
  const std::regex name(absl::StrCat("shard-", shard, "-of-", num_shards, R"(\.step-(\d+)\.ckpt)"));
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    std::smatch m;
    const std::string file = entry.path().filename().string();
    if (std::regex_match(file, m, name)) steps.push_back(std::stoll(m[1]));
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

// The pid of a process whose command line holds every one of `needles`.
std::optional<pid_t> FindProcess(const std::vector<std::string>& needles) {
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string pid = entry.path().filename();
    if (pid.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string cmd = ReadFile((entry.path() / "cmdline").string());
    if (std::all_of(needles.begin(), needles.end(), [&](const std::string& n) { return cmd.find(n) != cmd.npos; })) {
      return static_cast<pid_t>(std::stoi(pid));
    }
  }
  return std::nullopt;
}

// With one checkpoint kept per shard, a shard killed mid-run must not make
// the survivors' shutdown checkpoints delete the last step every shard has:
// the job resumes from it.
TEST(LocalClusterE2E, KeepingOneCheckpointAJobWithAKilledShardStillResumes) {
  const std::string run_dir = MakeRunDir();
  const std::string ckpt = run_dir + "/ckpt";
  const std::vector<std::string> job = {"--servers=2", "--trainers=1", "--layers=1", "--d_model=32", "--heads=2",
                                        "--context=16", "--seq_len=16", "--log_every=1",
                                        absl::StrCat("--checkpoint_dir=", ckpt), "--checkpoint_every=2",
                                        "--checkpoint_keep=1", "--schedule_steps=1000"};
  std::vector<std::string> flags = job;
  flags.push_back("--steps=1000");
  flags.push_back("--server_restarts=0");  // the shard stays dead: the job ends
  auto launcher = StartLocal(run_dir, flags);
  ASSERT_TRUE(launcher.ok()) << launcher.status();
  const absl::Time deadline = absl::Now() + absl::Minutes(2);
  while (Losses(ReadFile(run_dir + "/launcher.log")).size() < 7 && absl::Now() < deadline) {
    ASSERT_FALSE(launcher->Poll().has_value()) << ReadFile(run_dir + "/launcher.log");
    absl::SleepFor(absl::Milliseconds(50));
  }
  const std::optional<pid_t> shard1 = FindProcess({"pshard-server", "--shard_index=1", run_dir});
  ASSERT_TRUE(shard1.has_value());
  kill(*shard1, SIGKILL);
  std::optional<int> code = launcher->WaitUntil(absl::Now() + absl::Seconds(60));
  ASSERT_TRUE(code.has_value()) << ReadFile(run_dir + "/launcher.log");
  EXPECT_NE(*code, 0);
  EXPECT_NE(ReadFile(run_dir + "/launcher.log").find("shard server 1 exited early"), std::string::npos);

  const std::vector<int64_t> steps0 = CheckpointSteps(ckpt, 0, 2), steps1 = CheckpointSteps(ckpt, 1, 2);
  std::vector<int64_t> common;
  std::set_intersection(steps0.begin(), steps0.end(), steps1.begin(), steps1.end(), std::back_inserter(common));
  ASSERT_FALSE(common.empty()) << "shard 0 holds " << ::testing::PrintToString(steps0) << ", shard 1 "
                               << ::testing::PrintToString(steps1);
  EXPECT_GE(common.back(), 4);

  const std::string resumed_dir = MakeRunDir();
  flags = job;
  flags.push_back(absl::StrCat("--steps=", common.back() + 3));
  flags.push_back(absl::StrCat("--resume_step=", common.back()));
  auto resumed = StartLocal(resumed_dir, flags);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  code = resumed->WaitUntil(absl::Now() + absl::Minutes(2));
  const std::string out = ReadFile(resumed_dir + "/launcher.log");
  ASSERT_TRUE(code.has_value()) << out;
  EXPECT_EQ(*code, 0) << out;
  EXPECT_EQ(Losses(out).size(), 3u) << out;
  EXPECT_NE(ReadFile(resumed_dir + "/server1.log").find(absl::StrCat("resumed at step ", common.back())),
            std::string::npos);
  EXPECT_THAT(out, HasSubstr(absl::StrCat("pshard: resumed from the checkpoints of step ", common.back(),
                                          "; training to step ", common.back() + 3)));
}

// The checkpoint folder deleted mid-run: by default the server that finds
// it gone stops and the job fails naming it; with
// --on_checkpoint_failure=continue the job trains to the end and then fails,
// because the last step's checkpoints it was asked for are not on disk.
TEST(LocalClusterE2E, ADeletedCheckpointFolderFailsTheJobAndIsNotMadeAgain) {
  for (const std::string policy : {"stop", "continue"}) {
    SCOPED_TRACE(policy);
    const std::string run_dir = MakeRunDir();
    const std::string ckpt = run_dir + "/ckpt";
    auto launcher = StartLocal(run_dir, {"--servers=2", "--trainers=1", "--layers=1", "--d_model=32", "--heads=2",
                                         "--context=16", "--seq_len=16", "--log_every=1",
                                         // stopping: a job that could only end by the failure
                                         policy == "stop" ? "--steps=100000" : "--steps=200",
                                         absl::StrCat("--checkpoint_dir=", ckpt), "--checkpoint_every=2",
                                         "--on_checkpoint_failure=" + policy});
    ASSERT_TRUE(launcher.ok()) << launcher.status();
    const absl::Time deadline = absl::Now() + absl::Minutes(2);
    while (Losses(ReadFile(run_dir + "/launcher.log")).size() < 3 && absl::Now() < deadline) {
      ASSERT_FALSE(launcher->Poll().has_value()) << ReadFile(run_dir + "/launcher.log");
      absl::SleepFor(absl::Milliseconds(50));
    }
    // Out of the way at once (a write may be in flight inside it), then gone.
    std::filesystem::rename(ckpt, run_dir + "/deleted");
    std::error_code ignored;
    for (int tries = 0; tries < 100 && std::filesystem::exists(run_dir + "/deleted"); ++tries) {
      std::filesystem::remove_all(run_dir + "/deleted", ignored);
    }
    std::optional<int> code = launcher->WaitUntil(absl::Now() + absl::Minutes(2));
    const std::string out = ReadFile(run_dir + "/launcher.log");
    ASSERT_TRUE(code.has_value()) << out;
    EXPECT_NE(*code, 0) << out;
    if (policy == "stop") {
      EXPECT_THAT(out, ::testing::ContainsRegex("shard server [01] exited early with code 3"));
      EXPECT_THAT(out, HasSubstr("is gone (deleted while the job ran?)"));
    } else {
      EXPECT_EQ(Losses(out).size(), 200u) << out;
      EXPECT_THAT(out, HasSubstr("the checkpoint of the last step (200) of shard(s) 0, 1 is not in " + ckpt));
      EXPECT_THAT(ReadFile(run_dir + "/server0.log"), HasSubstr("training goes on WITHOUT it"));
    }
    EXPECT_FALSE(std::filesystem::exists(ckpt));
    EXPECT_EQ(CountProcessesMentioning(run_dir), 0);
  }
}

// pshard-trainer refuses, before it connects anywhere, a fabric shaping
// with no fabric group to carry it and a server address whose port is out
// of range.
TEST(LocalClusterE2E, TheTrainerRefusesWhatNothingWouldUse) {
  const std::string trainer = std::string(PSHARD_BIN_DIR) + "/pshard-trainer ";
  for (const auto& [flags, message] : std::vector<std::pair<std::string, std::string>>{
           {"--servers=127.0.0.1:1 --fabric_rate=1gbit", "shape a fabric group's fabric, and trainer 0 is in none"},
           {"--servers=127.0.0.1:1 --fabric_delay=1ms", "is in none"},
           {"--servers=127.0.0.1:1,127.0.0.1:70000", "--servers: \"127.0.0.1:70000\" is not host:port"},
       }) {
    const CommandResult r = RunCommand(trainer + flags + " 2>&1");
    EXPECT_EQ(r.exit_code, 2) << flags << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr(message)) << flags;
  }
}

// Run again in the same folder, a finished job says on the console where it
// resumed, that there is nothing left to train and how to train longer; the
// first run's logs are kept apart from the second's.
TEST(LocalClusterE2E, RunAgainAFinishedJobSaysHowToTrainLonger) {
  const std::string run_dir = MakeRunDir();
  const std::vector<std::string> job = {"--servers=2", "--trainers=1", "--layers=1", "--d_model=32", "--heads=2",
                                        "--context=16", "--seq_len=16", "--log_every=1", "--steps=3",
                                        absl::StrCat("--checkpoint_dir=", run_dir, "/ckpt")};
  std::string before;
  for (int run = 0; run < 2; ++run) {
    auto launcher = StartLocal(run_dir, job);
    ASSERT_TRUE(launcher.ok()) << launcher.status();
    const std::optional<int> code = launcher->WaitUntil(absl::Now() + absl::Minutes(2));
    ASSERT_TRUE(code.has_value()) << ReadFile(run_dir + "/launcher.log");
    ASSERT_EQ(*code, 0) << ReadFile(run_dir + "/launcher.log");
    if (run == 0) before = ReadFile(run_dir + "/launcher.log");
  }
  const std::string second = ReadFile(run_dir + "/launcher.log").substr(before.size());
  EXPECT_THAT(before, Not(HasSubstr("resumed from")));
  EXPECT_THAT(second, HasSubstr("pshard: resumed from the checkpoints of step 3; training to step 3"));
  EXPECT_THAT(second, HasSubstr("the job is already at step 3: nothing to train"));
  EXPECT_THAT(second, HasSubstr("--schedule_steps=3"));
  EXPECT_THAT(second, HasSubstr("--allow_schedule_change"));
  EXPECT_THAT(second, HasSubstr("kept as *.log.previous"));
  const std::string log = ReadFile(run_dir + "/server0.log"), previous = ReadFile(run_dir + "/server0.log.previous");
  EXPECT_THAT(log, HasSubstr("resumed at step 3"));
  EXPECT_THAT(previous, HasSubstr("serving on"));
  EXPECT_THAT(previous, Not(HasSubstr("resumed at step")));
  EXPECT_EQ(std::vector<std::string>(absl::StrSplit(log, "serving on")).size(), 2u) << log;  // one run's lines
}

// A trainer SIGKILLed at a random step is started again by pshard local; it
// rejoins, redoes its step, and the job ends with the servers' state byte
// for byte that of a run nobody disturbed. Over gRPC: a UCX server can
// still abort on a rendezvous message from a trainer that died mid-push.
TEST(LocalClusterE2E, AKilledTrainerIsRestartedAndTheJobEndsBitIdentical) {
  constexpr int kSteps = 150;
  const std::vector<std::string> job = {"--servers=2", "--trainers=2", "--layers=2", "--d_model=64", "--heads=2",
                                        "--context=32", "--seq_len=32", "--log_every=1", "--encoding=fp32",
                                        "--transport=grpc", absl::StrCat("--steps=", kSteps)};
  auto with_checkpoints = [&](const std::string& run_dir) {
    std::vector<std::string> flags = job;
    flags.push_back(absl::StrCat("--checkpoint_dir=", run_dir, "/ckpt"));
    return flags;
  };
  const std::string plain = MakeRunDir();
  {
    auto launcher = StartLocal(plain, with_checkpoints(plain));
    ASSERT_TRUE(launcher.ok()) << launcher.status();
    ASSERT_EQ(launcher->WaitUntil(absl::Now() + absl::Minutes(3)), 0) << ReadFile(plain + "/launcher.log");
  }
  const int kill_after = 3 + static_cast<int>(std::random_device()() % 40);
  SCOPED_TRACE(absl::StrCat("trainer 1 killed after trainer 0 logged ", kill_after, " steps"));
  const std::string run_dir = MakeRunDir();
  auto launcher = StartLocal(run_dir, with_checkpoints(run_dir));
  ASSERT_TRUE(launcher.ok()) << launcher.status();
  const absl::Time deadline = absl::Now() + absl::Minutes(2);
  while (Losses(ReadFile(run_dir + "/launcher.log")).size() < static_cast<size_t>(kill_after)) {
    ASSERT_FALSE(launcher->Poll().has_value()) << ReadFile(run_dir + "/launcher.log");
    ASSERT_LT(absl::Now(), deadline) << ReadFile(run_dir + "/launcher.log");
    absl::SleepFor(absl::Milliseconds(5));
  }
  const std::optional<pid_t> trainer1 = FindProcess({"pshard-trainer", "--rank=1", run_dir});
  ASSERT_TRUE(trainer1.has_value()) << "trainer 1 is not running";
  kill(*trainer1, SIGKILL);
  const std::optional<int> code = launcher->WaitUntil(absl::Now() + absl::Minutes(3));
  const std::string out = ReadFile(run_dir + "/launcher.log");
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("trainer 1 died (signal 9); restarting it (1 of 3 restarts)"), std::string::npos) << out;
  EXPECT_NE(out.find("(after 1 trainer restarts)"), std::string::npos) << out;
  for (int s = 0; s < 2; ++s) {
    const std::string name = absl::StrFormat("shard-%d-of-2.step-%010d.ckpt", s, kSteps);
    const std::string want = ReadFile(absl::StrCat(plain, "/ckpt/", name));
    ASSERT_FALSE(want.empty()) << name << " is missing";
    EXPECT_TRUE(ReadFile(absl::StrCat(run_dir, "/ckpt/", name)) == want) << name << " differs from the undisturbed run's";
  }
}

// A shard server SIGKILLed at a random step is started again by pshard local
// on its port and restores its newest checkpoint (one is written per step).
// The trainers notice from the connection (their deadline here is 10
// minutes, past the test's own), rejoin, roll the other shard back if it
// had moved on, redo the steps since, and the job ends with every shard's
// state byte for byte that of a run nobody disturbed. Over the default
// data path (UCX where it starts).
TEST(LocalClusterE2E, AKilledServerIsRestartedAndTheJobEndsBitIdentical) {
  constexpr int kSteps = 150;
  const std::vector<std::string> job = {"--servers=2", "--trainers=2", "--layers=2", "--d_model=64", "--heads=2",
                                        "--context=32", "--seq_len=32", "--log_every=1", "--encoding=fp32",
                                        "--checkpoint_every=1", "--rpc_timeout=10m",
                                        absl::StrCat("--steps=", kSteps)};
  auto with_checkpoints = [&](const std::string& run_dir) {
    std::vector<std::string> flags = job;
    flags.push_back(absl::StrCat("--checkpoint_dir=", run_dir, "/ckpt"));
    return flags;
  };
  const std::string plain = MakeRunDir();
  {
    auto launcher = StartLocal(plain, with_checkpoints(plain));
    ASSERT_TRUE(launcher.ok()) << launcher.status();
    ASSERT_EQ(launcher->WaitUntil(absl::Now() + absl::Minutes(3)), 0) << ReadFile(plain + "/launcher.log");
  }
  const int shard = static_cast<int>(std::random_device()() % 2);
  const int kill_after = 3 + static_cast<int>(std::random_device()() % 60);
  SCOPED_TRACE(absl::StrCat("shard ", shard, " killed after trainer 0 logged ", kill_after, " steps"));
  const std::string run_dir = MakeRunDir();
  auto launcher = StartLocal(run_dir, with_checkpoints(run_dir));
  ASSERT_TRUE(launcher.ok()) << launcher.status();
  const absl::Time deadline = absl::Now() + absl::Minutes(2);
  while (Losses(ReadFile(run_dir + "/launcher.log")).size() < static_cast<size_t>(kill_after)) {
    ASSERT_FALSE(launcher->Poll().has_value()) << ReadFile(run_dir + "/launcher.log");
    ASSERT_LT(absl::Now(), deadline) << ReadFile(run_dir + "/launcher.log");
    absl::SleepFor(absl::Milliseconds(5));
  }
  const std::optional<pid_t> server = FindProcess({"pshard-server", absl::StrCat("--shard_index=", shard), run_dir});
  ASSERT_TRUE(server.has_value()) << "shard server " << shard << " is not running";
  kill(*server, SIGKILL);
  const std::optional<int> code = launcher->WaitUntil(absl::Now() + absl::Minutes(3));
  const std::string out = ReadFile(run_dir + "/launcher.log");
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find(absl::StrCat("shard server ", shard, " died (signal 9); restarting it on port")),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("(after 1 server restarts)"), std::string::npos) << out;
  // Each trainer says which server it lost, and that it rejoined.
  for (int r = 0; r < 2; ++r) {
    const std::string log = ReadFile(absl::StrCat(run_dir, "/trainer", r, ".log"));
    EXPECT_NE(log.find(absl::StrCat(" shard ", shard, " (127.0.0.1:")), std::string::npos) << log;
    EXPECT_NE(log.find("rejoined (1 so far); resuming at step"), std::string::npos) << log;
  }
  EXPECT_NE(ReadFile(absl::StrCat(run_dir, "/server", shard, ".log")).find("resumed at step"), std::string::npos);
  for (int s = 0; s < 2; ++s) {
    const std::string name = absl::StrFormat("shard-%d-of-2.step-%010d.ckpt", s, kSteps);
    const std::string want = ReadFile(absl::StrCat(plain, "/ckpt/", name));
    ASSERT_FALSE(want.empty()) << name << " is missing";
    EXPECT_TRUE(ReadFile(absl::StrCat(run_dir, "/ckpt/", name)) == want) << name << " differs from the undisturbed run's";
  }
}


// A shard server stopped (SIGSTOP) for longer than the trainers' deadline
// is not dead: its connections stay up, so nothing but the deadline can end
// a transfer to it. Each trainer fails its step with a message that names
// the server, rejoins once the server is continued (SIGCONT), and the job
// ends. Over gRPC and over UCX, whose endpoints to a server on this host
// cannot detect a failed peer.
class StoppedServerTest : public ::testing::TestWithParam<std::string> {};

TEST_P(StoppedServerTest, EachTrainerFailsAtItsDeadlineNamingTheServerAndRecovers) {
  if (GetParam() == "ucx" && !PSHARD_WITH_UCX) GTEST_SKIP() << "built without UCX";
  const std::string run_dir = MakeRunDir();
  auto launcher = StartLocal(run_dir, {"--servers=2", "--trainers=2", "--layers=2", "--d_model=64", "--heads=2",
                                       "--context=32", "--seq_len=32", "--log_every=1", "--steps=40",
                                       "--rpc_timeout=2s", "--server_retry_limit=2m",
                                       absl::StrCat("--transport=", GetParam())});
  ASSERT_TRUE(launcher.ok()) << launcher.status();
  absl::Time deadline = absl::Now() + absl::Minutes(2);
  while (Losses(ReadFile(run_dir + "/launcher.log")).size() < 5) {
    ASSERT_FALSE(launcher->Poll().has_value()) << ReadFile(run_dir + "/launcher.log");
    ASSERT_LT(absl::Now(), deadline) << ReadFile(run_dir + "/launcher.log");
    absl::SleepFor(absl::Milliseconds(5));
  }
  const std::optional<pid_t> server = FindProcess({"pshard-server", "--shard_index=1", run_dir});
  ASSERT_TRUE(server.has_value()) << "shard server 1 is not running";
  ASSERT_EQ(kill(*server, SIGSTOP), 0);
  const absl::Time stopped = absl::Now();
  std::smatch serving;
  const std::string server_log = ReadFile(run_dir + "/server1.log");
  ASSERT_TRUE(std::regex_search(server_log, serving, std::regex(R"(serving on (127\.0\.0\.1:\d+))"))) << server_log;
  const std::string stopped_address = serving[1];
  // Each trainer fails its step at a deadline and says, within a few
  // deadlines, which server did not answer: in the failure (its own
  // transfer to it, or shard 0's wait for its norm), or, where the step
  // failed first on another shard's wait for a trainer held up by it, in
  // its rejoin's wait for that server; and it keeps trying to rejoin while
  // the server stays stopped (4 deadlines).
  const std::regex failed(R"(pshard-trainer \d: step \d+ failed: DEADLINE_EXCEEDED: )");
  const std::regex named(absl::StrCat(
      R"(pshard-trainer \d: step \d+ failed: DEADLINE_EXCEEDED: [^\n]*)"
      R"((shard 1 \(127\.0\.0\.1:\d+\)|no partial norm yet from shard\(s\) 1\)))",
      R"(|joining: waiting for 1 of 2 shard servers [^\n]*: )", stopped_address, " "));
  auto trainer_log = [&](int r) { return ReadFile(absl::StrCat(run_dir, "/trainer", r, ".log")); };
  auto told = [&](int r) {
    const std::string log = trainer_log(r);
    return std::regex_search(log, failed) && std::regex_search(log, named);
  };
  deadline = absl::Now() + absl::Seconds(30);
  bool both = false;
  while (!both && absl::Now() < deadline) {
    both = told(0) && told(1);
    absl::SleepFor(absl::Milliseconds(100));
  }
  absl::SleepFor(stopped + absl::Seconds(8) - absl::Now());
  kill(*server, SIGCONT);
  EXPECT_TRUE(both) << "trainer 0:\n" << trainer_log(0) << "\ntrainer 1:\n" << trainer_log(1);
  const std::optional<int> code = launcher->WaitUntil(absl::Now() + absl::Minutes(3));
  const std::string out = ReadFile(run_dir + "/launcher.log");
  ASSERT_EQ(code, 0) << out << "\ntrainer 0:\n" << trainer_log(0) << "\ntrainer 1:\n" << trainer_log(1);
  EXPECT_THAT(out, HasSubstr("step 40/40 | loss")) << out;
  for (int r = 0; r < 2; ++r) EXPECT_THAT(trainer_log(r), HasSubstr("rejoined (")) << r;
}

INSTANTIATE_TEST_SUITE_P(Transports, StoppedServerTest, ::testing::Values("grpc", "ucx"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
}  // namespace pshard
