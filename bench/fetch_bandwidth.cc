// Fetch and push bandwidth over gRPC: one ~64 MiB unit fetched from N shard
// servers into one trainer buffer, and its gradient pushed from the job's one
// trainer to the N servers, each push for a new step, so that the servers
// take it in and reduce it (the other units' gradients are pushed untimed to
// complete the step). The baseline is iperf3 over loopback with N parallel
// streams (-P N, one per server connection), measured in the same run.
// Prints the ratios (goals: fetch >= 0.9, push >= 0.7) and elements per
// second, to compare encodings. UCX is measured against ucx_perftest
// (ucx_fetch_bench), not here.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <regex>
#include <string>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "bench/bench_util.h"
#include "tests/testutil/local_cluster.h"
#include "trainer_client/shard_client.h"
#include "common/memory_policy.h"

ABSL_FLAG(int, servers, 4, "N shard servers");
ABSL_FLAG(double, unit_mib, 64, "approximate size of the fetched unit in MiB (fp32)");
ABSL_FLAG(int, repeats, 7, "timed fetches");
ABSL_FLAG(std::string, encoding, "fp32", "wire encoding");
ABSL_FLAG(int64_t, chunk_bytes, 1 << 20, "bytes per fetch chunk");
ABSL_FLAG(int, iperf_seconds, 3, "iperf3 measurement length");
ABSL_FLAG(std::string, link_rate, "",
          "emulate the trainer's network interface at this rate (e.g. 2gbit; each server's too): where the "
          "wire, not the machine, is the bottleneck; the iperf3 ratios then do not apply");
ABSL_FLAG(std::vector<std::string>, directions, std::vector<std::string>({"fetch", "push"}),
          "what to measure: fetch, push or both (one alone, to profile it)");
ABSL_FLAG(double, fail_below, 0,
          "exit 1 when a ratio is below this fraction of its goal (the perf test: 0.5); 0: never");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  pshard::ReuseFreedMemory();  // as pshard-server and pshard-trainer do
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
  options.trainer_rank = 0;  // the job's one trainer: it may push
  options.encodings = *encoding;
  options.transport = "grpc";
  absl::StatusOr<pshard::LinkSpec> link = pshard::LinkSpec::Parse(absl::GetFlag(FLAGS_link_rate), "", "");
  if (!link.ok()) return pshard::bench::Fail(link.status());
  options.link = *link;
  auto client = pshard::ShardClient::Connect(options);
  if (!client.ok()) return pshard::bench::Fail(client.status());
  const int unit = 1;  // the transformer block
  const int64_t bytes = static_cast<int64_t>(
      pshard::WireFormat(*encoding).EncodedBytes((*client)->layout().partitions[unit].padded_numel()));

  // Median and best seconds of `fn` over the repeats, after one warm-up;
  // `setup` runs before each, untimed.
  struct Timing {
    double median = 0, best = 0;
    size_t runs = 0;
  };
  auto time = [&](auto setup, auto fn) -> absl::StatusOr<Timing> {
    std::vector<double> seconds;
    for (int r = 0; r <= absl::GetFlag(FLAGS_repeats); ++r) {
      setup();
      const absl::Time start = absl::Now();
      if (absl::Status s = fn(); !s.ok()) return s;
      if (r > 0) seconds.push_back(absl::ToDoubleSeconds(absl::Now() - start));
    }
    std::sort(seconds.begin(), seconds.end());
    return Timing{seconds[seconds.size() / 2], seconds.front(), seconds.size()};
  };
  const int64_t elements = (*client)->layout().partitions[unit].padded_numel();
  const std::vector<std::string> directions = absl::GetFlag(FLAGS_directions);
  auto wanted = [&](const std::string& d) { return std::find(directions.begin(), directions.end(), d) != directions.end(); };
  for (const std::string& d : directions) {
    if (d != "fetch" && d != "push") return pshard::bench::Fail(absl::InvalidArgumentError("--directions: fetch, push"));
  }
  std::vector<std::tuple<const char*, Timing, double>> results;
  if (wanted("fetch")) {
    absl::StatusOr<Timing> fetch = time([] {}, [&] { return (*client)->StartFetch(unit, 0)->Wait(); });
    if (!fetch.ok()) return pshard::bench::Fail(fetch.status());
    results.emplace_back("fetch", *fetch, 0.9);
  }
  // A trainer hands its gradient over (moved, not copied), in a buffer the
  // client lends (GradientBuffer: one an earlier push gave back), as a
  // trainer's backward does; the copy into it is made before the timer
  // starts. Push r is step r's: before it, untimed, the step before has
  // been applied (version r is out) and the other units' gradients of step
  // r are in.
  if (wanted("push")) {
    const std::vector<float> gradient(elements, 1e-3f);
    std::vector<float> handed;
    int64_t step = 0;
    absl::Status setup_status;
    auto setup = [&] {
      if (step > 0) setup_status.Update((*client)->StartFetch(unit, step)->Wait());
      for (int u = 0; u < static_cast<int>((*client)->layout().partitions.size()); ++u) {
        if (u == unit) continue;
        std::vector<float> other = (*client)->GradientBuffer(u);
        std::fill(other.begin(), other.end(), 1e-3f);
        setup_status.Update((*client)->StartPush(u, step, std::move(other))->Wait());
      }
      handed = (*client)->GradientBuffer(unit);
      std::copy(gradient.begin(), gradient.end(), handed.begin());
    };
    absl::StatusOr<Timing> push =
        time(setup, [&]() -> absl::Status {
          if (!setup_status.ok()) return setup_status;
          return (*client)->StartPush(unit, step++, std::move(handed))->Wait();
        });
    if (!push.ok()) return pshard::bench::Fail(push.status());
    results.emplace_back("push ", *push, 0.7);
  }

  absl::StatusOr<double> iperf = pshard::bench::IperfLoopbackBytesPerSecond(absl::GetFlag(FLAGS_iperf_seconds), n);
  if (!iperf.ok()) return pshard::bench::Fail(iperf.status());
  const double iperf_gbps = *iperf / 1e9;
  std::printf("one unit: %.1f MiB (%s, %.1fM elements) between 1 trainer and %d shard servers over %s\n",
              bytes / 1048576.0, absl::GetFlag(FLAGS_encoding).c_str(), elements / 1e6, n,
              (*client)->transport_name(0).c_str());
  bool met = true;
  for (const auto& [what, t, goal] : results) {
    const double ratio = bytes / t.median / 1e9 / iperf_gbps;
    std::printf("  pshard %s : median %.2f GB/s = %.0fM elements/s (best %.2f GB/s, median %.1f ms, %zu runs); "
                "ratio %.2f (goal >= %.2f)\n",
                what, bytes / t.median / 1e9, elements / t.median / 1e6, bytes / t.best / 1e9, t.median * 1e3,
                t.runs, ratio, goal);
    if (!link->enabled()) met &= pshard::bench::MeetsFloor(what, ratio, goal, absl::GetFlag(FLAGS_fail_below));
  }
  std::printf("  iperf3       : %.2f GB/s loopback, %d parallel streams (one per server)\n", iperf_gbps, n);
  if (link->enabled()) {
    std::printf("  (the trainer's interface emulated at %s: ratios against iperf3 do not apply)\n",
                link->ToString().c_str());
  }
  return met ? 0 : 1;
}
