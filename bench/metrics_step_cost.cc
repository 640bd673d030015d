// Cost of metric recording per training step, as a fraction of the step
// time of the demo model measured in the same run (goal < 1%).
//
// Trainer side: TrainerMetrics::RecordStep on a real step report, timed
// directly. Server side: the observations the servers make per step (one
// histogram observation per RPC, counter increments per chunk, the step
// driver's updates), counted from the servers' own metrics and priced at
// the measured cost of one observation.
#include <cstdio>
#include <regex>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "bench/bench_util.h"
#include "tests/testutil/local_cluster.h"
#include "trainer_client/data/default_corpus.h"
#include "trainer_client/model/gpt_spec.h"
#include "trainer_client/trainer.h"
#include "trainer_client/trainer_metrics.h"

ABSL_FLAG(int, servers, 4, "N shard servers");
ABSL_FLAG(int, steps, 20, "timed training steps");

namespace {

// Nanoseconds per call of `fn`, over `n` calls.
template <typename Fn>
double NanosPerCall(int n, Fn fn) {
  const absl::Time start = absl::Now();
  for (int i = 0; i < n; ++i) fn(i);
  return absl::ToDoubleNanoseconds(absl::Now() - start) / n;
}

// Sum of every `pshard_server_rpc_seconds_count{...}` sample in `text`.
double RpcCount(const std::string& text) {
  double total = 0;
  std::regex line(R"(pshard_server_rpc_seconds_count\{[^}]*\} ([0-9.e+]+))");
  for (std::sregex_iterator it(text.begin(), text.end(), line), end; it != end; ++it) total += std::stod((*it)[1]);
  return total;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  pshard::JobConfig job;
  job.model = pshard::MakeGptSpec(pshard::GptConfig{}).value();  // the demo model: 4 layers, width 128
  job.num_shards = absl::GetFlag(FLAGS_servers);
  auto cluster = pshard::testing::LocalCluster::Start(job);
  if (!cluster.ok()) return pshard::bench::Fail(cluster.status());
  const std::vector<std::string> addresses = (*cluster)->addresses();
  auto rpc_count = [&] {
    double total = 0;
    for (int s = 0; s < (*cluster)->num_shards(); ++s) total += RpcCount((*cluster)->server(s).registry().Serialize());
    return total;
  };
  pshard::ShardClient::Options options;
  options.server_addresses = addresses;
  options.encodings = pshard::WireEncoding::kBf16;
  options.transport = "grpc";  // the path whose servers observe a latency histogram per request
  auto client = pshard::ShardClient::Connect(options);
  if (!client.ok()) return pshard::bench::Fail(client.status());
  const pshard::TokenDataset data = pshard::TokenDataset::FromText(pshard::DefaultCorpus());
  auto trainer = pshard::Trainer::Create(client->get(), &data, pshard::TrainerOptions());
  if (!trainer.ok()) return pshard::bench::Fail(trainer.status());
  pshard::metrics::Registry registry;
  pshard::TrainerMetrics metrics(registry, 0, "grpc", "cpu", 1e11);

  const int steps = absl::GetFlag(FLAGS_steps);
  constexpr int kWarmup = 2;
  pshard::StepReport last;
  double rpcs_before = 0;
  absl::Duration timed;
  for (int step = 0; step < kWarmup + steps; ++step) {
    if (step == kWarmup) {
      rpcs_before = rpc_count();
    }
    const absl::Time start = absl::Now();
    auto report = (*trainer)->RunStep(step);
    if (!report.ok()) return pshard::bench::Fail(report.status());
    metrics.RecordStep(*report);
    if (step >= kWarmup) timed += absl::Now() - start;
    last = *report;
  }
  const double rpcs_after = rpc_count();
  const double step_ns = absl::ToDoubleNanoseconds(timed) / steps;
  const double rpcs_per_step = (rpcs_after - rpcs_before) / steps;

  const double record_step_ns = NanosPerCall(20000, [&](int) { metrics.RecordStep(last); });
  pshard::metrics::Registry scratch;
  auto& histogram = scratch.AddHistogram("pshard_bench_seconds", "x", pshard::metrics::Histogram::ExponentialBounds(1e-4, 2, 20)).Add({});
  auto& counter = scratch.AddCounter("pshard_bench_total", "x").Add({});
  const double observe_ns = NanosPerCall(1000000, [&](int i) { histogram.Observe(1e-3 * (i % 100)); });
  const double increment_ns = NanosPerCall(1000000, [&](int) { counter.Increment(1024); });
  // Per RPC: one latency observation and up to two byte counters (one chunk
  // each way for slices this small); per step and shard: the driver's ~12 updates.
  const double server_ns = rpcs_per_step * (observe_ns + 2 * increment_ns) +
                           job.num_shards * (12 * increment_ns + static_cast<double>(job.model.units.size()) * increment_ns);
  const double total_ns = record_step_ns + server_ns;
  std::printf("metric recording per step (demo model, %d servers, 1 trainer, bf16):\n", job.num_shards);
  std::printf("  step time                  : %.2f ms (mean of %d)\n", step_ns / 1e6, steps);
  std::printf("  trainer RecordStep         : %.0f ns\n", record_step_ns);
  std::printf("  server observations        : %.0f RPCs/step x (%.1f ns observe + 2 x %.1f ns increment) + driver = %.0f ns\n",
              rpcs_per_step, observe_ns, increment_ns, server_ns);
  std::printf("  total                      : %.0f ns = %.4f%% of the step (goal < 1%%)\n", total_ns,
              100.0 * total_ns / step_ns);
  if (total_ns >= 0.01 * step_ns) {
    std::fprintf(stderr, "metric recording costs 1%% of the step or more\n");
    return 1;
  }
  return 0;
}
