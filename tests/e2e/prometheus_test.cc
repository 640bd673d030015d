// End to end: a real Prometheus scrapes a real `pshard local` cluster, every
// query of the Grafana dashboard returns data from it, and the shipped
// Prometheus config and every /metrics endpoint pass promtool.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gtest/gtest.h"
#include "common/json.h"
#include "tests/e2e/e2e_util.h"
#include "tools/cluster_status.h"

namespace pshard {
namespace {

constexpr char kPrometheus[] = "/usr/bin/prometheus";
constexpr char kPromtool[] = "/usr/bin/promtool";
constexpr int kServers = 2;
constexpr int kTrainers = 2;

// Every string value of `key`, at any depth, in `v`.
void CollectStrings(const JsonValue& v, const std::string& key, std::vector<std::string>* out) {
  if (v.is_array()) {
    for (const JsonValue& item : v.as_array()) CollectStrings(item, key, out);
  } else if (v.is_object()) {
    for (const auto& [name, member] : v.as_object()) {
      if (name == key && member.is_string()) out->push_back(member.as_string());
      CollectStrings(member, key, out);
    }
  }
}

// Every string value of `key`, at any depth, in the JSON document `json`.
absl::StatusOr<std::vector<std::string>> StringValuesOf(const std::string& json, const std::string& key) {
  absl::StatusOr<JsonValue> document = ParseJson(json);
  if (!document.ok()) return document.status();
  std::vector<std::string> values;
  CollectStrings(*document, key, &values);
  return values;
}

// ---- Grafana template variables and the Prometheus HTTP API ----

// What Grafana would send with every variable set to All, over a 1 s scrape.
std::string Substitute(const std::string& expr) {
  std::string out = expr;
  for (const char* name : {"job", "rank", "shard"}) {
    out = absl::StrReplaceAll(out, {{absl::StrCat("${", name, "}"), ".*"}});
    out = absl::StrReplaceAll(out, {{absl::StrCat("$", name), ".*"}});
  }
  return absl::StrReplaceAll(out, {{"${__rate_interval}", "5s"}, {"$__rate_interval", "5s"},
                                   {"${__interval}", "2s"}, {"$__interval", "2s"}});
}

// GET on a loopback port; the body of a 200 answer.
absl::StatusOr<std::string> Get(int port, const std::string& path) {
  return HttpGet(absl::StrCat("127.0.0.1:", port), path, absl::Seconds(10));
}

// Empty when `promql` returns at least one sample that is a number; else
// what went wrong.
std::string ProblemWithQuery(int port, const std::string& promql) {
  absl::StatusOr<std::string> r = Get(port, "/api/v1/query?query=" + UrlEncode(promql));
  if (!r.ok()) return r.status().ToString();
  if (!absl::StrContains(*r, "\"status\":\"success\"")) return *r;
  if (absl::StrContains(*r, "\"result\":[]")) return "empty result";
  static const std::regex kSample(R"re("value":\[[^,\]]+,"([^"]*)"\])re");
  for (std::sregex_iterator it(r->begin(), r->end(), kSample), end; it != end; ++it) {
    if ((*it)[1] != "NaN") return "";
  }
  return absl::StrCat("no sample is a number: ", r->substr(0, 500));
}

int CountOf(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t p = text.find(needle); p != std::string::npos; p = text.find(needle, p + 1)) ++n;
  return n;
}

// A base port b in [20000, 40000) with b + offset free for every offset.
int FreePortBase(const std::vector<int>& offsets, const std::vector<int>& taken = {}) {
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> base(20000, 39800);
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int b = base(rng);
    bool free = true;
    for (int offset : offsets) {
      free = free && PortIsFree(b + offset) && std::find(taken.begin(), taken.end(), b + offset) == taken.end();
    }
    if (free) return b;
  }
  return 0;
}

// Stops a child on the way out of a test that failed half-way.
class StopOnExit {
 public:
  StopOnExit(ChildProcess& child, int signo) : child_(child), signo_(signo) {}
  ~StopOnExit() {
    if (child_.Poll()) return;
    child_.Signal(signo_);
    if (!child_.WaitUntil(absl::Now() + absl::Seconds(30))) child_.Signal(SIGKILL);
    child_.WaitUntil(absl::Now() + absl::Seconds(5));
  }

 private:
  ChildProcess& child_;
  const int signo_;
};

// ---- Tests ----

TEST(PrometheusE2E, ShippedConfigIsValid) {
  if (access(kPromtool, X_OK) != 0) GTEST_SKIP() << kPromtool << " is not installed";
  const std::string config = std::string(PSHARD_SOURCE_DIR) + "/dashboards/prometheus/prometheus.yml";
  const CommandResult check = RunCommand(absl::StrCat(kPromtool, " check config ", config, " 2>&1"));
  EXPECT_EQ(check.exit_code, 0) << check.output;
}

TEST(PrometheusE2E, JsonStringValuesAreUnescaped) {
  absl::StatusOr<std::vector<std::string>> values = StringValuesOf(
      R"({"expr": "a{b=\"c\"} \\ \u00e9", "x": {"expr" :"2", "y": ["expr", 3]}, "z": {"expr": 4}})", "expr");
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_EQ(*values, (std::vector<std::string>{"a{b=\"c\"} \\ \xC3\xA9", "2"}));
  EXPECT_FALSE(StringValuesOf(R"({"expr": "\q"})", "expr").ok());
  EXPECT_FALSE(StringValuesOf(R"({"expr": "open)", "expr").ok());
}

TEST(PrometheusE2E, DashboardQueriesReturnDataFromALiveCluster) {
  if (access(kPrometheus, X_OK) != 0 || access(kPromtool, X_OK) != 0) {
    GTEST_SKIP() << kPrometheus << " or " << kPromtool << " is not installed";
  }
  const std::string dashboard = ReadFile(std::string(PSHARD_SOURCE_DIR) + "/dashboards/grafana/pshard.json");
  absl::StatusOr<std::vector<std::string>> exprs = StringValuesOf(dashboard, "expr");
  ASSERT_TRUE(exprs.ok()) << exprs.status();
  ASSERT_FALSE(exprs->empty()) << "no \"expr\" in the dashboard";
  absl::StatusOr<std::vector<std::string>> variable_queries = StringValuesOf(dashboard, "query");
  ASSERT_TRUE(variable_queries.ok()) << variable_queries.status();

  const std::string run_dir = MakeRunDir();
  std::vector<int> cluster_ports;
  const int base = FreePortBase({0, 1, 100, 101});
  ASSERT_NE(base, 0) << "no free metrics ports";
  for (int s = 0; s < kServers; ++s) cluster_ports.push_back(base + s);
  for (int r = 0; r < kTrainers; ++r) cluster_ports.push_back(base + 100 + r);
  const int prometheus_port = FreePortBase({0}, cluster_ports);
  ASSERT_NE(prometheus_port, 0) << "no free port for Prometheus";

  // Trainer 0 evaluates too, for the held-out loss's series.
  const std::string val = run_dir + "/val.txt";
  std::ofstream(val) << std::string(20, 'x') << " held-out text for the dashboard's held-out loss, long enough for "
                     << "a sequence of 32 tokens and then some more of it.\n";
  absl::StatusOr<ChildProcess> launcher = StartLocal(
      run_dir, {absl::StrCat("--servers=", kServers), absl::StrCat("--trainers=", kTrainers), "--steps=100000",
                "--layers=2", "--d_model=64", "--heads=2", "--context=32", "--seq_len=32",
                absl::StrCat("--val_data=", val), "--eval_every=5", "--val_batches=2",
                absl::StrCat("--metrics_port_base=", base)});
  ASSERT_TRUE(launcher.ok()) << launcher.status();
  StopOnExit stop_launcher(*launcher, SIGINT);
  const std::string config = run_dir + "/prometheus.yml";
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (!std::filesystem::exists(config) && absl::Now() < deadline) {
    ASSERT_FALSE(launcher->Poll().has_value()) << ReadFile(run_dir + "/launcher.log");
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE(std::filesystem::exists(config)) << ReadFile(run_dir + "/launcher.log");

  absl::StatusOr<ChildProcess> prometheus = ChildProcess::Spawn(
      {kPrometheus, "--config.file=" + config, "--storage.tsdb.path=" + run_dir + "/tsdb",
       absl::StrCat("--web.listen-address=127.0.0.1:", prometheus_port)},
      run_dir + "/prometheus.log");
  ASSERT_TRUE(prometheus.ok()) << prometheus.status();
  StopOnExit stop_prometheus(*prometheus, SIGTERM);

  // All targets up, then enough scrapes for rates over 5 s windows.
  int up = 0;
  while (up < kServers + kTrainers && absl::Now() < deadline) {
    ASSERT_FALSE(prometheus->Poll().has_value()) << ReadFile(run_dir + "/prometheus.log");
    ASSERT_FALSE(launcher->Poll().has_value()) << ReadFile(run_dir + "/launcher.log");
    absl::StatusOr<std::string> targets = Get(prometheus_port, "/api/v1/targets");
    up = targets.ok() ? CountOf(*targets, "\"health\":\"up\"") : 0;
    absl::SleepFor(absl::Milliseconds(200));
  }
  ASSERT_EQ(up, kServers + kTrainers) << "targets not up within 60 s\n" << ReadFile(run_dir + "/prometheus.log");
  absl::SleepFor(absl::Seconds(10));
  ASSERT_FALSE(launcher->Poll().has_value()) << ReadFile(run_dir + "/launcher.log");

  for (const std::string& expr : *exprs) {
    const std::string promql = Substitute(expr);
    EXPECT_FALSE(absl::StrContains(promql, "$")) << "unsubstituted variable in " << expr;
    EXPECT_EQ(ProblemWithQuery(prometheus_port, promql), "") << "dashboard expression: " << expr;
  }
  // label_values(SELECTOR, LABEL) variable queries: some series carry LABEL.
  static const std::regex kLabelValues(R"(label_values\((.+), *(\w+)\))");
  for (const std::string& query : *variable_queries) {
    std::smatch m;
    if (!std::regex_match(query, m, kLabelValues)) continue;
    const std::string promql = Substitute(absl::StrCat("count by (", m[2].str(), ") (", m[1].str(), ")"));
    EXPECT_EQ(ProblemWithQuery(prometheus_port, promql), "") << "template variable query: " << query;
  }

  for (int port : cluster_ports) {
    absl::StatusOr<std::string> metrics = Get(port, "/metrics");
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    const std::string file = absl::StrCat(run_dir, "/metrics-", port, ".txt");
    std::ofstream(file) << *metrics;
    const CommandResult lint = RunCommand(absl::StrCat(kPromtool, " check metrics < ", file, " 2>&1"));
    EXPECT_EQ(lint.exit_code, 0) << "port " << port << ":\n" << lint.output;
    EXPECT_EQ(lint.output, "") << "port " << port;
  }

  prometheus->Signal(SIGTERM);
  std::optional<int> prometheus_code = prometheus->WaitUntil(absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(prometheus_code.has_value()) << "Prometheus did not stop within 30 s of SIGTERM";
  EXPECT_EQ(*prometheus_code, 0) << ReadFile(run_dir + "/prometheus.log");
  launcher->Signal(SIGINT);
  std::optional<int> launcher_code = launcher->WaitUntil(absl::Now() + absl::Seconds(60));
  ASSERT_TRUE(launcher_code.has_value()) << "launcher did not stop within 60 s of SIGINT";
  EXPECT_EQ(*launcher_code, 130) << ReadFile(run_dir + "/launcher.log");
  EXPECT_EQ(CountProcessesMentioning(run_dir), 0) << "processes left behind";
}

}  // namespace
}  // namespace pshard
