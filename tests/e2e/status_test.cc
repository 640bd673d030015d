// `pshard status`: the table of a running `pshard local` job, servers that are
// down or silent, and the text-format parsing it reads trainers with.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "pshard/config.h"
#include "tests/e2e/e2e_util.h"
#include "tools/cluster_status.h"

namespace pshard {
namespace {

constexpr char kPage[] = R"(# HELP pshard_trainer_loss Cross-entropy of the last step (mean over its micro-batches), in nats.
# TYPE pshard_trainer_loss gauge
pshard_trainer_loss{rank="1"} 2.5
# HELP pshard_trainer_phase_seconds_total Step wall time by phase;\nsee docs \\ here.
# TYPE pshard_trainer_phase_seconds_total counter
pshard_trainer_phase_seconds_total{phase="comm_exposed",rank="1"} 3
pshard_trainer_phase_seconds_total{phase="compute",rank="1"} 5.5 1700000000000
# a comment that is neither HELP nor TYPE

pshard_trainer_step_seconds_sum{rank="1"} 12
pshard_trainer_tokens_total{rank="1"} 6000
pshard_trainer_step{rank="1"} 42
pshard_trainer_grad_norm{rank="1"} 0.75
pshard_odd{path="a\"b\\c\nd",empty=""} -Inf
pshard_trainer_step_seconds_bucket{rank="1",le="+Inf"} 42
pshard_no_labels NaN
)";

TEST(MetricsTextTest, ParsesSamplesLabelsHelpAndType) {
  absl::StatusOr<MetricsText> page = ParseMetricsText(kPage);
  ASSERT_TRUE(page.ok()) << page.status();
  ASSERT_EQ(page->samples.size(), 10u);
  EXPECT_EQ(page->type.at("pshard_trainer_loss"), "gauge");
  EXPECT_EQ(page->type.at("pshard_trainer_phase_seconds_total"), "counter");
  EXPECT_EQ(page->help.at("pshard_trainer_phase_seconds_total"), "Step wall time by phase;\nsee docs \\ here.");
  EXPECT_EQ(page->samples[0].name, "pshard_trainer_loss");
  EXPECT_EQ(page->samples[0].labels, (metrics::Labels{{"rank", "1"}}));
  EXPECT_EQ(page->samples[0].value, 2.5);
  EXPECT_EQ(page->samples[2].value, 5.5);  // the timestamp is ignored
  const MetricsText::Sample& odd = page->samples[7];
  EXPECT_EQ(odd.labels, (metrics::Labels{{"path", "a\"b\\c\nd"}, {"empty", ""}}));
  EXPECT_EQ(odd.value, -INFINITY);
  EXPECT_EQ(page->samples[8].labels.at("le"), "+Inf");
  EXPECT_TRUE(std::isnan(page->samples[9].value));
  EXPECT_TRUE(page->samples[9].labels.empty());
}

TEST(MetricsTextTest, SampleValueMatchesOnALabelSubset) {
  absl::StatusOr<MetricsText> page = ParseMetricsText(kPage);
  ASSERT_TRUE(page.ok()) << page.status();
  EXPECT_EQ(*SampleValue(*page, "pshard_trainer_loss"), 2.5);
  EXPECT_EQ(*SampleValue(*page, "pshard_trainer_phase_seconds_total", {{"phase", "compute"}}), 5.5);
  EXPECT_EQ(SampleValue(*page, "pshard_trainer_phase_seconds_total").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(SampleValue(*page, "pshard_trainer_loss", {{"rank", "0"}}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(SampleValue(*page, "pshard_missing").status().code(), absl::StatusCode::kNotFound);
}

TEST(MetricsTextTest, MalformedLinesNameTheirNumber) {
  for (const char* bad : {"pshard_x{a=\"1\" 2", "pshard_x{a=1} 2", "pshard_x one", "pshard_x", "pshard_x 1 2 3"}) {
    absl::StatusOr<MetricsText> page = ParseMetricsText(absl::StrCat("# TYPE pshard_x gauge\n", bad, "\n"));
    EXPECT_EQ(page.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(absl::StrContains(page.status().message(), "line 2")) << page.status();
  }
}

TEST(MetricsTextTest, TrainerRowComesFromItsCounters) {
  absl::StatusOr<MetricsText> page = ParseMetricsText(kPage);
  ASSERT_TRUE(page.ok()) << page.status();
  TrainerStatus t;
  ASSERT_TRUE(ReadTrainerStatus(*page, &t).ok());
  EXPECT_EQ(t.step, 42);
  EXPECT_EQ(t.tokens_per_second, 500.0);
  EXPECT_EQ(t.comm_exposed_fraction, 0.25);
  EXPECT_EQ(t.loss, 2.5);
  EXPECT_EQ(t.grad_norm, 0.75);
  absl::StatusOr<MetricsText> empty = ParseMetricsText("");
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(ReadTrainerStatus(*empty, &t).code(), absl::StatusCode::kNotFound);
}

TEST(ClusterStatusTest, TableShowsWhatIsDown) {
  ClusterStatus status;
  status.servers.push_back({.address = "h:1", .shard = 0, .step = 7, .state_bytes = 3 << 20, .applied_updates = 6,
                            .skipped_steps = 1, .waiting_for = "shard 0, step 7: no gradient from trainer 1"});
  status.servers.push_back({.address = "h:2", .error = absl::UnavailableError("connection refused")});
  status.trainers.push_back({.rank = 0, .metrics_address = "h:9", .step = 8, .tokens_per_second = 1234.4,
                             .comm_exposed_fraction = 0.125, .loss = 2.25, .grad_norm = 0.5});
  status.trainers.push_back({.rank = 1, .error = absl::NotFoundError("no endpoint")});
  EXPECT_FALSE(status.Healthy());
  const std::string table = FormatClusterStatus(status);
  EXPECT_TRUE(absl::StrContains(table, "0      h:1      UP     7     3.0        6        1")) << table;
  EXPECT_TRUE(absl::StrContains(table, "no gradient from trainer 1")) << table;
  EXPECT_TRUE(absl::StrContains(table, "?      h:2      DOWN")) << table;
  EXPECT_TRUE(absl::StrContains(table, "UNAVAILABLE: connection refused")) << table;
  EXPECT_TRUE(absl::StrContains(table, "0     UP     h:9      8     1234   12.5    2.250  0.500")) << table;
  EXPECT_TRUE(absl::StrContains(table, "NOT_FOUND: no endpoint")) << table;
  status.servers.pop_back();
  status.trainers.pop_back();
  EXPECT_TRUE(status.Healthy());
}

// The rows of the table that starts with the header line beginning `first_column`.
std::vector<std::vector<std::string>> TableRows(const std::string& output, const std::string& first_column) {
  std::vector<std::vector<std::string>> rows;
  bool in_table = false;
  for (absl::string_view line : absl::StrSplit(output, '\n')) {
    std::vector<std::string> cells = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (cells.empty()) {
      in_table = false;
    } else if (cells[0] == first_column) {
      in_table = true;
    } else if (in_table) {
      rows.push_back(std::move(cells));
    }
  }
  return rows;
}

std::string StatusCommand(const std::vector<std::string>& servers, const std::string& extra = "") {
  return absl::StrCat("timeout -s KILL 60 ", PSHARD_BIN_DIR, "/pshard status --servers=", absl::StrJoin(servers, ","),
                      " ", extra, " 2>&1");
}

// Stops a running `pshard local` (Ctrl-C) when the test ends.
struct StopOnExit {
  ChildProcess& child;
  ~StopOnExit() {
    if (!child.Poll()) {
      child.Signal(SIGINT);
      child.WaitUntil(absl::Now() + absl::Seconds(60));
    }
  }
};

// Training is under way once trainer 0 has logged a step.
void WaitForFirstStep(const std::string& run_dir, ChildProcess& launcher) {
  const absl::Time deadline = absl::Now() + absl::Minutes(2);
  while (Losses(ReadFile(run_dir + "/launcher.log")).empty()) {
    ASSERT_FALSE(launcher.Poll().has_value()) << ReadFile(run_dir + "/launcher.log");
    ASSERT_LT(absl::Now(), deadline) << "no step logged:\n" << ReadFile(run_dir + "/launcher.log");
    absl::SleepFor(absl::Milliseconds(50));
  }
}

TEST(StatusE2E, ShowsEveryShardAndTrainerOfARunningJob) {
  const std::string run_dir = MakeRunDir();
  auto launcher = StartLocal(run_dir, {"--servers=2", "--trainers=2", "--steps=100000", "--layers=1", "--d_model=32",
                                       "--heads=2", "--context=16", "--seq_len=16", "--log_every=5"});
  ASSERT_TRUE(launcher.ok()) << launcher.status();
  StopOnExit stop{*launcher};
  ASSERT_NO_FATAL_FAILURE(WaitForFirstStep(run_dir, *launcher));
  const std::vector<std::string> servers = LocalServerAddresses(run_dir, 2);
  ASSERT_EQ(servers.size(), 2u);

  const CommandResult status = RunCommand(StatusCommand(servers));
  EXPECT_EQ(status.exit_code, 0) << status.output;
  // shard address state step state-MiB applied skipped metrics waiting...
  std::map<std::string, std::vector<std::string>> shards;
  for (auto& row : TableRows(status.output, "shard")) shards[row[0]] = row;
  ASSERT_EQ(shards.size(), 2u) << status.output;
  for (const std::string shard : {"0", "1"}) {
    ASSERT_TRUE(shards.contains(shard)) << status.output;
    const std::vector<std::string>& row = shards[shard];
    ASSERT_GE(row.size(), 8u) << status.output;
    EXPECT_EQ(row[1], servers[shard == "0" ? 0 : 1]) << status.output;
    EXPECT_EQ(row[2], "UP") << status.output;
    int64_t step = 0;
    EXPECT_TRUE(absl::SimpleAtoi(row[3], &step) && step > 0) << status.output;
  }
  // rank state metrics step tok/s comm% loss grad-norm
  std::map<std::string, std::vector<std::string>> ranks;
  for (auto& row : TableRows(status.output, "rank")) ranks[row[0]] = row;
  ASSERT_EQ(ranks.size(), 2u) << status.output;
  for (const std::string rank : {"0", "1"}) {
    ASSERT_TRUE(ranks.contains(rank)) << status.output;
    const std::vector<std::string>& row = ranks[rank];
    ASSERT_EQ(row.size(), 8u) << status.output;
    EXPECT_EQ(row[1], "UP") << status.output;
    double loss = 0, tokens_per_second = 0;
    EXPECT_TRUE(absl::SimpleAtod(row[6], &loss) && loss > 0 && loss < 10) << status.output;
    EXPECT_TRUE(absl::SimpleAtod(row[4], &tokens_per_second) && tokens_per_second > 0) << status.output;
  }

  // Each trainer's run settings are shown.
  for (const std::string rank : {"0", "1"}) {
    EXPECT_NE(status.output.find(absl::StrCat("trainer ", rank, " settings: accumulation=per_micro_batch "
                                              "device=cpu encoding=bf16 fabric_group_size=1 link=unshaped "
                                              "micro_batches=1 prefetch=1 recompute=false transport=")),
              std::string::npos)
        << status.output;
  }

  // Given any one server, the tool finds the others through shard 0.
  for (const std::string& one : servers) {
    const CommandResult from_one = RunCommand(StatusCommand({one}));
    EXPECT_EQ(from_one.exit_code, 0) << from_one.output;
    std::map<std::string, std::string> found;
    for (auto& row : TableRows(from_one.output, "shard")) found[row[0]] = row[1];
    EXPECT_EQ(found, (std::map<std::string, std::string>{{"0", servers[0]}, {"1", servers[1]}}))
        << from_one.output;
    EXPECT_EQ(TableRows(from_one.output, "rank").size(), 2u) << from_one.output;
  }

  launcher->Signal(SIGINT);
  std::optional<int> code = launcher->WaitUntil(absl::Now() + absl::Seconds(60));
  ASSERT_TRUE(code.has_value()) << ReadFile(run_dir + "/launcher.log");
  EXPECT_EQ(*code, 130);
  EXPECT_EQ(CountProcessesMentioning(run_dir), 0) << "processes left behind";
}

// A loopback socket: bound and, if `listening`, accepting connections into
// its backlog that nobody ever answers.
struct Socket {
  explicit Socket(bool listening) {
    fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    if (listening) listen(fd, 16);
    getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    address = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
  }
  ~Socket() { close(fd); }
  int fd = -1;
  std::string address;
};

TEST(HttpGetTest, EndsAtTheDeadline) {
  Socket silent(/*listening=*/true);
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> body = HttpGet(silent.address, "/metrics", absl::Milliseconds(300));
  EXPECT_EQ(body.status().code(), absl::StatusCode::kDeadlineExceeded) << body.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  Socket refused(/*listening=*/false);
  body = HttpGet(refused.address, "/metrics", absl::Seconds(5));
  EXPECT_EQ(body.status().code(), absl::StatusCode::kUnavailable) << body.status();
  EXPECT_EQ(HttpGet("no-port", "/", absl::Seconds(1)).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(StatusE2E, RefusedServerIsDown) {
  Socket bound(/*listening=*/false);  // holds the port, so connections to it are refused
  const absl::Time start = absl::Now();
  const CommandResult status = RunCommand(StatusCommand({bound.address}, "--timeout=5s"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(15)) << status.output;
  EXPECT_EQ(status.exit_code, 1) << status.output;
  const auto rows = TableRows(status.output, "shard");
  ASSERT_EQ(rows.size(), 1u) << status.output;
  EXPECT_EQ(rows[0][1], bound.address);
  EXPECT_EQ(rows[0][2], "DOWN") << status.output;
}

TEST(StatusE2E, SilentServerIsDownWithinTheDeadline) {
  Socket silent(/*listening=*/true);
  Socket refused(/*listening=*/false);
  const absl::Time start = absl::Now();
  const CommandResult status = RunCommand(StatusCommand({silent.address, refused.address}, "--timeout=2s"));
  const absl::Duration took = absl::Now() - start;
  // Servers are asked in parallel: one deadline, not one per server.
  EXPECT_GE(took, absl::Seconds(2)) << status.output;
  EXPECT_LT(took, absl::Seconds(12)) << status.output;
  EXPECT_EQ(status.exit_code, 1) << status.output;
  const auto rows = TableRows(status.output, "shard");
  ASSERT_EQ(rows.size(), 2u) << status.output;
  for (const auto& row : rows) EXPECT_EQ(row[2], "DOWN") << status.output;
  EXPECT_TRUE(absl::StrContains(status.output, "DEADLINE_EXCEEDED")) << status.output;
}

TEST(StatusE2E, NeedsServerAddresses) {
  const CommandResult status = RunCommand(absl::StrCat(PSHARD_BIN_DIR, "/pshard status 2>&1"));
  EXPECT_EQ(status.exit_code, 2) << status.output;
  EXPECT_TRUE(absl::StrContains(status.output, "--servers=host:port")) << status.output;
}

// A port past 65535 is refused, not wrapped around to another one (366499602
// would be port 22290).
TEST(StatusE2E, RefusesAPortOutOfRange) {
  const CommandResult status =
      RunCommand(absl::StrCat(PSHARD_BIN_DIR, "/pshard status --servers=127.0.0.1:366499602 2>&1"));
  EXPECT_EQ(status.exit_code, 2) << status.output;
  EXPECT_TRUE(absl::StrContains(status.output, "\"127.0.0.1:366499602\" is not host:port")) << status.output;
}

// A job with mutual TLS and tokens (pshard local --tls --auth_tokens): its
// checkpoints are the bytes of the same job in plaintext, and pshard status
// reads it only with the reader's credentials it printed.
TEST(StatusE2E, ATlsJobTrainsLikeAPlaintextOneAndStatusNeedsAReader) {
  const std::vector<std::string> job = {"--servers=2", "--trainers=2", "--layers=1", "--d_model=32", "--heads=2",
                                        "--context=16", "--seq_len=16", "--log_every=1", "--encoding=fp32"};
  auto train = [&](std::vector<std::string> extra) {
    const std::string run_dir = MakeRunDir();
    std::vector<std::string> flags = job;
    flags.push_back("--steps=4");
    flags.push_back(absl::StrCat("--checkpoint_dir=", run_dir, "/ckpt"));
    flags.insert(flags.end(), extra.begin(), extra.end());
    auto launcher = StartLocal(run_dir, flags);
    EXPECT_TRUE(launcher.ok()) << launcher.status();
    if (launcher.ok()) {
      EXPECT_EQ(launcher->WaitUntil(absl::Now() + absl::Minutes(2)), 0) << ReadFile(run_dir + "/launcher.log");
    }
    return run_dir;
  };
  const std::string plain = train({});
  const std::string secured = train({"--tls", "--auth_tokens"});
  EXPECT_NE(ReadFile(secured + "/server1.log").find("(TLS, client certificates required, tokens required)"),
            std::string::npos)
      << ReadFile(secured + "/server1.log");
  // TLS covers gRPC only: where the data path runs over UCX, the console
  // and each trainer say that it travels in plaintext.
  const std::string plaintext = "over UCX, in plaintext";
  EXPECT_EQ(absl::StrContains(ReadFile(secured + "/launcher.log"), plaintext), PSHARD_WITH_UCX == 1)
      << ReadFile(secured + "/launcher.log");
  EXPECT_EQ(absl::StrContains(ReadFile(secured + "/trainer0.log"), "travel over UCX in plaintext"),
            PSHARD_WITH_UCX == 1)
      << ReadFile(secured + "/trainer0.log");
  EXPECT_FALSE(absl::StrContains(ReadFile(plain + "/launcher.log"), plaintext)) << ReadFile(plain + "/launcher.log");
  for (int s = 0; s < 2; ++s) {
    const std::string name = absl::StrFormat("shard-%d-of-2.step-%010d.ckpt", s, 4);
    const std::string want = ReadFile(absl::StrCat(plain, "/ckpt/", name));
    ASSERT_FALSE(want.empty()) << name << " is missing";
    EXPECT_TRUE(ReadFile(absl::StrCat(secured, "/ckpt/", name)) == want) << name << " differs";
  }

  const std::string run_dir = MakeRunDir();
  std::vector<std::string> flags = job;
  flags.insert(flags.end(), {"--steps=100000", "--tls", "--auth_tokens"});
  auto launcher = StartLocal(run_dir, flags);
  ASSERT_TRUE(launcher.ok()) << launcher.status();
  StopOnExit stop{*launcher};
  ASSERT_NO_FATAL_FAILURE(WaitForFirstStep(run_dir, *launcher));
  const std::string log = ReadFile(run_dir + "/launcher.log");
  const std::string marker = "pshard status needs ";
  const size_t at = log.find(marker);
  ASSERT_NE(at, std::string::npos) << log;
  const std::string reader = log.substr(at + marker.size(), log.find('\n', at) - at - marker.size());
  EXPECT_NE(reader.find("/tls/reader/tls.crt"), std::string::npos) << reader;
  const std::vector<std::string> servers = LocalServerAddresses(run_dir, 2);
  ASSERT_EQ(servers.size(), 2u);

  const CommandResult anonymous = RunCommand(StatusCommand({servers[0]}, "--timeout=5s"));
  EXPECT_EQ(anonymous.exit_code, 1) << anonymous.output;
  EXPECT_NE(anonymous.output.find("DOWN"), std::string::npos) << anonymous.output;
  const CommandResult with_reader = RunCommand(StatusCommand({servers[0]}, reader));
  EXPECT_EQ(with_reader.exit_code, 0) << with_reader.output;
  EXPECT_EQ(TableRows(with_reader.output, "shard").size(), 2u) << with_reader.output;
  // A trainer's certificate is not the reader's: status (which reads
  // trainers' metrics too) still answers, since every role may read status,
  // but the token of the reader then mismatches the certificate.
  std::string as_trainer = reader;
  for (const char* file : {"tls.crt", "tls.key"}) {
    const std::string from = absl::StrCat("/reader/", file);
    as_trainer.replace(as_trainer.find(from), from.size(), absl::StrCat("/trainer/", file));
  }
  const CommandResult mismatched = RunCommand(StatusCommand({servers[0]}, as_trainer));
  EXPECT_EQ(mismatched.exit_code, 1) << mismatched.output;
  EXPECT_NE(mismatched.output.find("differ"), std::string::npos) << mismatched.output;
}

}  // namespace
}  // namespace pshard
