// Where the time goes: the trainer's phase metrics add up to the wall time,
// and on an emulated slow link prefetching visibly hides communication.
#include <algorithm>
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testutil/local_cluster.h"
#include "tests/testutil/tiny_job.h"
#include "trainer_client/data/default_corpus.h"
#include "trainer_client/trainer.h"
#include "trainer_client/trainer_metrics.h"
#include "trainer_client/model/gpt_spec.h"

namespace pshard::testing {
namespace {

JobConfig SmallJob() {
  JobConfig job;
  job.model = MakeGptSpec(GptConfig{.num_layers = 2, .d_model = 64, .num_heads = 2, .context = 32, .vocab = 256}).value();
  job.num_shards = 2;
  job.num_trainers = 1;
  return job;
}

// The value of one sample `name{labels}` in a text exposition; -1 if absent.
double Sample(const std::string& text, const std::string& series) {
  const size_t at = text.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + series.size() + 2));
}

struct RunResult {
  double external_wall = 0;  // measured around RunStep, seconds
  std::string metrics;       // the trainer's exposition afterwards
};

// Runs `steps` steps of one trainer from the cluster's current step.
RunResult Train(LocalCluster& cluster, int steps, int prefetch, const LinkSpec& link) {
  RunResult result;
  ShardClient::Options options;
  options.server_addresses = cluster.addresses();
  options.encodings = WireEncoding::kBf16;
  options.link = link;
  auto client = ShardClient::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return result;
  TrainerOptions topts;
  topts.batch = 4;
  topts.seq_len = 32;
  topts.prefetch_depth = prefetch;
  auto trainer = Trainer::Create(client->get(), &TestCorpus(), topts);
  EXPECT_TRUE(trainer.ok()) << trainer.status();
  if (!trainer.ok()) return result;
  metrics::Registry registry;
  TrainerMetrics recorder(registry, 0, "grpc", "cpu", 0.0);
  const int64_t first = (*client)->joined_step();
  for (int64_t step = first; step < first + steps; ++step) {
    const absl::Time start = absl::Now();
    absl::StatusOr<StepReport> report = (*trainer)->RunStep(step);
    result.external_wall += absl::ToDoubleSeconds(absl::Now() - start);
    EXPECT_TRUE(report.ok()) << report.status();
    if (!report.ok()) return result;
    recorder.RecordStep(*report);
  }
  result.metrics = absl::StrCat("\n", registry.Serialize());
  return result;
}

double Phase(const std::string& metrics, const std::string& phase) {
  return Sample(metrics, "pshard_trainer_phase_seconds_total{phase=\"" + phase + "\",rank=\"0\"}");
}

TEST(TrainerMetricsTest, PhasesSumToMeasuredWallTime) {
  auto cluster = LocalCluster::Start(SmallJob());
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const RunResult run = Train(**cluster, 10, 1, LinkSpec());
  const std::string& m = run.metrics;
  double sum = 0;
  for (const char* phase : {"compute", "comm_exposed", "data", "other"}) {
    const double v = Phase(m, phase);
    ASSERT_GE(v, 0) << phase << " missing:\n" << m;
    sum += v;
  }
  EXPECT_GT(Phase(m, "compute"), 0);
  EXPECT_GT(Phase(m, "comm_exposed"), 0);
  const double wall = Sample(m, "pshard_trainer_step_seconds_sum{rank=\"0\"}");
  EXPECT_NEAR(sum, wall, 1e-6 * wall);
  // Against a clock read outside the trainer: within 2%.
  EXPECT_NEAR(sum, run.external_wall, 0.02 * run.external_wall);
  EXPECT_EQ(Sample(m, "pshard_trainer_step_seconds_count{rank=\"0\"}"), 10);
  EXPECT_EQ(Sample(m, "pshard_trainer_fetch_seconds_count{rank=\"0\",transport=\"grpc\"}"),
            10 * (2 * 4 - 1));  // 4 units fetched in forward, 3 again in backward
  const double busy = Sample(m, "pshard_trainer_comm_busy_seconds_total{rank=\"0\"}");
  EXPECT_GT(busy, 0);
  // Busy covers exposed: what is hidden behind compute is never negative.
  EXPECT_GE(busy, Sample(m, "pshard_trainer_phase_seconds_total{phase=\"comm_exposed\",rank=\"0\"}"));
}

// With the link as the bottleneck, fetching ahead overlaps the downlink
// (fetches) with the uplink (pushes) and with compute, so the exposed
// communication falls when the prefetch depth goes from 0 to 1 or 2.
TEST(TrainerMetricsTest, PrefetchReducesExposedCommunicationOnASlowLink) {
  auto cluster = LocalCluster::Start(SmallJob());
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  absl::StatusOr<LinkSpec> link = LinkSpec::Parse("40mbit", "1ms", "");
  ASSERT_TRUE(link.ok());
  double exposed[3];
  double wall[3];
  for (int depth = 0; depth <= 2; ++depth) {
    const RunResult run = Train(**cluster, 4, depth, *link);
    exposed[depth] = Phase(run.metrics, "comm_exposed");
    wall[depth] = Sample(run.metrics, "pshard_trainer_step_seconds_sum{rank=\"0\"}");
    ASSERT_GT(exposed[depth], 0) << run.metrics;
    // Comm-bound: most of the step waits for the link.
    EXPECT_GT(exposed[depth], 0.3 * wall[depth]) << "depth " << depth;
  }
  std::printf("exposed communication over 4 steps at 40 Mbit/s: depth 0 %.3f s, depth 1 %.3f s, depth 2 %.3f s\n",
              exposed[0], exposed[1], exposed[2]);
  EXPECT_LT(exposed[1], 0.9 * exposed[0]) << "depth 0: " << exposed[0] << " s, depth 1: " << exposed[1] << " s";
  EXPECT_LT(exposed[2], 0.9 * exposed[0]) << "depth 0: " << exposed[0] << " s, depth 2: " << exposed[2] << " s";
}

// The levers' accounting: payload bytes as the steps report them, and the
// host memory of kept weights and error-feedback residuals.
TEST(TrainerMetricsTest, ExportsThePayloadAndTheLeversHostMemory) {
  const JobConfig job = SmallJob();
  for (bool quantized_and_kept : {false, true}) {
    SCOPED_TRACE(quantized_and_kept ? "int4 gradients, units kept" : "bf16, stage 3");
    auto cluster = LocalCluster::Start(job);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    const WireEncodings encodings = quantized_and_kept ? WireEncodings(WireEncoding::kBf16, WireEncoding::kInt4)
                                                       : WireEncodings(WireEncoding::kBf16);
    auto client = (*cluster)->Connect(0, encodings);
    ASSERT_TRUE(client.ok()) << client.status();
    TrainerOptions topts;
    topts.batch = 2;
    topts.seq_len = 16;
    topts.reshard_after_forward = !quantized_and_kept;
    auto trainer = Trainer::Create(client->get(), &TestCorpus(), topts);
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    metrics::Registry registry;
    TrainerMetrics recorder(registry, 0, "grpc", "cpu", 0.0);
    recorder.SetHostMemory(HostMemoryOf(topts, **client));
    int64_t fetched = 0, pushed = 0;
    for (int64_t step = 0; step < 2; ++step) {
      absl::StatusOr<StepReport> report = (*trainer)->RunStep(step);
      ASSERT_TRUE(report.ok()) << report.status();
      recorder.RecordStep(*report);
      fetched += report->payload_fetched;
      pushed += report->payload_pushed;
    }
    const std::string text = absl::StrCat("\n", registry.Serialize());
    EXPECT_GT(fetched, 0);
    EXPECT_EQ(Sample(text, "pshard_trainer_payload_bytes_total{direction=\"fetch\",rank=\"0\"}"), fetched);
    EXPECT_EQ(Sample(text, "pshard_trainer_payload_bytes_total{direction=\"push\",rank=\"0\"}"), pushed);
    int64_t all = 0, largest = 0;
    for (const UnitPartition& p : (*client)->layout().partitions) {
      all += 4 * p.padded_numel();
      largest = std::max<int64_t>(largest, 4 * p.padded_numel());
    }
    const double held = Sample(text, "pshard_trainer_host_memory_bytes{kind=\"weights_held\",rank=\"0\"}");
    const double residuals = Sample(text, "pshard_trainer_host_memory_bytes{kind=\"residuals\",rank=\"0\"}");
    EXPECT_EQ(held, quantized_and_kept ? all : 2 * largest);  // prefetch depth 1: two units at once
    EXPECT_EQ(residuals, quantized_and_kept ? all : 0);
    EXPECT_EQ(Sample(text, "pshard_trainer_host_memory_bytes{kind=\"secondary_shard\",rank=\"0\"}"), 0);
    // The client's residuals, once it pushed every unit, are what was exported.
    EXPECT_EQ((*client)->residual_bytes(), quantized_and_kept ? all : 0);
  }
}

}  // namespace
}  // namespace pshard::testing
