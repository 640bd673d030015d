#include "common/metrics/metrics.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace pshard::metrics {
namespace {

// The value of the one sample line that starts with `series` + " ".
std::string SampleValue(const std::string& text, const std::string& series) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(series + " ", 0) == 0) return line.substr(series.size() + 1);
  }
  return "<missing " + series + ">";
}

TEST(MetricsTest, SerializesSmallRegistryExactly) {
  Registry registry;
  auto& requests = registry.AddCounter("pshard_requests_total", "Requests served.");
  requests.Add({}).Increment(3);
  requests.Add({{"transport", "grpc"}, {"code", "ok"}}).Increment(2.5);
  registry.AddGauge("pshard_queue_depth", "Queued requests.").Add({}).Set(-4);
  registry.AddGauge("pshard_idle", "Nothing yet.");
  auto& fetch =
      registry.AddHistogram("pshard_fetch_seconds", "Fetch latency.", {0.005, 0.5, 1, 2.5});
  Histogram& shard0 = fetch.Add({{"shard", "0"}});
  shard0.Observe(0.25);
  shard0.Observe(0.5);  // le: counted in the 0.5 bucket
  shard0.Observe(3);

  EXPECT_EQ(registry.Serialize(),
            "# HELP pshard_fetch_seconds Fetch latency.\n"
            "# TYPE pshard_fetch_seconds histogram\n"
            "pshard_fetch_seconds_bucket{shard=\"0\",le=\"0.005\"} 0\n"
            "pshard_fetch_seconds_bucket{shard=\"0\",le=\"0.5\"} 2\n"
            "pshard_fetch_seconds_bucket{shard=\"0\",le=\"1\"} 2\n"
            "pshard_fetch_seconds_bucket{shard=\"0\",le=\"2.5\"} 2\n"
            "pshard_fetch_seconds_bucket{shard=\"0\",le=\"+Inf\"} 3\n"
            "pshard_fetch_seconds_sum{shard=\"0\"} 3.75\n"
            "pshard_fetch_seconds_count{shard=\"0\"} 3\n"
            "# HELP pshard_idle Nothing yet.\n"
            "# TYPE pshard_idle gauge\n"
            "# HELP pshard_queue_depth Queued requests.\n"
            "# TYPE pshard_queue_depth gauge\n"
            "pshard_queue_depth -4\n"
            "# HELP pshard_requests_total Requests served.\n"
            "# TYPE pshard_requests_total counter\n"
            "pshard_requests_total 3\n"
            "pshard_requests_total{code=\"ok\",transport=\"grpc\"} 2.5\n");
}

TEST(MetricsTest, HistogramWithoutLabels) {
  Registry registry;
  registry.AddHistogram("h_seconds", "H.", {1}).Add({}).Observe(1);
  EXPECT_EQ(registry.Serialize(),
            "# HELP h_seconds H.\n"
            "# TYPE h_seconds histogram\n"
            "h_seconds_bucket{le=\"1\"} 1\n"
            "h_seconds_bucket{le=\"+Inf\"} 1\n"
            "h_seconds_sum 1\n"
            "h_seconds_count 1\n");
}

TEST(MetricsTest, EscapesHelpAndLabelValues) {
  Registry registry;
  registry.AddGauge("g", "back\\slash\nnew \"quoted\"")
      .Add({{"path", "C:\\dir\n\"x\""}})
      .Set(1);
  EXPECT_EQ(registry.Serialize(),
            "# HELP g back\\\\slash\\nnew \"quoted\"\n"
            "# TYPE g gauge\n"
            "g{path=\"C:\\\\dir\\n\\\"x\\\"\"} 1\n");
}

TEST(MetricsTest, SortsFamiliesAndLabels) {
  Registry registry;
  registry.AddGauge("zeta", "z").Add({{"b", "2"}, {"a", "1"}}).Set(1);
  registry.AddCounter("alpha_total", "a").Add({{"y", "1"}}).Increment();
  registry.AddCounter("alpha_total", "a").Add({{"x", "1"}}).Increment();
  registry.AddHistogram("mid", "m", {});
  EXPECT_EQ(registry.Serialize(),
            "# HELP alpha_total a\n# TYPE alpha_total counter\n"
            "alpha_total{x=\"1\"} 1\nalpha_total{y=\"1\"} 1\n"
            "# HELP mid m\n# TYPE mid histogram\n"
            "# HELP zeta z\n# TYPE zeta gauge\n"
            "zeta{a=\"1\",b=\"2\"} 1\n");
}

TEST(MetricsTest, FormatsValues) {
  Registry registry;
  auto& g = registry.AddGauge("g", "");
  const auto value = [&](double v) {
    g.Add({}).Set(v);
    return SampleValue(registry.Serialize(), "g");
  };
  EXPECT_EQ(value(0), "0");
  EXPECT_EQ(value(-0.0), "0");
  EXPECT_EQ(value(42), "42");
  EXPECT_EQ(value(1e6), "1000000");
  EXPECT_EQ(value(9007199254740993.0), "9007199254740992");
  EXPECT_EQ(value(1e20), "1e+20");
  EXPECT_EQ(value(0.1), "0.1");
  EXPECT_EQ(value(-2.5), "-2.5");
  EXPECT_EQ(value(1e-9), "1e-09");
  EXPECT_EQ(value(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(value(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(value(std::nan("")), "NaN");
  for (double v : {1.0 / 3, std::nextafter(1.0, 2.0), 123456.789e-300, 6.02214076e23, -1e-320}) {
    EXPECT_EQ(std::strtod(value(v).c_str(), nullptr), v) << value(v);
  }
}

TEST(MetricsTest, CounterIgnoresNegativeAndNaN) {
  Counter c;
  c.Increment(2);
  c.Increment(-1);
  c.Increment(std::nan(""));
  EXPECT_EQ(c.Value(), 2);
}

TEST(MetricsTest, GaugeGoesUpAndDown) {
  Gauge g;
  g.Increment(5);
  g.Decrement(2);
  EXPECT_EQ(g.Value(), 3);
  g.Set(-1.5);
  EXPECT_EQ(g.Value(), -1.5);
}

TEST(MetricsTest, HistogramBucketsUseLessOrEqual) {
  Histogram h({1, 2, 4});
  for (double v : {-5.0, 1.0, 1.5, 2.0, 4.0, 4.5, std::nan("")}) h.Observe(v);
  const Histogram::Snapshot s = h.Collect();
  EXPECT_EQ(s.bounds, (std::vector<double>{1, 2, 4}));
  EXPECT_EQ(s.cumulative_counts, (std::vector<uint64_t>{2, 4, 5, 7}));
  EXPECT_EQ(s.count, 7u);
  EXPECT_TRUE(std::isnan(s.sum));
}

TEST(MetricsTest, HistogramDropsExplicitInfBound) {
  Histogram h({1, std::numeric_limits<double>::infinity()});
  EXPECT_EQ(h.Collect().bounds, std::vector<double>{1});
}

TEST(MetricsTest, ExponentialBounds) {
  EXPECT_EQ(Histogram::ExponentialBounds(1, 2, 4), (std::vector<double>{1, 2, 4, 8}));
  EXPECT_EQ(Histogram::ExponentialBounds(0.5, 10, 1), std::vector<double>{0.5});
}

TEST(MetricsTest, FamilyAddReturnsSameMetricForSameLabels) {
  Registry registry;
  auto& family = registry.AddCounter("c_total", "c");
  Counter& a = family.Add({{"k", "v"}});
  EXPECT_EQ(&family.Add({{"k", "v"}}), &a);
  EXPECT_NE(&family.Add({{"k", "w"}}), &a);
  EXPECT_NE(&family.Add({}), &a);
}

TEST(MetricsTest, ReRegisteringReturnsSameFamily) {
  Registry registry;
  auto& counter = registry.AddCounter("c_total", "c");
  EXPECT_EQ(&registry.AddCounter("c_total", "c"), &counter);
  auto& gauge = registry.AddGauge("g", "g");
  EXPECT_EQ(&registry.AddGauge("g", "g"), &gauge);
  auto& histogram = registry.AddHistogram("h", "h", {1, 2});
  EXPECT_EQ(&registry.AddHistogram("h", "h", {1, 2}), &histogram);
  EXPECT_EQ(histogram.Add({}).Collect().bounds, (std::vector<double>{1, 2}));
}

TEST(MetricsTest, ConcurrentIncrementsAreExact) {
  constexpr int kThreads = 8;
  constexpr int kPerThread = 100000;
  Registry registry;
  auto& counters = registry.AddCounter("ops_total", "Ops.");
  auto& histograms = registry.AddHistogram("v", "Values.", {0, 4.5, 8.5});
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      // Every thread looks the metrics up itself: Add must agree too.
      Counter& counter = counters.Add({{"kind", "shared"}});
      Histogram& histogram = histograms.Add({});
      for (int i = 0; i < kPerThread; ++i) {
        counter.Increment();
        histogram.Observe(i % 10);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(counters.Add({{"kind", "shared"}}).Value(), kThreads * kPerThread);
  const Histogram::Snapshot s = histograms.Add({}).Collect();
  EXPECT_EQ(s.count, static_cast<uint64_t>(kThreads) * kPerThread);
  EXPECT_EQ(s.sum, kThreads * (kPerThread / 10) * 45.0);
  const uint64_t per_value = kThreads * kPerThread / 10;
  EXPECT_EQ(s.cumulative_counts, (std::vector<uint64_t>{per_value, 5 * per_value,
                                                        9 * per_value, 10 * per_value}));
}

TEST(MetricsTest, PromtoolFindsNoProblems) {
  constexpr char kPromtool[] = "/usr/bin/promtool";
  if (std::FILE* f = std::fopen(kPromtool, "r"); f != nullptr) {
    std::fclose(f);
  } else {
    GTEST_SKIP() << kPromtool << " is not installed";
  }
  Registry registry;
  auto& bytes = registry.AddCounter("pshard_fetch_bytes_total", "Bytes fetched from shards.");
  bytes.Add({{"transport", "grpc"}}).Increment(1 << 20);
  bytes.Add({{"transport", "ucx"}}).Increment(12345);
  registry.AddGauge("pshard_inflight_requests", "Requests being served.\nSecond \\ line.")
      .Add({{"shard", "a\"b"}})
      .Set(3);
  auto& step = registry.AddHistogram("pshard_step_seconds", "Training step time.",
                                     Histogram::ExponentialBounds(0.005, 2, 8));
  step.Add({{"rank", "0"}}).Observe(0.02);
  step.Add({{"rank", "1"}}).Observe(7);
  registry.AddCounter("pshard_retries_total", "Retries (none yet).");

  const std::string out_path = testing::TempDir() + "/promtool_check_metrics.out";
  const std::string command = std::string(kPromtool) + " check metrics > " + out_path + " 2>&1";
  std::FILE* pipe = popen(command.c_str(), "w");
  ASSERT_NE(pipe, nullptr);
  const std::string text = registry.Serialize();
  std::fwrite(text.data(), 1, text.size(), pipe);
  const int status = pclose(pipe);
  std::ifstream out_file(out_path);
  const std::string report((std::istreambuf_iterator<char>(out_file)), {});
  std::remove(out_path.c_str());
  EXPECT_EQ(status, 0) << report << "\ninput:\n" << text;
  EXPECT_EQ(report, "") << "input:\n" << text;
}

using MetricsDeathTest = testing::Test;

TEST(MetricsDeathTest, TypeClashAborts) {
  Registry registry;
  registry.AddCounter("x_total", "x");
  EXPECT_DEATH(registry.AddGauge("x_total", "x"), "already registered");
  EXPECT_DEATH(registry.AddHistogram("x_total", "x", {1}), "already registered");
}

TEST(MetricsDeathTest, HistogramBoundsClashAborts) {
  Registry registry;
  registry.AddHistogram("h", "h", {1, 2});
  EXPECT_DEATH(registry.AddHistogram("h", "h", {1, 3}), "other bounds");
}

TEST(MetricsDeathTest, BadNamesAbort) {
  Registry registry;
  EXPECT_DEATH(registry.AddCounter("1abc", "x"), "invalid metric name \"1abc\"");
  EXPECT_DEATH(registry.AddGauge("a-b", "x"), "invalid metric name");
  EXPECT_DEATH(registry.AddGauge("", "x"), "invalid metric name");
  EXPECT_DEATH(registry.AddGauge("__reserved", "x"), "invalid metric name");
  auto& gauge = registry.AddGauge("ns:sub_name", "colons are allowed in metric names");
  EXPECT_DEATH(gauge.Add({{"a:b", "v"}}), "invalid label name \"a:b\"");
  EXPECT_DEATH(gauge.Add({{"__name", "v"}}), "invalid label name");
  EXPECT_DEATH(gauge.Add({{"9", "v"}}), "invalid label name");
  gauge.Add({{"_ok9", "v"}});
}

TEST(MetricsDeathTest, BadHistogramsAbort) {
  Registry registry;
  EXPECT_DEATH(registry.AddHistogram("h", "h", {2, 1}), "strictly ascending");
  EXPECT_DEATH(registry.AddHistogram("h", "h", {1, 1}), "strictly ascending");
  EXPECT_DEATH(registry.AddHistogram("h", "h", {std::nan("")}), "strictly ascending");
  EXPECT_DEATH(registry.AddHistogram("h", "h", {1}).Add({{"le", "1"}}), "reserved");
  EXPECT_DEATH(Histogram::ExponentialBounds(0, 2, 3), "ExponentialBounds");
}

}  // namespace
}  // namespace pshard::metrics
