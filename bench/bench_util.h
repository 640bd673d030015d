// Small helpers shared by the benchmarks.
#ifndef PSHARD_BENCH_BENCH_UTIL_H_
#define PSHARD_BENCH_BENCH_UTIL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/job_config.h"
#include "tools/process.h"

namespace pshard::bench {

/// A GPT with one transformer block whose block unit holds about
/// `unit_mib` MiB at `bytes_per_element`, over `num_shards` servers.
JobConfig OneBlockJob(double unit_mib, double bytes_per_element, int num_shards);
/// The width of that GPT (its other sizes: 4 heads, context 64, vocab 256).
int OneBlockWidth(double unit_mib, double bytes_per_element);

/// N real pshard-server processes on 127.0.0.1, each started with
/// `--shard_index=s --num_shards=N --port_file=...` (and `--coordinator` of
/// shard 0 on the others) plus `args`; logs and port files in `dir`.
struct ServerProcesses {
  std::vector<ChildProcess> children;
  std::vector<std::string> addresses;
  /// SIGTERM to each, then waits up to 20 s for all.
  void Stop();
};
absl::StatusOr<ServerProcesses> StartServerProcesses(const std::string& bin_dir, int num_shards,
                                                     const std::vector<std::string>& args, const std::string& dir);

/// Prints the status and returns an exit code for main().
int Fail(const absl::Status& status);

/// Runs iperf3 (a server and one client with `streams` parallel streams,
/// iperf3 -P) on 127.0.0.1 for `seconds` and returns the bytes per second
/// received over all streams together.
absl::StatusOr<double> IperfLoopbackBytesPerSecond(int seconds, int streams);

/// A benchmark's floor, for the `perf` test label: true when `ratio` is at
/// least `fraction` of `goal` (always when `fraction` is 0); otherwise prints
/// which figure fell short and returns false.
bool MeetsFloor(const std::string& what, double ratio, double goal, double fraction);

/// Resident and peak resident memory of a process, in bytes.
struct ProcessMemory {
  int64_t rss = 0;
  int64_t peak_rss = 0;
};
absl::StatusOr<ProcessMemory> ReadProcessMemory(int pid);

/// A TCP port that was free a moment ago on 127.0.0.1.
absl::StatusOr<int> PickFreePort();

}  // namespace pshard::bench

#endif  // PSHARD_BENCH_BENCH_UTIL_H_
