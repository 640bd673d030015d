// Fetch bandwidth: one ~64 MiB unit fetched from N shard servers into one
// trainer buffer, against iperf3's single-stream loopback bandwidth measured
// in the same run. Prints the ratio (goal >= 0.8).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <regex>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "bench/bench_util.h"
#include "tests/testutil/local_cluster.h"
#include "trainer_client/shard_client.h"

ABSL_FLAG(int, servers, 4, "N shard servers");
ABSL_FLAG(double, unit_mib, 64, "approximate size of the fetched unit in MiB (fp32)");
ABSL_FLAG(int, repeats, 7, "timed fetches");
ABSL_FLAG(std::string, encoding, "fp32", "wire encoding");
ABSL_FLAG(std::string, transport, "grpc", "data path: grpc or ucx");
ABSL_FLAG(int64_t, chunk_bytes, 1 << 20, "bytes per fetch chunk");
ABSL_FLAG(int, iperf_seconds, 3, "iperf3 measurement length");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int n = absl::GetFlag(FLAGS_servers);
  auto encoding = pshard::ParseWireEncoding(absl::GetFlag(FLAGS_encoding));
  if (!encoding.ok()) return pshard::bench::Fail(encoding.status());

  const pshard::JobConfig job = pshard::bench::OneBlockJob(absl::GetFlag(FLAGS_unit_mib), 4.0, n);
  pshard::testing::LocalCluster::Options cluster_options;
  cluster_options.fetch_chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes);
  cluster_options.max_message_bytes = static_cast<int>(cluster_options.fetch_chunk_bytes + (1 << 20));
  auto cluster = pshard::testing::LocalCluster::Start(job, cluster_options);
  if (!cluster.ok()) return pshard::bench::Fail(cluster.status());
  const std::vector<std::string> addresses = (*cluster)->addresses();
  pshard::ShardClient::Options options;
  options.server_addresses = addresses;
  options.trainer_rank = -1;
  options.encoding = *encoding;
  options.transport = absl::GetFlag(FLAGS_transport);
  auto client = pshard::ShardClient::Connect(options);
  if (!client.ok()) return pshard::bench::Fail(client.status());
  const int unit = 1;  // the transformer block
  const int64_t bytes = (*client)->layout().partitions[unit].padded_numel() *
                        static_cast<int64_t>(pshard::BytesPerElement(*encoding));

  std::vector<double> seconds;
  for (int r = 0; r <= absl::GetFlag(FLAGS_repeats); ++r) {
    const absl::Time start = absl::Now();
    absl::Status s = (*client)->StartFetch(unit, 0)->Wait();
    if (!s.ok()) return pshard::bench::Fail(s);
    if (r > 0) seconds.push_back(absl::ToDoubleSeconds(absl::Now() - start));  // r = 0 warms up
  }
  std::sort(seconds.begin(), seconds.end());
  const double median = seconds[seconds.size() / 2];
  const double fetch_gbps = bytes / median / 1e9;
  const double best_gbps = bytes / seconds.front() / 1e9;

  absl::StatusOr<double> iperf = pshard::bench::IperfLoopbackBytesPerSecond(absl::GetFlag(FLAGS_iperf_seconds));
  if (!iperf.ok()) return pshard::bench::Fail(iperf.status());
  const double iperf_gbps = *iperf / 1e9;
  std::printf("fetch of one unit: %.1f MiB (%s) from %d shard servers over %s\n", bytes / 1048576.0,
              absl::GetFlag(FLAGS_encoding).c_str(), n, (*client)->transport_name(0).c_str());
  std::printf("  pshard fetch : median %.2f GB/s (best %.2f GB/s, median %.1f ms, %zu runs)\n", fetch_gbps,
              best_gbps, median * 1e3, seconds.size());
  std::printf("  iperf3       : %.2f GB/s single-stream loopback\n", iperf_gbps);
  std::printf("  ratio        : %.2f (goal >= 0.80)\n", fetch_gbps / iperf_gbps);
  return 0;
}
