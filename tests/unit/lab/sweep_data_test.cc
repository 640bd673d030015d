// The sweep's data: grids from flag lists, step logs to measurements, and
// the results files it resumes from.
#include "lab/sweep.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <set>
#include <string>

#include "absl/strings/str_split.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pshard {
namespace {

using ::testing::HasSubstr;

bool IsFlag(const std::string& name) {
  static const std::set<std::string> known = {"link_rate", "link_delay", "prefetch", "weight_encoding", "steps"};
  return known.count(name) > 0;
}

const std::vector<std::pair<std::string, std::string>> kReserved = {{"steps", "the sweep sets it"}};

TEST(SweepGridTest, ListsBecomeAxesAndPointsVaryTheLastAxisFastest) {
  auto axes = ParseGrid({"--link_rate=1gbit,100mbit,30mbit", "--link_delay=0ms,5ms", "--prefetch=2"}, IsFlag,
                        kReserved);
  ASSERT_TRUE(axes.ok()) << axes.status();
  ASSERT_EQ(axes->size(), 3u);
  EXPECT_EQ((*axes)[0].values, (std::vector<std::string>{"1gbit", "100mbit", "30mbit"}));
  const std::vector<SweepPoint> points = GridPoints(*axes);
  ASSERT_EQ(points.size(), 6u);
  EXPECT_EQ(points[0].Key(), "link_rate=1gbit link_delay=0ms prefetch=2");
  EXPECT_EQ(points[1].Key(), "link_rate=1gbit link_delay=5ms prefetch=2");
  EXPECT_EQ(points[5].Key(), "link_rate=30mbit link_delay=5ms prefetch=2");
  EXPECT_EQ(points[3].Args(), (std::vector<std::string>{"--link_rate=100mbit", "--link_delay=5ms", "--prefetch=2"}));
  std::set<std::string> keys;
  for (const SweepPoint& p : points) keys.insert(p.Key());
  EXPECT_EQ(keys.size(), points.size());
}

TEST(SweepGridTest, BadGridsAreRefusedWithTheArgumentNamed) {
  const std::pair<std::vector<std::string>, std::string> cases[] = {
      {{"--no_such_flag=1,2"}, "--no_such_flag is not a flag of pshard local"},
      {{"--steps=5"}, "--steps cannot vary: the sweep sets it"},
      {{"--prefetch="}, "--prefetch= gives no values"},
      {{"--prefetch=,"}, "--prefetch= gives no values"},
      {{"--prefetch=1", "--prefetch=2"}, "--prefetch is given twice"},
      {{"prefetch=1"}, "'prefetch=1' is not --flag=value"},
      {{}, "the grid is empty"},
  };
  for (const auto& [args, message] : cases) {
    const absl::Status s = ParseGrid(args, IsFlag, kReserved).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << message;
    EXPECT_THAT(std::string(s.message()), HasSubstr(message));
  }
}

std::string WriteLog(const std::string& name, const std::string& text) {
  char dir[] = "/tmp/pshard-sweep-XXXXXX";
  EXPECT_NE(mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/" + name;
  std::ofstream(path) << text;
  return path;
}

std::string Record(int step, double wall, double compute, double exposed, double fetched) {
  return absl::StrCat("{\"step\": ", step, ", \"wall_seconds\": ", wall, ", \"compute_seconds\": ", compute,
                      ", \"comm_exposed_seconds\": ", exposed, ", \"comm_busy_seconds\": ", wall,
                      ", \"payload_fetched\": ", fetched, ", \"payload_pushed\": 10, \"tokens\": 100, \"loss\": 2.5}\n");
}

TEST(SweepMeasureTest, AveragesTheStepsAfterTheWarmUpOverEveryTrainer) {
  const std::string a = WriteLog("trainer0.steps.jsonl", Record(0, 9, 9, 9, 999) + Record(1, 0.2, 0.1, 0.1, 100) +
                                                            Record(2, 0.4, 0.1, 0.3, 100));
  const std::string b = WriteLog("trainer1.steps.jsonl", Record(0, 9, 9, 9, 999) + Record(1, 0.2, 0.1, 0.1, 200) +
                                                            Record(2, 0.2, 0.1, 0.1, 200));
  auto m = MeasureStepLogs({a, b}, 1);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->steps, 2);
  EXPECT_DOUBLE_EQ(m->step_seconds, 0.25);
  EXPECT_DOUBLE_EQ(m->compute_seconds, 0.1);
  EXPECT_DOUBLE_EQ(m->exposed_seconds, 0.15);
  EXPECT_DOUBLE_EQ(m->fetched_bytes, 150);
  EXPECT_DOUBLE_EQ(m->loss, 2.5);
  // Two trainers' 100 tokens per 0.25 s step.
  EXPECT_DOUBLE_EQ(m->tokens_per_second, 800);
}

TEST(SweepMeasureTest, MissingOrBrokenLogsAreErrors) {
  EXPECT_EQ(MeasureStepLogs({"/nonexistent/trainer0.steps.jsonl"}, 0).status().code(), absl::StatusCode::kNotFound);
  const std::string broken = WriteLog("t.jsonl", Record(0, 1, 1, 0, 1) + "{\"step\": 1,\n");
  EXPECT_THAT(std::string(MeasureStepLogs({broken}, 0).status().message()), HasSubstr("t.jsonl:2"));
  const std::string short_log = WriteLog("t.jsonl", Record(0, 1, 1, 0, 1));
  EXPECT_THAT(std::string(MeasureStepLogs({short_log}, 3).status().message()), HasSubstr("no step at or after step 3"));
}

TEST(SweepResultsTest, JsonReadsBackAndCsvHasAColumnPerFlagAndFigure) {
  SweepResults results;
  results.calibration = Calibration{9e10, 0.4, 0.025, "as given"};
  for (const char* rate : {"100mbit", "30mbit"}) {
    SweepResult r;
    r.point.flags = {{"link_rate", rate}, {"prefetch", "2"}};
    r.measured.steps = 5;
    r.measured.step_seconds = 0.5;
    r.measured.fetched_bytes = 1234;
    r.predicted.step = 0.45;
    r.predicted.compute = 0.1;
    r.predicted.exposed = 0.35;
    r.predicted_bytes.fetched = 1234;
    r.link_bytes_per_second = 12.5e6;
    r.knee_bytes_per_second = 50e6;
    results.results.push_back(r);
  }
  auto back = SweepResultsFromJson(SweepResultsToJson(results));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(FormatJson(SweepResultsToJson(*back)), FormatJson(SweepResultsToJson(results)));
  ASSERT_NE(back->Find("link_rate=30mbit prefetch=2"), nullptr);
  EXPECT_EQ(back->Find("link_rate=1gbit prefetch=2"), nullptr);

  const std::vector<std::string> lines = absl::StrSplit(SweepResultsToCsv(results), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u);
  const std::vector<std::string> header = absl::StrSplit(lines[0], ',');
  EXPECT_EQ(header[0], "point");
  EXPECT_EQ(header[1], "link_rate");
  EXPECT_EQ(header[2], "prefetch");
  EXPECT_EQ(header.back(), "step_error");
  const std::vector<std::string> row = absl::StrSplit(lines[1], ',');
  ASSERT_EQ(row.size(), header.size());
  auto cell = [&](const std::string& column) {
    return row[std::find(header.begin(), header.end(), column) - header.begin()];
  };
  EXPECT_EQ(cell("link_rate"), "100mbit");
  EXPECT_EQ(cell("link_mbit"), "100");
  EXPECT_EQ(cell("measured_step_ms"), "500.000");
  EXPECT_EQ(cell("predicted_step_ms"), "450.000");
  EXPECT_EQ(cell("predicted_fetched_bytes"), "1234");
  EXPECT_EQ(cell("knee_mbit"), "400");
  EXPECT_EQ(cell("step_error"), "-0.1000");
  EXPECT_EQ(cell("predicted_comm_bound"), "1");
}

}  // namespace
}  // namespace pshard
