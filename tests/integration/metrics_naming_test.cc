// Prometheus conventions for every metric the shard servers and trainers
// export, checked on what real servers and trainers serve after training;
// and docs/metrics.md kept in step with the names.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/testutil/local_cluster.h"
#include "tools/cluster_status.h"
#include "trainer_client/data/default_corpus.h"
#include "trainer_client/trainer.h"
#include "trainer_client/trainer_metrics.h"
#include "trainer_client/model/gpt_spec.h"

namespace pshard::testing {
namespace {

constexpr int kShards = 2;
constexpr int kTrainers = 2;
constexpr int kLayers = 2;
constexpr int kUnits = kLayers + 2;  // embedding, blocks, final norm + head
constexpr int kBatch = 2;
constexpr int kSeqLen = 8;

// Every label name a pshard metric may carry; docs/metrics.md describes each.
const std::set<std::string>& AllowedLabels() {
  static const auto* labels = new std::set<std::string>{
      "shard", "rank", "transport", "direction", "phase", "for", "kind",
      "method", "reason", "unit", "role", "version", "device", "collective",
      // pshard_trainer_config_info: one value each per trainer.
      "prefetch", "encoding", "link", "micro_batches", "accumulation", "recompute", "fabric_group_size"};
  return *labels;
}

// Name parts that are not base units (Prometheus wants seconds and bytes).
const std::set<std::string>& NonBaseUnits() {
  static const auto* units = new std::set<std::string>{
      "ms", "msec", "millis", "milliseconds", "us", "usec", "micros", "microseconds", "ns", "nanos",
      "nanoseconds", "minutes", "hours", "kb", "mb", "gb", "kib", "mib", "gib", "kbytes", "mbytes",
      "bits", "percent"};
  return *units;
}

JobConfig TinyJob() {
  JobConfig job;
  job.model = MakeGptSpec(GptConfig{.num_layers = kLayers, .d_model = 16, .num_heads = 2, .context = 8, .vocab = 256}).value();
  job.optimizer.total_steps = 10;
  job.num_shards = kShards;
  job.num_trainers = kTrainers;
  job.slice_alignment = 8;
  return job;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A sample's value, or a test failure and NaN.
double Value(const MetricsText& page, const std::string& name, const metrics::Labels& labels = {}) {
  absl::StatusOr<double> value = SampleValue(page, name, labels);
  EXPECT_TRUE(value.ok()) << value.status();
  return value.ok() ? *value : NAN;
}

// One process's /metrics page, as text and parsed.
struct Page {
  std::string who;  // "shard 0", "rank 1"
  std::string text;
  MetricsText parsed;
};

// Trains a small job over real servers with real trainers and keeps what
// every server and trainer serves after 2 and after 4 steps.
class MetricsNamingTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    static const TokenDataset* corpus = new TokenDataset(TokenDataset::FromText(DefaultCorpus()));
    auto cluster = LocalCluster::Start(TinyJob());
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
    for (int r = 0; r < kTrainers; ++r) {
      auto client = cluster_->Connect(r, WireEncoding::kBf16);
      ASSERT_TRUE(client.ok()) << client.status();
      TrainerOptions options{.batch = kBatch, .seq_len = kSeqLen, .prefetch_depth = 1, .data_seed = 3};
      auto trainer = Trainer::Create(client->get(), corpus, options);
      ASSERT_TRUE(trainer.ok()) << trainer.status();
      ranks_.push_back(Rank{std::move(*client), std::move(*trainer), std::make_unique<metrics::Registry>()});
      // A fixed peak, so that the MFU families are exported too.
      ranks_.back().metrics = std::make_unique<TrainerMetrics>(*ranks_.back().registry, r, "grpc", "cpu", 1e9);
      ranks_.back().metrics->SetSettings(SettingsOf(options, *ranks_.back().client, ranks_.back().trainer->model()));
    }
    ASSERT_NO_FATAL_FAILURE(Train(0, 2));
    after_two_ = Pages();
    ASSERT_NO_FATAL_FAILURE(Train(2, 4));
    after_four_ = Pages();
    trained_ = true;
  }

  void SetUp() override { ASSERT_TRUE(trained_) << "training the job failed (see above)"; }

  static void TearDownTestSuite() {
    ranks_.clear();
    cluster_.reset();
  }

  static void Train(int64_t first, int64_t end) {
    static const TokenDataset* val = new TokenDataset(TokenDataset::FromText(DefaultCorpus()));
    std::vector<absl::Status> results(kTrainers);
    std::vector<std::thread> threads;
    for (int r = 0; r < kTrainers; ++r) {
      threads.emplace_back([&, r] {
        for (int64_t step = first; step < end && results[r].ok(); ++step) {
          absl::StatusOr<StepReport> report = ranks_[r].trainer->RunStep(step);
          results[r] = report.status();
          if (report.ok()) ranks_[r].metrics->RecordStep(*report);
        }
        // And an evaluation on held-out data, for its families.
        if (results[r].ok()) {
          absl::StatusOr<EvalReport> eval = ranks_[r].trainer->Evaluate(end, *val, 1, 5);
          results[r] = eval.status();
          if (eval.ok()) ranks_[r].metrics->RecordEval(*eval);
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < kTrainers; ++r) ASSERT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r];
    // A trainer's step ends when its pushes are acknowledged; the servers
    // apply the update after that. Wait until they have recorded it.
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    for (int s = 0; s < kShards; ++s) {
      while (true) {
        absl::StatusOr<MetricsText> page = ParseMetricsText(cluster_->server(s).registry().Serialize());
        ASSERT_TRUE(page.ok()) << page.status();
        if (SampleValue(*page, "pshard_server_step").value_or(-1) == end) break;
        ASSERT_LT(absl::Now(), deadline) << "shard " << s << " did not finish step " << end - 1;
        absl::SleepFor(absl::Milliseconds(5));
      }
    }
  }

  static std::vector<Page> Pages() {
    std::vector<Page> pages;
    for (int s = 0; s < kShards; ++s) {
      pages.push_back({absl::StrCat("shard ", s), cluster_->server(s).registry().Serialize(), {}});
    }
    for (int r = 0; r < kTrainers; ++r) pages.push_back({absl::StrCat("rank ", r), ranks_[r].registry->Serialize(), {}});
    for (Page& page : pages) {
      absl::StatusOr<MetricsText> parsed = ParseMetricsText(page.text);
      EXPECT_TRUE(parsed.ok()) << page.who << ": " << parsed.status();
      if (parsed.ok()) page.parsed = std::move(*parsed);
    }
    return pages;
  }

  // The family a sample belongs to: its name, or a histogram's name without
  // _bucket, _sum or _count.
  static std::string FamilyOf(const MetricsText& page, const std::string& sample) {
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      if (!absl::EndsWith(sample, suffix)) continue;
      const std::string base = sample.substr(0, sample.size() - std::strlen(suffix));
      auto it = page.type.find(base);
      if (it != page.type.end() && it->second == "histogram") return base;
    }
    return sample;
  }

  struct Rank {
    std::unique_ptr<ShardClient> client;
    std::unique_ptr<Trainer> trainer;
    std::unique_ptr<metrics::Registry> registry;
    std::unique_ptr<TrainerMetrics> metrics;
  };
  static inline std::unique_ptr<LocalCluster> cluster_;
  static inline std::vector<Rank> ranks_;
  static inline std::vector<Page> after_two_, after_four_;  // every shard, then every rank
  static inline bool trained_ = false;
};

TEST_F(MetricsNamingTest, FamiliesFollowPrometheusConventions) {
  for (const Page& page : after_four_) {
    SCOPED_TRACE(page.who);
    ASSERT_FALSE(page.parsed.type.empty());
    for (const auto& [name, type] : page.parsed.type) {
      EXPECT_TRUE(absl::StartsWith(name, "pshard_")) << name;
      auto help = page.parsed.help.find(name);
      EXPECT_TRUE(help != page.parsed.help.end() && !help->second.empty()) << name << " has no # HELP";
      EXPECT_EQ(type == "counter", absl::EndsWith(name, "_total")) << name << " is a " << type;
      const std::vector<std::string> parts = absl::StrSplit(name, '_');
      for (size_t i = 0; i < parts.size(); ++i) {
        EXPECT_FALSE(NonBaseUnits().contains(parts[i])) << name << ": '" << parts[i] << "' is not a base unit";
        // A unit ends the name (before _total), as in _seconds_total.
        if (parts[i] == "seconds" || parts[i] == "bytes") {
          const size_t last = parts.size() - (parts.back() == "total" ? 2 : 1);
          EXPECT_EQ(i, last) << name << ": the unit '" << parts[i] << "' is not at the end";
        }
      }
    }
    for (const MetricsText::Sample& s : page.parsed.samples) {
      EXPECT_TRUE(page.parsed.type.contains(FamilyOf(page.parsed, s.name))) << s.name << " has no # TYPE";
    }
  }
}

TEST_F(MetricsNamingTest, LabelsAreAllowedAndBounded) {
  const std::string doc = ReadFile(PSHARD_SOURCE_DIR "/docs/metrics.md");
  for (const std::string& label : AllowedLabels()) {
    EXPECT_TRUE(absl::StrContains(doc, absl::StrCat("| `", label, "` |"))) << "label " << label << " is not in the "
                                                                           << "label table of docs/metrics.md";
  }
  // Labels that name a process or a unit stay within the job's counts.
  const std::map<std::string, int> index_labels = {
      {"shard", kShards}, {"rank", kTrainers}, {"unit", kUnits}};
  for (const Page& page : after_four_) {
    SCOPED_TRACE(page.who);
    for (const MetricsText::Sample& s : page.parsed.samples) {
      for (const auto& [key, value] : s.labels) {
        if (key == "le") {
          EXPECT_TRUE(absl::EndsWith(s.name, "_bucket")) << s.name;
          continue;
        }
        EXPECT_TRUE(AllowedLabels().contains(key)) << s.name << " has label " << key;
        auto bound = index_labels.find(key);
        if (bound == index_labels.end() || (key == "rank" && value == "tool")) continue;
        int index = -1;
        EXPECT_TRUE(absl::SimpleAtoi(value, &index) && index >= 0 && index < bound->second)
            << s.name << ": " << key << "=\"" << value << "\" is outside [0, " << bound->second << ")";
      }
    }
  }
}

TEST_F(MetricsNamingTest, MoreStepsAddNoSeries) {
  ASSERT_EQ(after_two_.size(), after_four_.size());
  auto series = [](const Page& page) {
    std::set<std::string> out;
    for (const MetricsText::Sample& s : page.parsed.samples) {
      std::vector<std::string> labels;
      for (const auto& [k, v] : s.labels) labels.push_back(absl::StrCat(k, "=", v));
      out.insert(absl::StrCat(s.name, "{", absl::StrJoin(labels, ","), "}"));
    }
    return out;
  };
  for (size_t i = 0; i < after_four_.size(); ++i) {
    SCOPED_TRACE(after_four_[i].who);
    EXPECT_EQ(series(after_two_[i]), series(after_four_[i]));
    EXPECT_NE(after_two_[i].text, after_four_[i].text) << "the values did not move";
  }
}

TEST_F(MetricsNamingTest, DocsListExactlyTheExportedFamilies) {
  const std::string doc = ReadFile(PSHARD_SOURCE_DIR "/docs/metrics.md");
  ASSERT_FALSE(doc.empty()) << "cannot read docs/metrics.md";
  std::set<std::string> documented;
  const std::regex backticked("`(pshard_[a-z0-9_]+)`");
  for (std::sregex_iterator it(doc.begin(), doc.end(), backticked), end; it != end; ++it) {
    documented.insert((*it)[1]);
  }
  std::set<std::string> exported;
  for (const Page& page : after_four_) {
    for (const auto& [name, type] : page.parsed.type) exported.insert(name);
  }
  for (const std::string& name : exported) EXPECT_TRUE(documented.contains(name)) << name << " is not documented";
  for (const std::string& name : documented) {
    EXPECT_TRUE(exported.contains(name)) << "docs/metrics.md lists " << name << ", which nothing exports";
  }
}

// What the processes count agrees: phases sum to the wall time, steps and
// tokens match what ran, and both ends of the wire count the same bytes.
TEST_F(MetricsNamingTest, ValuesAgreeAcrossProcesses) {
  double server_out = 0, server_in = 0, trainer_fetch = 0, trainer_push = 0;
  for (const Page& page : after_four_) {
    SCOPED_TRACE(page.who);
    const MetricsText& m = page.parsed;
    if (absl::StartsWith(page.who, "shard")) {
      EXPECT_EQ(Value(m, "pshard_server_step"), 4);
      EXPECT_EQ(Value(m, "pshard_server_applied_updates_total"), 4);
      EXPECT_EQ(Value(m, "pshard_server_optimizer_step_seconds_count"), 4);
      for (const MetricsText::Sample& s : m.samples) {
        if (s.name != "pshard_server_transfer_bytes_total") continue;
        (s.labels.at("direction") == "fetch" ? server_out : server_in) += s.value;
      }
      continue;
    }
    double phases = 0;
    for (const char* phase : {"compute", "comm_exposed", "data", "other"}) {
      phases += Value(m, "pshard_trainer_phase_seconds_total", {{"phase", phase}});
    }
    const double wall = Value(m, "pshard_trainer_step_seconds_sum");
    EXPECT_NEAR(phases, wall, 1e-6 * wall);
    EXPECT_LE(Value(m, "pshard_trainer_comm_busy_seconds_total"), wall);
    EXPECT_EQ(Value(m, "pshard_trainer_step"), 4);
    EXPECT_EQ(Value(m, "pshard_trainer_step_seconds_count"), 4);
    EXPECT_EQ(Value(m, "pshard_trainer_tokens_total"), 4 * kBatch * kSeqLen);
    trainer_fetch += Value(m, "pshard_trainer_transfer_bytes_total", {{"direction", "fetch"}});
    trainer_push += Value(m, "pshard_trainer_transfer_bytes_total", {{"direction", "push"}});
  }
  EXPECT_GT(trainer_fetch, 0);
  EXPECT_EQ(server_out, trainer_fetch);
  EXPECT_EQ(server_in, trainer_push);
}

TEST_F(MetricsNamingTest, PromtoolFindsNoProblems) {
  constexpr char kPromtool[] = "/usr/bin/promtool";
  if (std::FILE* f = std::fopen(kPromtool, "r"); f != nullptr) {
    std::fclose(f);
  } else {
    GTEST_SKIP() << kPromtool << " is not installed; skipping `promtool check metrics`";
  }
  for (const Page& page : after_four_) {
    SCOPED_TRACE(page.who);
    const std::string out_path = ::testing::TempDir() + "/metrics_naming_promtool.out";
    const std::string command = absl::StrCat(kPromtool, " check metrics > ", out_path, " 2>&1");
    std::FILE* pipe = popen(command.c_str(), "w");
    ASSERT_NE(pipe, nullptr);
    std::fwrite(page.text.data(), 1, page.text.size(), pipe);
    const int status = pclose(pipe);
    const std::string report = ReadFile(out_path);
    std::remove(out_path.c_str());
    EXPECT_EQ(status, 0) << report;
    EXPECT_EQ(report, "") << report;
  }
}

}  // namespace
}  // namespace pshard::testing
