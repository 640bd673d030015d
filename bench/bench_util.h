// Small helpers shared by the benchmarks.
#ifndef PSHARD_BENCH_BENCH_UTIL_H_
#define PSHARD_BENCH_BENCH_UTIL_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/job_config.h"

namespace pshard::bench {

/// A GPT with one transformer block whose block unit holds about
/// `unit_mib` MiB at `bytes_per_element`, over `num_shards` servers.
JobConfig OneBlockJob(double unit_mib, double bytes_per_element, int num_shards);

/// Prints the status and returns an exit code for main().
int Fail(const absl::Status& status);

/// Runs iperf3 (server and one client stream) on 127.0.0.1 for `seconds`
/// and returns the received bytes per second.
absl::StatusOr<double> IperfLoopbackBytesPerSecond(int seconds);

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
