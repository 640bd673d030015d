// All-gather traffic: N trainers each fetch the same unit (version 0) from N
// shard servers at once, so each ends up with the whole unit, the result of
// an all-gather among N ranks of unit / N bytes each. Servers and trainers
// are separate processes, as gloo's ranks are: N pshard-server processes,
// and N copies of this program in the fetcher role, each with its own
// client. Each repeat starts every fetcher at once and takes the slowest
// one's own time from its start to having the whole unit (gloo's figure is
// made the same way: the slowest rank's time after a barrier). Over gRPC
// and over UCX, against torch.distributed gloo all_gather of the same bytes
// (fp16; bench/gloo_allgather.py, run as a child process) in the same run.
// Goal: pshard at least 2x as fast as gloo.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/bench_util.h"
#include "common/memory_policy.h"
#include "trainer_client/shard_client.h"

ABSL_FLAG(int, ranks, 4, "trainers, and shard servers (one per rank)");
ABSL_FLAG(double, unit_mib, 32, "approximate wire size of the unit in MiB (all ranks' parts together)");
ABSL_FLAG(std::string, encoding, "bf16", "wire encoding of the fetch (gloo uses fp16 of the same bytes)");
ABSL_FLAG(std::string, transports, "grpc,ucx", "pshard data paths to measure");
ABSL_FLAG(int, repeats, 9, "timed all-gathers (median reported)");
ABSL_FLAG(std::string, python, "/usr/bin/python3", "python with torch for the gloo baseline");
ABSL_FLAG(std::string, gloo_script, PSHARD_GLOO_SCRIPT, "bench/gloo_allgather.py");
ABSL_FLAG(std::string, bin_dir, PSHARD_BIN_DIR, "folder of pshard-server");
ABSL_FLAG(double, fail_below, 0,
          "exit 1 when a ratio is below this fraction of the goal (2x gloo); 0: never");
// The fetcher role (a child of this benchmark; not for users).
ABSL_FLAG(int, fetcher_fd, -1, "fetcher role: the socket to the benchmark that started it");
ABSL_FLAG(std::string, fetch_servers, "", "fetcher role: the shard servers, host:port,...");
ABSL_FLAG(std::string, fetch_transport, "grpc", "fetcher role: grpc or ucx");

namespace {

constexpr int kUnit = 1;  // the transformer block
const absl::Duration kAnswerLimit = absl::Seconds(120);

struct Timing {
  double median_s = 0;
  double best_s = 0;
  int runs = 0;
};

Timing Summarize(std::vector<double> seconds) {
  std::sort(seconds.begin(), seconds.end());
  return Timing{seconds[seconds.size() / 2], seconds.front(), static_cast<int>(seconds.size())};
}

absl::Status WriteAll(int fd, const std::string& s) {
  size_t at = 0;
  while (at < s.size()) {
    const ssize_t n = ::send(fd, s.data() + at, s.size() - at, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::UnavailableError(absl::StrCat("send: ", std::strerror(errno)));
    at += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// One line from `fd` (without its newline), waiting until `deadline`;
// `what` names the peer in the error. An empty optional line: end of file.
absl::StatusOr<std::string> ReadLine(int fd, absl::Time deadline, const std::string& what) {
  std::string line;
  while (true) {
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms <= 0) return absl::DeadlineExceededError(absl::StrCat("no answer from ", what, " within the limit"));
    pollfd p{fd, POLLIN, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 1000)));
    if (r < 0 && errno != EINTR) return absl::InternalError(absl::StrCat("poll: ", std::strerror(errno)));
    if (r <= 0) continue;
    char c;
    const ssize_t n = ::recv(fd, &c, 1, 0);
    if (n == 0) return absl::UnavailableError(absl::StrCat(what, " closed its connection", line.empty() ? "" : ": " + line));
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::UnavailableError(absl::StrCat("recv from ", what, ": ", std::strerror(errno)));
    }
    if (c == '\n') return line;
    line.push_back(c);
  }
}

// The fetcher role: connects, says "ready <unit bytes> <transport>", then for
// every byte it reads fetches the unit and answers with its own seconds
// (or "error <message>"); exits at end of file.
int RunFetcher(int fd) {
  auto encoding = pshard::ParseWireEncoding(absl::GetFlag(FLAGS_encoding));
  if (!encoding.ok()) return pshard::bench::Fail(encoding.status());
  pshard::ShardClient::Options options;
  options.server_addresses = absl::StrSplit(absl::GetFlag(FLAGS_fetch_servers), ',', absl::SkipEmpty());
  options.trainer_rank = -1;  // fetch only
  options.encodings = *encoding;
  options.transport = absl::GetFlag(FLAGS_fetch_transport);
  auto client = pshard::ShardClient::Connect(options);
  if (!client.ok()) {
    (void)WriteAll(fd, absl::StrCat("error ", client.status().ToString(), "\n"));
    return 1;
  }
  const int64_t bytes = static_cast<int64_t>(
      pshard::WireFormat(*encoding).EncodedBytes((*client)->layout().partitions[kUnit].padded_numel()));
  if (!WriteAll(fd, absl::StrCat("ready ", bytes, " ", (*client)->transport_name(0), "\n")).ok()) return 1;
  char go;
  while (::recv(fd, &go, 1, 0) == 1) {
    const absl::Time start = absl::Now();
    const absl::Status s = (*client)->StartFetch(kUnit, 0)->Wait();
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    const std::string answer = s.ok() ? absl::StrCat(seconds, "\n") : absl::StrCat("error ", s.ToString(), "\n");
    if (!WriteAll(fd, answer).ok() || !s.ok()) return s.ok() ? 1 : 2;
  }
  return 0;
}

// N fetcher processes over one transport.
struct Fetchers {
  std::vector<pshard::ChildProcess> children;
  std::vector<int> fds;  // this end of each one's socket
  int64_t unit_bytes = 0;
  std::string transport_name;

  ~Fetchers() {
    for (int fd : fds) ::close(fd);  // each fetcher exits at end of file
    for (pshard::ChildProcess& c : children) {
      if (!c.WaitUntil(absl::Now() + absl::Seconds(20))) c.Signal(SIGKILL);
    }
  }
};

absl::Status StartFetchers(const std::vector<std::string>& addresses, const std::string& transport,
                           const std::string& dir, Fetchers& fetchers) {
  char self[4096];
  const ssize_t len = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (len <= 0) return absl::InternalError("cannot find this program (/proc/self/exe)");
  for (size_t r = 0; r < addresses.size(); ++r) {
    int pair[2];
    // This end is closed on exec (other fetchers must not hold it); the
    // fetcher's end is inherited, under its own number.
    if (::socketpair(AF_UNIX, SOCK_STREAM, 0, pair) != 0) return absl::InternalError("socketpair");
    fetchers.fds.push_back(pair[0]);
    ::fcntl(pair[0], F_SETFD, FD_CLOEXEC);
    absl::StatusOr<pshard::ChildProcess> child = pshard::ChildProcess::Spawn(
        {std::string(self, static_cast<size_t>(len)), absl::StrCat("--fetcher_fd=", pair[1]),
         absl::StrCat("--fetch_servers=", absl::StrJoin(addresses, ",")),
         absl::StrCat("--fetch_transport=", transport), absl::StrCat("--encoding=", absl::GetFlag(FLAGS_encoding))},
        absl::StrCat(dir, "/fetcher-", transport, "-", r, ".log"));
    ::close(pair[1]);
    if (!child.ok()) return child.status();
    fetchers.children.push_back(std::move(*child));
  }
  for (size_t r = 0; r < fetchers.fds.size(); ++r) {
    const std::string what = absl::StrCat("fetcher ", r, " (", transport, ")");
    absl::StatusOr<std::string> line = ReadLine(fetchers.fds[r], absl::Now() + kAnswerLimit, what);
    if (!line.ok()) return line.status();
    std::vector<std::string> words = absl::StrSplit(*line, ' ');
    int64_t bytes = 0;
    if (words.size() != 3 || words[0] != "ready" || !absl::SimpleAtoi(words[1], &bytes)) {
      return absl::InternalError(absl::StrCat(what, ": ", *line));
    }
    fetchers.unit_bytes = bytes;
    fetchers.transport_name = words[2];
  }
  return absl::OkStatus();
}

// One all-gather: every fetcher starts at once; the slowest one's seconds.
absl::StatusOr<double> AllGatherOnce(const Fetchers& fetchers) {
  for (int fd : fetchers.fds) {
    if (absl::Status s = WriteAll(fd, "g"); !s.ok()) return s;
  }
  double slowest = 0;
  for (size_t r = 0; r < fetchers.fds.size(); ++r) {
    const std::string what = absl::StrCat("fetcher ", r);
    absl::StatusOr<std::string> line = ReadLine(fetchers.fds[r], absl::Now() + kAnswerLimit, what);
    if (!line.ok()) return line.status();
    double seconds = 0;
    if (!absl::SimpleAtod(*line, &seconds)) return absl::InternalError(absl::StrCat(what, ": ", *line));
    slowest = std::max(slowest, seconds);
  }
  return slowest;
}

// Runs the gloo baseline and reads its line.
absl::StatusOr<Timing> GlooAllGather(int ranks, int64_t bytes_per_rank) {
  absl::StatusOr<int> port = pshard::bench::PickFreePort();
  if (!port.ok()) return port.status();
  const std::string cmd =
      absl::StrCat(absl::GetFlag(FLAGS_python), " ", absl::GetFlag(FLAGS_gloo_script), " --ranks=", ranks,
                   " --bytes_per_rank=", bytes_per_rank, " --repeats=", absl::GetFlag(FLAGS_repeats),
                   " --port=", *port, " 2>&1");
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return absl::InternalError("cannot run the gloo baseline");
  std::string out;
  char buf[4096];
  while (size_t got = fread(buf, 1, sizeof(buf), pipe)) out.append(buf, got);
  const int rc = pclose(pipe);
  std::smatch m;
  if (rc != 0 || !std::regex_search(out, m,
                                    std::regex(R"(gloo_allgather ranks=\d+ bytes_per_rank=(\d+) median_s=([0-9.]+) best_s=([0-9.]+) repeats=(\d+))"))) {
    return absl::InternalError(absl::StrCat("gloo baseline failed:\n", out.substr(0, 3000)));
  }
  if (std::stoll(m[1]) != bytes_per_rank) return absl::InternalError("gloo moved a different size");
  return Timing{std::stod(m[2]), std::stod(m[3]), std::stoi(m[4])};
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  pshard::ReuseFreedMemory();  // as pshard-server and pshard-trainer do
  if (const int fd = absl::GetFlag(FLAGS_fetcher_fd); fd >= 0) return RunFetcher(fd);
  const int n = absl::GetFlag(FLAGS_ranks);
  auto encoding = pshard::ParseWireEncoding(absl::GetFlag(FLAGS_encoding));
  if (!encoding.ok()) return pshard::bench::Fail(encoding.status());
  const double bytes_per_element = static_cast<double>(pshard::WireFormat(*encoding).EncodedBytes(1 << 20)) / (1 << 20);

  char tmpl[] = "/tmp/pshard-allgather-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const int width = pshard::bench::OneBlockWidth(absl::GetFlag(FLAGS_unit_mib), bytes_per_element);
  absl::StatusOr<pshard::bench::ServerProcesses> servers = pshard::bench::StartServerProcesses(
      absl::GetFlag(FLAGS_bin_dir), n,
      {"--num_trainers=1", "--layers=1", absl::StrCat("--d_model=", width), "--heads=4", "--context=64",
       "--vocab=256", "--metrics_address="},
      dir);
  if (!servers.ok()) return pshard::bench::Fail(servers.status());

  int64_t unit_bytes = 0;
  struct Row {
    std::string transport;
    Timing timing;
  };
  std::vector<Row> rows;
  absl::Status status;
  for (const std::string& transport :
       std::vector<std::string>(absl::StrSplit(absl::GetFlag(FLAGS_transports), ',', absl::SkipEmpty()))) {
    Fetchers fetchers;
    status = StartFetchers(servers->addresses, transport, dir, fetchers);
    if (!status.ok()) break;
    unit_bytes = fetchers.unit_bytes;
    std::vector<double> seconds;
    for (int rep = 0; rep <= absl::GetFlag(FLAGS_repeats) && status.ok(); ++rep) {
      absl::StatusOr<double> s = AllGatherOnce(fetchers);
      status = s.status();
      if (s.ok() && rep > 0) seconds.push_back(*s);  // rep = 0 warms up
    }
    if (!status.ok()) break;
    rows.push_back(Row{fetchers.transport_name, Summarize(std::move(seconds))});
  }
  servers->Stop();
  if (!status.ok()) {
    std::fprintf(stderr, "logs in %s\n", dir.c_str());
    return pshard::bench::Fail(status);
  }

  const int64_t bytes_per_rank = unit_bytes / n;
  absl::StatusOr<Timing> gloo = GlooAllGather(n, bytes_per_rank);
  if (!gloo.ok()) return pshard::bench::Fail(gloo.status());

  // Aggregate: the bytes every rank ends up holding, over the time the last one has them.
  auto aggregate = [&](double s) { return static_cast<double>(n) * unit_bytes / s / 1e9; };
  std::printf("all-gather among %d ranks (servers and trainers: %d processes each): %.2f MiB per rank (%s), "
              "%.1f MiB result per rank\n",
              n, n, bytes_per_rank / 1048576.0, absl::GetFlag(FLAGS_encoding).c_str(), unit_bytes / 1048576.0);
  for (const Row& row : rows) {
    std::printf("  pshard %-5s : median %6.1f ms (best %6.1f ms, %d runs), aggregate %.2f GB/s\n",
                row.transport.c_str(), row.timing.median_s * 1e3, row.timing.best_s * 1e3, row.timing.runs,
                aggregate(row.timing.median_s));
  }
  std::printf("  gloo (fp16)  : median %6.1f ms (best %6.1f ms, %d runs), aggregate %.2f GB/s\n",
              gloo->median_s * 1e3, gloo->best_s * 1e3, gloo->runs, aggregate(gloo->median_s));
  bool met = true;
  for (const Row& row : rows) {
    const double ratio = gloo->median_s / row.timing.median_s;
    // gloo's times on a small machine can be bimodal (fast when its
    // threads are hot); its best run is shown too, so that a slow mode of
    // the baseline cannot pass for a fast pshard.
    std::printf("  ratio %-5s  : %.2fx gloo (goal >= 2x); against gloo's best run %.2fx\n", row.transport.c_str(),
                ratio, gloo->best_s / row.timing.median_s);
    met &= pshard::bench::MeetsFloor(absl::StrCat("all-gather over ", row.transport), ratio, 2.0,
                                     absl::GetFlag(FLAGS_fail_below));
  }
  return met ? 0 : 1;
}
