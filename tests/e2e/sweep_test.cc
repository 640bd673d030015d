// pshard sweep end to end: a small grid of real local jobs with figures, an
// interrupted sweep resumed, and bad grids refused before anything starts.
#include <signal.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_util.h"

namespace pshard {
namespace {

using ::testing::HasSubstr;

// A job small enough that a point takes a second or two; links slow enough
// that it is communication-bound.
std::vector<std::string> GridFlags() {
  return {"--servers=2",          "--trainers=2",  "--layers=1",
          "--d_model=32",         "--heads=2",     "--context=16",
          "--seq_len=16",         "--batch=4",     "--link_delay=1ms",
          "--link_rate=20mbit,5mbit", "--weight_encoding=bf16,int8"};
}

std::vector<std::string> SweepArgv(const std::string& out, std::vector<std::string> extra,
                                   std::vector<std::string> grid = GridFlags()) {
  std::vector<std::string> argv = {std::string(PSHARD_BIN_DIR) + "/pshard", "sweep", "--out=" + out,
                                   "--skip_steps=1", "--measure_steps=2"};
  for (std::string& f : grid) argv.push_back(std::move(f));
  for (std::string& f : extra) argv.push_back(std::move(f));
  return argv;
}

std::optional<int> RunToEnd(const std::vector<std::string>& argv, const std::string& log) {
  absl::StatusOr<ChildProcess> sweep = ChildProcess::Spawn(argv, log);
  if (!sweep.ok()) return std::nullopt;
  return sweep->WaitUntil(absl::Now() + absl::Minutes(5));
}

using Row = std::map<std::string, std::string>;

std::vector<Row> ReadCsv(const std::string& path) {
  std::vector<std::string> lines = absl::StrSplit(ReadFile(path), '\n', absl::SkipEmpty());
  std::vector<Row> rows;
  if (lines.empty()) return rows;
  const std::vector<std::string> header = absl::StrSplit(lines[0], ',');
  for (size_t i = 1; i < lines.size(); ++i) {
    const std::vector<std::string> cells = absl::StrSplit(lines[i], ',');
    EXPECT_EQ(cells.size(), header.size()) << lines[i];
    Row row;
    for (size_t c = 0; c < header.size() && c < cells.size(); ++c) row[header[c]] = cells[c];
    rows.push_back(std::move(row));
  }
  return rows;
}

uint32_t Crc32(const uint8_t* data, size_t n) {
  uint32_t crc = 0xffffffffu;
  for (size_t i = 0; i < n; ++i) {
    crc ^= data[i];
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xedb88320u & (0u - (crc & 1u)));
  }
  return ~crc;
}

uint32_t BigEndian(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

// A PNG file as the format defines it: the signature, then chunks whose
// CRCs hold, IHDR first with a real size, image data, IEND last.
::testing::AssertionResult IsValidPng(const std::string& path) {
  const std::string bytes = ReadFile(path);
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  static const uint8_t kSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (bytes.size() < 8 || std::memcmp(p, kSignature, 8) != 0) {
    return ::testing::AssertionFailure() << path << ": no PNG signature";
  }
  size_t at = 8;
  std::vector<std::string> types;
  while (at + 12 <= bytes.size()) {
    const uint32_t length = BigEndian(p + at);
    if (at + 12 + length > bytes.size()) return ::testing::AssertionFailure() << path << ": truncated chunk";
    const std::string type(bytes, at + 4, 4);
    if (Crc32(p + at + 4, 4 + length) != BigEndian(p + at + 8 + length)) {
      return ::testing::AssertionFailure() << path << ": bad CRC in chunk " << type;
    }
    if (type == "IHDR" && (length != 13 || BigEndian(p + at + 8) == 0 || BigEndian(p + at + 12) == 0)) {
      return ::testing::AssertionFailure() << path << ": bad IHDR";
    }
    types.push_back(type);
    at += 12 + length;
  }
  if (types.empty() || types.front() != "IHDR" || types.back() != "IEND" ||
      std::find(types.begin(), types.end(), "IDAT") == types.end() || at != bytes.size()) {
    return ::testing::AssertionFailure() << path << ": chunks are not IHDR ... IDAT ... IEND";
  }
  return ::testing::AssertionSuccess();
}

TEST(SweepE2E, AGridOfFourPointsIsMeasuredPredictedAndPlotted) {
  const std::string out = MakeRunDir();
  std::optional<int> code = RunToEnd(SweepArgv(out, {"--plot"}), out + "/sweep.log");
  ASSERT_EQ(code, 0) << ReadFile(out + "/sweep.log");
  const std::string log = ReadFile(out + "/sweep.log");
  EXPECT_THAT(log, HasSubstr("calibrated from an unshaped run of the first point"));
  EXPECT_THAT(log, HasSubstr("step overhead"));
  EXPECT_THAT(ReadFile(out + "/results.json"), HasSubstr("\"step_overhead_seconds\": "));
  EXPECT_THAT(log, HasSubstr("4/4 | elapsed"));
  EXPECT_THAT(log, HasSubstr("ETA"));

  const std::vector<Row> rows = ReadCsv(out + "/results.csv");
  ASSERT_EQ(rows.size(), 4u);
  std::map<std::string, const Row*> by_point;
  for (const Row& r : rows) {
    for (const char* column :
         {"point", "servers", "link_rate", "weight_encoding", "link_mbit", "measured_step_ms", "measured_compute_ms",
          "measured_exposed_ms", "measured_fetched_bytes", "measured_pushed_bytes", "measured_tokens_per_s",
          "measured_val_loss", "predicted_step_ms", "predicted_exposed_ms", "predicted_fetched_bytes", "knee_mbit",
          "step_error"}) {
      ASSERT_TRUE(r.count(column)) << column;
    }
    by_point[r.at("link_rate") + "/" + r.at("weight_encoding")] = &r;
    EXPECT_EQ(r.at("servers"), "2");
    // The planner's bytes are what the trainers moved, exactly.
    EXPECT_EQ(r.at("measured_fetched_bytes"), r.at("predicted_fetched_bytes"));
    EXPECT_EQ(r.at("measured_pushed_bytes"), r.at("predicted_pushed_bytes"));
    const double measured = std::stod(r.at("measured_step_ms")), predicted = std::stod(r.at("predicted_step_ms"));
    EXPECT_GT(measured, 0);
    EXPECT_GT(std::stod(r.at("measured_tokens_per_s")), 0);
    EXPECT_EQ(r.at("measured_val_loss"), "");  // no --loss_steps: no loss
    EXPECT_GT(predicted, 0);
    // How close the prediction comes is the benchmark's to say, on a quiet
    // machine (bench/sweep_accuracy.sh): here other tests share the cores
    // and the calibration run, so only the prediction's orderings are
    // checked (below).
  }
  ASSERT_EQ(by_point.size(), 4u);
  EXPECT_EQ(by_point["5mbit/bf16"]->at("link_mbit"), "5");
  // A slower link is a longer step; int8 weights move fewer bytes.
  EXPECT_GT(std::stod(by_point["5mbit/bf16"]->at("measured_step_ms")),
            std::stod(by_point["20mbit/bf16"]->at("measured_step_ms")));
  EXPECT_LT(std::stod(by_point["5mbit/int8"]->at("measured_fetched_bytes")),
            std::stod(by_point["5mbit/bf16"]->at("measured_fetched_bytes")));
  // The planner agrees on both: a slower link, a longer predicted step; int8
  // weights, a shorter one on the slow link.
  EXPECT_GT(std::stod(by_point["5mbit/bf16"]->at("predicted_step_ms")),
            std::stod(by_point["20mbit/bf16"]->at("predicted_step_ms")));
  EXPECT_LT(std::stod(by_point["5mbit/int8"]->at("predicted_step_ms")),
            std::stod(by_point["5mbit/bf16"]->at("predicted_step_ms")));

  const std::string figure = out + "/sweep_delay_1ms.png";
  EXPECT_THAT(log, HasSubstr(figure));
  EXPECT_TRUE(IsValidPng(figure));
  // pshard plot draws the same figures from the CSV alone.
  std::filesystem::remove(figure);
  const CommandResult plot = RunCommand(std::string(PSHARD_BIN_DIR) + "/pshard plot " + out + "/results.csv 2>&1");
  ASSERT_EQ(plot.exit_code, 0) << plot.output;
  EXPECT_THAT(plot.output, HasSubstr(figure));
  EXPECT_TRUE(IsValidPng(figure));
}

// --topology as an axis: trainer 1 behind a link of its own, trainer 0
// beside nothing slow; the planner and the runs follow each file, and the
// calibration runs on a copy without the links' rates and delays.
TEST(SweepE2E, ATopologyIsPlannedAndRunAsItPlacesTheJob) {
  const std::string out = MakeRunDir();
  std::vector<std::string> files;
  for (const char* rate : {"20mbit", "5mbit"}) {
    files.push_back(absl::StrCat(out, "/far-", rate, ".json"));
    std::ofstream(files.back()) << absl::StrCat(
        R"({"nodes": [{"name": "s", "servers": ["shard:0", "shard:1"]}, {"name": "t0", "trainers": [0]},
                      {"name": "t1", "trainers": [1]}],
            "links": [{"between": ["s", "t1"], "kind": "ethernet", "rate": ")",
        rate, R"(", "delay": "1ms"}]})");
  }
  std::vector<std::string> grid = {"--servers=2", "--trainers=2", "--layers=1", "--d_model=32", "--heads=2",
                                   "--context=16", "--seq_len=16", "--batch=4",
                                   "--topology=" + files[0] + "," + files[1]};
  std::optional<int> code = RunToEnd(SweepArgv(out, {}, grid), out + "/sweep.log");
  ASSERT_EQ(code, 0) << ReadFile(out + "/sweep.log");
  const std::string unshaped = ReadFile(out + "/topology-unshaped.json");
  EXPECT_THAT(unshaped, HasSubstr("\"t1\""));
  EXPECT_EQ(unshaped.find("rate"), std::string::npos) << unshaped;
  const std::vector<Row> rows = ReadCsv(out + "/results.csv");
  ASSERT_EQ(rows.size(), 2u);
  std::map<std::string, const Row*> by_file;
  for (const Row& r : rows) {
    by_file[r.at("topology")] = &r;
    EXPECT_EQ(r.at("measured_fetched_bytes"), r.at("predicted_fetched_bytes"));
    EXPECT_EQ(r.at("measured_pushed_bytes"), r.at("predicted_pushed_bytes"));
  }
  ASSERT_TRUE(by_file.count(files[0]) && by_file.count(files[1]));
  // The slower link of its own is a longer step, measured and predicted.
  EXPECT_GT(std::stod(by_file[files[1]]->at("measured_step_ms")),
            1.5 * std::stod(by_file[files[0]]->at("measured_step_ms")));
  EXPECT_GT(std::stod(by_file[files[1]]->at("predicted_step_ms")),
            1.5 * std::stod(by_file[files[0]]->at("predicted_step_ms")));
  EXPECT_THAT(ReadFile(out + "/points/1/trainer1.log"), HasSubstr("links shaped by the topology (node t1: to s"));
}

// --loss_steps: each point's held-out loss after that many steps, the loss
// the same job reports trained alone and unshaped (emulated links change no
// number); the encodings give different losses.
TEST(SweepE2E, PointsReportTheHeldOutLossAfterTheStepsAsked) {
  const std::string out = MakeRunDir();
  const std::string val = std::string(PSHARD_SOURCE_DIR) + "/README.md";
  std::vector<std::string> grid = GridFlags();
  grid[grid.size() - 2] = "--link_rate=20mbit";
  grid.back() = "--grad_encoding=bf16,int4";
  grid.push_back("--val_data=" + val);
  std::optional<int> code = RunToEnd(SweepArgv(out, {"--loss_steps=12"}, grid), out + "/sweep.log");
  ASSERT_EQ(code, 0) << ReadFile(out + "/sweep.log");
  std::map<std::string, double> loss;
  for (const Row& r : ReadCsv(out + "/results.csv")) loss[r.at("grad_encoding")] = std::stod(r.at("measured_val_loss"));
  ASSERT_EQ(loss.size(), 2u);
  EXPECT_NE(loss["bf16"], loss["int4"]);

  const std::string run_dir = MakeRunDir();
  std::vector<std::string> alone = {"--servers=2", "--trainers=2", "--layers=1", "--d_model=32", "--heads=2",
                                    "--context=16", "--seq_len=16", "--batch=4", "--grad_encoding=int4",
                                    "--steps=12", "--eval_every=12", "--val_data=" + val, "--log_every=0"};
  auto launcher = StartLocal(run_dir, alone);
  ASSERT_TRUE(launcher.ok()) << launcher.status();
  ASSERT_EQ(launcher->WaitUntil(absl::Now() + absl::Minutes(2)), 0) << ReadFile(run_dir + "/launcher.log");
  const std::string log = ReadFile(run_dir + "/launcher.log");
  EXPECT_THAT(log, HasSubstr(absl::StrFormat("eval after step 12 | val loss %.5f ", loss["int4"])));
}

int ResultsIn(const std::string& csv) { return static_cast<int>(ReadCsv(csv).size()); }

TEST(SweepE2E, AKilledSweepResumesWithoutRedoingFinishedPoints) {
  const std::string out = MakeRunDir();
  // Three points: one or two finish before the sweep is stopped.
  std::vector<std::string> grid = GridFlags();
  grid.back() = "--weight_encoding=bf16";
  grid[grid.size() - 2] = "--link_rate=20mbit,10mbit,5mbit";
  absl::StatusOr<ChildProcess> sweep = ChildProcess::Spawn(SweepArgv(out, {}, grid), out + "/first.log");
  ASSERT_TRUE(sweep.ok()) << sweep.status();
  // Interrupt it once a point is in the results.
  const absl::Time deadline = absl::Now() + absl::Minutes(3);
  while (ResultsIn(out + "/results.csv") < 1 && absl::Now() < deadline) {
    ASSERT_FALSE(sweep->Poll().has_value()) << ReadFile(out + "/first.log");
    absl::SleepFor(absl::Milliseconds(100));
  }
  sweep->Signal(SIGTERM);
  std::optional<int> code = sweep->WaitUntil(absl::Now() + absl::Minutes(1));
  ASSERT_TRUE(code.has_value());
  const int finished = ResultsIn(out + "/results.csv");
  ASSERT_GE(finished, 1);
  if (finished < 3) {
    EXPECT_EQ(*code, 130) << ReadFile(out + "/first.log");
    EXPECT_THAT(ReadFile(out + "/first.log"), HasSubstr("run the same command again to resume"));
  }
  EXPECT_EQ(CountProcessesMentioning(out), 0) << "the interrupted point left processes behind";

  code = RunToEnd(SweepArgv(out, {}, grid), out + "/second.log");
  const std::string second = ReadFile(out + "/second.log");
  ASSERT_EQ(code, 0) << second;
  EXPECT_THAT(second, HasSubstr(absl::StrCat("resuming: ", finished, " points")));
  EXPECT_THAT(second, ::testing::Not(HasSubstr("calibrating")));
  // Only the points not yet measured ran again.
  int started = 0;
  for (size_t at = second.find("| ETA"); at != std::string::npos; at = second.find("| ETA", at + 1)) ++started;
  EXPECT_EQ(started, 3 - finished) << second;
  EXPECT_EQ(ResultsIn(out + "/results.csv"), 3);
}

TEST(SweepE2E, BadGridsAreRefusedBeforeAnythingStarts) {
  const std::pair<std::vector<std::string>, std::string> cases[] = {
      {{"--link_rate=100mbit", "--no_such_flag=1,2"}, "--no_such_flag is not a flag of pshard local"},
      {{"--link_rate=fast,100mbit"}, "link rate 'fast' is not a number"},
      {{"--prefetch=1,x"}, "--prefetch=x"},
      {{"--prefetch="}, "the grid would be empty"},
      {{}, "the grid is empty"},
      {{"--steps=10,20"}, "--steps cannot vary"},
      {{"--link_rate=100mbit", "--loss_steps=5"}, "--loss_steps needs held-out text"},
      {{"--link_rate=100mbit", "--eval_every=5"}, "--eval_every cannot vary"},
  };
  for (const auto& [flags, message] : cases) {
    const std::string out = MakeRunDir() + "/sweep";
    std::vector<std::string> argv = {std::string(PSHARD_BIN_DIR) + "/pshard", "sweep", "--out=" + out};
    argv.insert(argv.end(), flags.begin(), flags.end());
    const std::string log = out + ".log";
    std::optional<int> code = RunToEnd(argv, log);
    EXPECT_EQ(code, 2) << message << "\n" << ReadFile(log);
    EXPECT_THAT(ReadFile(log), HasSubstr(message));
    EXPECT_FALSE(std::filesystem::exists(out)) << "the sweep started for " << message;
  }
}

}  // namespace
}  // namespace pshard
