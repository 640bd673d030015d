// UCX fetch bandwidth: one unit fetched over UCX from N in-process shard
// servers into one trainer buffer, against ucx_perftest (UCP active-message
// bandwidth, rendezvous at this size) with the same UCX_TLS and the message
// size of one server's slice (unit / N), measured in the same run.
// Prints the ratio for every UCX_TLS given (goal >= 0.9), and the transports
// the links used: a UCX_TLS whose first transport the links do not use (UCX
// fell back to another) is an error.
#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <regex>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/bench_util.h"
#include "tests/testutil/local_cluster.h"
#include "tools/process.h"
#include "trainer_client/shard_client.h"
#include "common/memory_policy.h"

ABSL_FLAG(int, servers, 4, "N shard servers");
ABSL_FLAG(double, unit_mib, 64, "approximate size of the fetched unit in MiB (fp32)");
ABSL_FLAG(int, repeats, 11, "timed fetches per UCX_TLS");
ABSL_FLAG(std::string, tls, "sysv,cma;tcp",
          "UCX_TLS values to measure, separated by ';' (sysv,cma is what UCX picks on one host)");
ABSL_FLAG(std::string, perftest, "/usr/bin/ucx_perftest", "ucx_perftest binary");
ABSL_FLAG(std::string, perftest_test, "ucp_am_bw", "ucx_perftest test (UCP active messages, as pshard)");
ABSL_FLAG(int, perftest_iters, 300, "ucx_perftest timed messages");
ABSL_FLAG(double, fail_below, 0,
          "exit 1 when a ratio is below this fraction of the goal (the perf test: 0.5); 0: never");

namespace {

struct FetchResult {
  int64_t bytes = 0;
  int64_t slice_bytes = 0;
  double median_s = 0;
  double best_s = 0;
  int runs = 0;
  std::string transport;
};

absl::StatusOr<FetchResult> MeasureFetch() {
  const int n = absl::GetFlag(FLAGS_servers);
  const pshard::JobConfig job = pshard::bench::OneBlockJob(absl::GetFlag(FLAGS_unit_mib), 4.0, n);
  auto cluster = pshard::testing::LocalCluster::Start(job);
  if (!cluster.ok()) return cluster.status();
  for (int s = 0; s < n; ++s) {
    if ((*cluster)->server(s).ucx_address().empty()) return absl::UnavailableError("a shard server could not start UCX");
  }
  const std::vector<std::string> addresses = (*cluster)->addresses();
  pshard::ShardClient::Options options;
  options.server_addresses = addresses;
  options.trainer_rank = -1;
  options.encodings = pshard::WireEncoding::kFp32;  // fp32 slices land straight in the buffer
  options.transport = "ucx";
  auto client = pshard::ShardClient::Connect(options);
  if (!client.ok()) return client.status();
  const int unit = 1;  // the transformer block
  FetchResult result;
  result.bytes = (*client)->layout().partitions[unit].padded_numel() * 4;
  result.slice_bytes = result.bytes / n;
  result.transport = (*client)->transport_description(0);
  std::vector<double> seconds;
  for (int r = 0; r <= absl::GetFlag(FLAGS_repeats); ++r) {
    const absl::Time start = absl::Now();
    absl::Status s = (*client)->StartFetch(unit, 0)->Wait();
    if (!s.ok()) return s;
    if (r > 0) seconds.push_back(absl::ToDoubleSeconds(absl::Now() - start));  // r = 0 warms up
  }
  std::sort(seconds.begin(), seconds.end());
  result.median_s = seconds[seconds.size() / 2];
  result.best_s = seconds.front();
  result.runs = static_cast<int>(seconds.size());
  client->reset();
  cluster->reset();
  return result;
}

// Runs ucx_perftest as server and client on 127.0.0.1 (UCX_TLS from this
// process's environment) and returns its overall bandwidth in bytes/s.
absl::StatusOr<double> PerftestBytesPerSecond(int64_t message_bytes, int iterations) {
  absl::StatusOr<int> port = pshard::bench::PickFreePort();
  if (!port.ok()) return port.status();
  const std::string bin = absl::GetFlag(FLAGS_perftest);
  const std::string test = absl::GetFlag(FLAGS_perftest_test);
  const std::string iters = absl::StrCat(iterations);
  const std::string warmup = absl::StrCat(std::max(1, iterations / 10));
  absl::StatusOr<pshard::ChildProcess> server = pshard::ChildProcess::Spawn(
      {bin, "-t", test, "-s", absl::StrCat(message_bytes), "-n", iters, "-w", warmup, "-p", absl::StrCat(*port)},
      "/dev/null");
  if (!server.ok()) return server.status();
  absl::SleepFor(absl::Milliseconds(500));
  const std::string cmd = absl::StrCat(bin, " 127.0.0.1 -t ", test, " -s ", message_bytes, " -n ", iters, " -w ",
                                       warmup, " -p ", *port, " 2>&1");
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return absl::InternalError("cannot run ucx_perftest");
  std::string out;
  char buf[4096];
  while (size_t got = fread(buf, 1, sizeof(buf), pipe)) out.append(buf, got);
  pclose(pipe);
  if (!server->WaitUntil(absl::Now() + absl::Seconds(10))) server->Signal(SIGKILL);
  // "Final: iters p50 avg overall bw_avg bw_overall rate_avg rate_overall"; bandwidth in MiB/s.
  // The per-interval columns (avg, bw_avg) can read "inf" and 0.00 there.
  std::smatch m;
  if (!std::regex_search(out, m,
                         std::regex(R"(Final:\s+\d+\s+[0-9.]+\s+(?:[0-9.]+|inf)\s+[0-9.]+\s+[0-9.]+\s+([0-9.]+))"))) {
    return absl::InternalError(absl::StrCat("could not read ucx_perftest's result:\n", out.substr(0, 2000)));
  }
  return std::stod(m[1]) * 1048576.0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  pshard::ReuseFreedMemory();  // as pshard-server and pshard-trainer do
  std::vector<std::string> all_tls = absl::StrSplit(absl::GetFlag(FLAGS_tls), ';', absl::SkipEmpty());
  bool met = true;
  for (const std::string& tls : all_tls) {
    // Read by every UCP context created from here on: the servers', the
    // trainer's and ucx_perftest's (which inherits it).
    setenv("UCX_TLS", tls.c_str(), 1);
    absl::StatusOr<FetchResult> fetch = MeasureFetch();
    if (!fetch.ok()) return pshard::bench::Fail(fetch.status());
    // "sysv,cma": the links run over sysv; an alias ("shm", "all") is not checked.
    const std::string first = std::vector<std::string>(absl::StrSplit(tls, ',')).front();
    const bool alias = first == "shm" || first == "sm" || first == "all" || first == "rc" || first == "ud";
    if (!alias && fetch->transport.find(absl::StrCat(" ", first, "/")) == std::string::npos &&
        fetch->transport.find(absl::StrCat("+ ", first, "/")) == std::string::npos) {
      return pshard::bench::Fail(absl::FailedPreconditionError(absl::StrCat(
          "UCX_TLS=", tls, " but the links run ", fetch->transport, ": UCX fell back to another transport")));
    }
    absl::StatusOr<double> perftest =
        PerftestBytesPerSecond(fetch->slice_bytes, absl::GetFlag(FLAGS_perftest_iters));
    if (!perftest.ok()) return pshard::bench::Fail(perftest.status());
    const double fetch_gbps = fetch->bytes / fetch->median_s / 1e9;
    const double perf_gbps = *perftest / 1e9;
    std::printf("UCX_TLS=%s: fetch of one unit: %.1f MiB (fp32) from %d shard servers over %s\n", tls.c_str(),
                fetch->bytes / 1048576.0, absl::GetFlag(FLAGS_servers), fetch->transport.c_str());
    std::printf("  pshard fetch : median %.2f GB/s (best %.2f GB/s, median %.1f ms, %d runs)\n", fetch_gbps,
                fetch->bytes / fetch->best_s / 1e9, fetch->median_s * 1e3, fetch->runs);
    std::printf("  ucx_perftest : %.2f GB/s (-t %s, %lld-byte messages = one slice, %d iterations)\n", perf_gbps,
                absl::GetFlag(FLAGS_perftest_test).c_str(), static_cast<long long>(fetch->slice_bytes),
                absl::GetFlag(FLAGS_perftest_iters));
    std::printf("  ratio        : %.2f (goal >= 0.90)\n", fetch_gbps / perf_gbps);
    std::fflush(stdout);
    // Context, not the goal: ucx_perftest repeats one slice between the same
    // two buffers, which stay in the cache; a fetch writes the whole unit
    // from N sources. The same tool with the unit as one message moves the
    // fetch's footprint.
    absl::StatusOr<double> whole =
        PerftestBytesPerSecond(fetch->bytes, std::max(10, absl::GetFlag(FLAGS_perftest_iters) / 4));
    if (!whole.ok()) return pshard::bench::Fail(whole.status());
    std::printf("  (ucx_perftest with the whole unit as one message, the fetch's memory footprint: %.2f GB/s; "
                "pshard %.2f of it)\n",
                *whole / 1e9, fetch_gbps / (*whole / 1e9));
    std::fflush(stdout);
    met &= pshard::bench::MeetsFloor(absl::StrCat("UCX_TLS=", tls), fetch_gbps / perf_gbps, 0.9,
                                     absl::GetFlag(FLAGS_fail_below));
  }
  return met ? 0 : 1;
}
