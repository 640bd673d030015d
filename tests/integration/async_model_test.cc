// The trainer with a model whose calls return before their work is done, as
// a GPU model's do (here the CPU model run on another thread): the
// pipelined path (two backwards in flight, each gradient taken and pushed
// while the next computes, compute timed by the model) trains exactly as the
// synchronous path, and its time accounting holds together.
#include <tuple>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testutil/async_cpu_model.h"
#include "tests/testutil/single_trainer.h"
#include "tests/testutil/tiny_job.h"
#include "trainer_client/trainer.h"

namespace pshard::testing {
namespace {

constexpr int kSteps = 3;

SingleTrainerRun Train(const JobConfig& job, const TrainerOptions& options, bool asynchronous,
                       absl::Duration min_unit_time = absl::ZeroDuration()) {
  ModelMaker async_model;
  if (asynchronous) {
    async_model = [min_unit_time](const ShardClient& client, const TrainerOptions& trainer) {
      return MakeAsyncCpuModel(client.layout().spec, Trainer::ModelOptions(client, trainer), min_unit_time);
    };
  }
  absl::StatusOr<SingleTrainerRun> run = TrainSingleTrainer(job, options, kSteps, async_model);
  EXPECT_TRUE(run.ok()) << run.status();
  return run.ok() ? *std::move(run) : SingleTrainerRun();
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
  const SingleTrainerRun synchronous = Train(job, options, false);
  const SingleTrainerRun asynchronous = Train(job, options, true);
  ASSERT_EQ(asynchronous.losses.size(), static_cast<size_t>(kSteps));
  EXPECT_TRUE(SameTraining(asynchronous, synchronous));
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
  const SingleTrainerRun run = Train(job, TinyTrainerOptions(5), true, absl::Milliseconds(20));
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
