// The trainer with a model whose calls return before their work is done, as
// a GPU model's do (here the CPU model run on another thread): the
// pipelined path (two backwards in flight, each gradient taken and pushed
// while the next computes, compute timed by the model) trains exactly as the
// synchronous path, and its time accounting holds together.
#include <cstring>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testutil/async_cpu_model.h"
#include "tests/testutil/local_cluster.h"
#include "tests/testutil/tiny_job.h"
#include "trainer_client/trainer.h"

namespace pshard::testing {
namespace {

constexpr int kSteps = 3;

struct TrainingRun {
  std::vector<double> losses;
  std::vector<StepReport> reports;
  std::vector<std::vector<float>> final_weights;
};

TrainingRun Train(const JobConfig& job, const TrainerOptions& options, bool asynchronous,
          absl::Duration min_unit_time = absl::ZeroDuration()) {
  TrainingRun run;
  auto cluster = LocalCluster::Start(job);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  if (!cluster.ok()) return run;
  auto client = (*cluster)->Connect(0, WireEncoding::kFp32);
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return run;
  absl::StatusOr<std::unique_ptr<Trainer>> trainer;
  if (asynchronous) {
    auto model = MakeAsyncCpuModel((*client)->layout().spec, Trainer::ModelOptions(**client, options), min_unit_time);
    EXPECT_TRUE(model.ok()) << model.status();
    if (!model.ok()) return run;
    trainer = Trainer::Create(client->get(), &TestCorpus(), options, std::move(*model));
  } else {
    trainer = Trainer::Create(client->get(), &TestCorpus(), options);
  }
  EXPECT_TRUE(trainer.ok()) << trainer.status();
  if (!trainer.ok()) return run;
  for (int64_t step = 0; step < kSteps; ++step) {
    absl::StatusOr<StepReport> r = (*trainer)->RunStep(step);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return run;
    run.losses.push_back(r->loss);
    run.reports.push_back(*r);
  }
  auto weights = (*cluster)->ReadMasterWeights(kSteps);
  EXPECT_TRUE(weights.ok()) << weights.status();
  if (weights.ok()) run.final_weights = std::move(*weights);
  return run;
}

bool BitIdentical(const TrainingRun& a, const TrainingRun& b) {
  if (a.losses != b.losses || a.final_weights.size() != b.final_weights.size()) return false;
  for (size_t u = 0; u < a.final_weights.size(); ++u) {
    if (a.final_weights[u].size() != b.final_weights[u].size() ||
        std::memcmp(a.final_weights[u].data(), b.final_weights[u].data(), a.final_weights[u].size() * 4) != 0) {
      return false;
    }
  }
  return true;
}

struct Case {
  int prefetch_depth;
  int micro_batches;
  bool accumulate;
  bool fetch_once;
};

class AsyncModelTest : public ::testing::TestWithParam<Case> {};

TEST_P(AsyncModelTest, TrainsBitIdenticallyToTheSynchronousModel) {
  const Case& c = GetParam();
  JobConfig job = TinyGptJob(/*shards=*/2, /*trainers=*/1, kSteps);
  job.micro_batches = c.micro_batches;
  job.accumulate_on_trainer = c.accumulate;
  TrainerOptions options = TinyTrainerOptions(5);
  options.prefetch_depth = c.prefetch_depth;
  options.fetch_once_per_step = c.fetch_once;
  const TrainingRun synchronous = Train(job, options, false);
  const TrainingRun asynchronous = Train(job, options, true);
  ASSERT_EQ(asynchronous.losses.size(), static_cast<size_t>(kSteps));
  EXPECT_TRUE(BitIdentical(asynchronous, synchronous));
  for (size_t s = 0; s < asynchronous.reports.size(); ++s) {
    EXPECT_EQ(asynchronous.reports[s].bytes_fetched, synchronous.reports[s].bytes_fetched);
    EXPECT_EQ(asynchronous.reports[s].bytes_pushed, synchronous.reports[s].bytes_pushed);
    EXPECT_EQ(asynchronous.reports[s].grad_norm, synchronous.reports[s].grad_norm);
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, AsyncModelTest,
                         ::testing::Values(Case{0, 1, false, false}, Case{1, 1, false, false},
                                           Case{2, 2, false, false}, Case{1, 3, true, false},
                                           Case{1, 3, true, true}),
                         [](const auto& info) {
                           const Case& c = info.param;
                           return absl::StrCat("prefetch", c.prefetch_depth, "_K", c.micro_batches,
                                               c.accumulate ? "_accumulate" : "_push_every",
                                               c.fetch_once ? "_once" : "");
                         });

// Compute stretched to 20 ms a unit: the fetches and pushes, a few ms each on
// loopback, run while the model computes, and the phases still split the
// step's wall time exactly.
TEST(AsyncModelTest, AccountsComputeAndHiddenCommunication) {
  const JobConfig job = TinyGptJob(/*shards=*/2, /*trainers=*/1, kSteps);
  const TrainingRun run = Train(job, TinyTrainerOptions(5), true, absl::Milliseconds(20));
  ASSERT_EQ(run.reports.size(), static_cast<size_t>(kSteps));
  for (const StepReport& r : run.reports) {
    const StepTimes& t = r.times;
    EXPECT_EQ(t.compute + t.comm_exposed + t.data + t.other, t.wall);
    EXPECT_GE(t.other, absl::ZeroDuration());
    EXPECT_GE(t.comm_busy, t.comm_exposed);
    // Every unit's forward and backward but the last unit's (kept from
    // forward) computes for at least 20 ms.
    EXPECT_GE(t.compute, absl::Milliseconds(20) * r.fetch_latencies.size());
  }
  // After the first step, some of the communication is hidden.
  for (size_t s = 1; s < run.reports.size(); ++s) {
    EXPECT_LT(run.reports[s].times.comm_exposed, run.reports[s].times.comm_busy) << "step " << s;
  }
}

}  // namespace
}  // namespace pshard::testing
