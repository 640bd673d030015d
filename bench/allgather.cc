// All-gather traffic: 4 trainers each fetch the same unit (version 0) from
// 4 in-process shard servers at once, so each ends up with the whole unit,
// the result of an all-gather among 4 ranks of unit / 4 bytes each. Timed
// from the start until every trainer has it, over gRPC and over UCX, against
// torch.distributed gloo all_gather of the same bytes (fp16; bench/
// gloo_allgather.py, run as a child process) in the same run. Goal: pshard
// at least 2x as fast as gloo.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
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
#include "trainer_client/shard_client.h"
#include "common/memory_policy.h"

ABSL_FLAG(int, ranks, 4, "trainers, and shard servers (one per rank)");
ABSL_FLAG(double, unit_mib, 32, "approximate wire size of the unit in MiB (all ranks' parts together)");
ABSL_FLAG(std::string, encoding, "bf16", "wire encoding of the fetch (gloo uses fp16 of the same bytes)");
ABSL_FLAG(std::string, transports, "grpc,ucx", "pshard data paths to measure");
ABSL_FLAG(int, repeats, 9, "timed all-gathers (median reported)");
ABSL_FLAG(std::string, python, "/usr/bin/python3", "python with torch for the gloo baseline");
ABSL_FLAG(std::string, gloo_script, PSHARD_GLOO_SCRIPT, "bench/gloo_allgather.py");
ABSL_FLAG(double, fail_below, 0,
          "exit 1 when a ratio is below this fraction of the goal (2x gloo); 0: never");

namespace {

struct Timing {
  double median_s = 0;
  double best_s = 0;
  int runs = 0;
};

Timing Summarize(std::vector<double> seconds) {
  std::sort(seconds.begin(), seconds.end());
  return Timing{seconds[seconds.size() / 2], seconds.front(), static_cast<int>(seconds.size())};
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
  const int n = absl::GetFlag(FLAGS_ranks);
  auto encoding = pshard::ParseWireEncoding(absl::GetFlag(FLAGS_encoding));
  if (!encoding.ok()) return pshard::bench::Fail(encoding.status());
  const double bytes_per_element = static_cast<double>(pshard::WireFormat(*encoding).EncodedBytes(1 << 20)) / (1 << 20);

  const pshard::JobConfig job = pshard::bench::OneBlockJob(absl::GetFlag(FLAGS_unit_mib), bytes_per_element, n);
  auto cluster = pshard::testing::LocalCluster::Start(job);
  if (!cluster.ok()) return pshard::bench::Fail(cluster.status());
  const std::vector<std::string> addresses = (*cluster)->addresses();

  const int unit = 1;  // the transformer block
  int64_t unit_bytes = 0;
  struct Row {
    std::string transport;
    Timing timing;
  };
  std::vector<Row> rows;
  for (const std::string& transport :
       std::vector<std::string>(absl::StrSplit(absl::GetFlag(FLAGS_transports), ',', absl::SkipEmpty()))) {
    // One client per trainer, each with its own connections and threads.
    std::vector<std::unique_ptr<pshard::ShardClient>> clients;
    for (int r = 0; r < n; ++r) {
      pshard::ShardClient::Options options;
      options.server_addresses = addresses;
      options.trainer_rank = -1;  // fetch only
      options.encodings = *encoding;
      options.transport = transport;
      auto client = pshard::ShardClient::Connect(options);
      if (!client.ok()) return pshard::bench::Fail(client.status());
      clients.push_back(std::move(*client));
    }
    unit_bytes = clients[0]->layout().partitions[unit].padded_numel() * static_cast<int64_t>(bytes_per_element);
    std::vector<double> seconds;
    for (int rep = 0; rep <= absl::GetFlag(FLAGS_repeats); ++rep) {
      // StartFetch does not block: the transfers of all trainers run at once
      // on their clients' own threads.
      std::vector<std::shared_ptr<pshard::UnitTransfer>> transfers;
      const absl::Time start = absl::Now();
      for (auto& client : clients) transfers.push_back(client->StartFetch(unit, 0));
      for (auto& t : transfers) {
        absl::Status s = t->Wait();
        if (!s.ok()) return pshard::bench::Fail(s);
      }
      const double elapsed = absl::ToDoubleSeconds(absl::Now() - start);
      if (rep > 0) seconds.push_back(elapsed);  // rep = 0 warms up
    }
    rows.push_back(Row{clients[0]->transport_name(0), Summarize(std::move(seconds))});
  }
  cluster->reset();

  const int64_t bytes_per_rank = unit_bytes / n;
  absl::StatusOr<Timing> gloo = GlooAllGather(n, bytes_per_rank);
  if (!gloo.ok()) return pshard::bench::Fail(gloo.status());

  // Aggregate: the bytes every rank ends up holding, over the time the last one has them.
  auto aggregate = [&](double s) { return static_cast<double>(n) * unit_bytes / s / 1e9; };
  std::printf("all-gather among %d ranks: %.2f MiB per rank (%s), %.1f MiB result per rank\n", n,
              bytes_per_rank / 1048576.0, absl::GetFlag(FLAGS_encoding).c_str(), unit_bytes / 1048576.0);
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
    std::printf("  ratio %-5s  : %.2fx gloo (goal >= 2x)\n", row.transport.c_str(), ratio);
    met &= pshard::bench::MeetsFloor(absl::StrCat("all-gather over ", row.transport), ratio, 2.0,
                                     absl::GetFlag(FLAGS_fail_below));
  }
  return met ? 0 : 1;
}
