// Trainer::Evaluate on a real 2-shard cluster: the held-out loss is the
// model's forward on exactly the weights the servers hold, and evaluating
// pushes nothing and moves no step.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testutil/local_cluster.h"
#include "tests/testutil/tiny_job.h"
#include "trainer_client/model/gpt.h"
#include "trainer_client/trainer.h"
#include "trainer_client/trainer_metrics.h"

namespace pshard::testing {
namespace {

constexpr uint64_t kValSeed = 3;

// The mean loss of a CpuGpt with `weights` over micro-batches 0..batches-1
// of `data`, sampled as Evaluate does.
double ReferenceLoss(const JobConfig& job, const TrainerOptions& t, const std::vector<std::vector<float>>& weights,
                     const TokenDataset& data, int batches) {
  absl::StatusOr<CpuGpt<float>> model = CpuGpt<float>::Create(job.model, t.batch, t.seq_len);
  EXPECT_TRUE(model.ok()) << model.status();
  std::vector<int32_t> tokens(t.batch * t.seq_len), targets(t.batch * t.seq_len);
  double sum = 0.0;
  for (int micro = 0; micro < batches; ++micro) {
    EXPECT_TRUE(data.SampleBatch(kValSeed, 0, 0, micro, t.batch, t.seq_len, tokens, targets).ok());
    EXPECT_TRUE(model->SetBatch(tokens, targets).ok());
    for (int u = 0; u < model->num_units(); ++u) model->ForwardUnit(u, weights[u]);
    sum += model->loss();
  }
  return sum / batches;
}

TEST(Evaluate, TheLossIsTheForwardOfTheServersWeightsAndChangesNothing) {
  const JobConfig job = TinyGptJob(/*shards=*/2, /*trainers=*/1, /*steps=*/3);
  absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = LocalCluster::Start(job);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  absl::StatusOr<std::unique_ptr<ShardClient>> client = (*cluster)->Connect(0, WireEncoding::kFp32);
  ASSERT_TRUE(client.ok()) << client.status();
  const TrainerOptions options = TinyTrainerOptions();
  absl::StatusOr<std::unique_ptr<Trainer>> trainer = Trainer::Create(client->get(), &TestCorpus(), options);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  const TokenDataset val = TokenDataset::FromText(
      "A held-out text the model never trains on: it is only ever evaluated, forward, and nothing is pushed.");

  absl::StatusOr<std::vector<std::vector<float>>> initial = (*cluster)->ReadMasterWeights(0);
  ASSERT_TRUE(initial.ok()) << initial.status();
  absl::StatusOr<EvalReport> first = (*trainer)->Evaluate(0, val, 3, kValSeed);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->version, 0);
  EXPECT_EQ(first->batches, 3);
  EXPECT_EQ(first->tokens, 3 * options.batch * options.seq_len);
  EXPECT_GT(first->bytes_fetched, 0);
  // The same model code on the same weights and batches: the same bits.
  EXPECT_EQ(first->loss, ReferenceLoss(job, options, *initial, val, 3));

  // Again: the same text, the same loss; the servers' weights as they were.
  absl::StatusOr<EvalReport> again = (*trainer)->Evaluate(0, val, 3, kValSeed);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->loss, first->loss);
  absl::StatusOr<std::vector<std::vector<float>>> after = (*cluster)->ReadMasterWeights(0);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(*after, *initial);

  // Training goes on from step 0 (no step was taken), and evaluating the
  // new version measures the new weights.
  absl::StatusOr<StepReport> step = (*trainer)->RunStep(0);
  ASSERT_TRUE(step.ok()) << step.status();
  absl::StatusOr<std::vector<std::vector<float>>> trained = (*cluster)->ReadMasterWeights(1);
  ASSERT_TRUE(trained.ok()) << trained.status();
  EXPECT_NE(*trained, *initial);
  absl::StatusOr<EvalReport> later = (*trainer)->Evaluate(1, val, 3, kValSeed);
  ASSERT_TRUE(later.ok()) << later.status();
  EXPECT_EQ(later->loss, ReferenceLoss(job, options, *trained, val, 3));
  EXPECT_NE(later->loss, first->loss);

  EXPECT_FALSE((*trainer)->Evaluate(1, val, 0, kValSeed).ok());

  // The metrics: absent until the first evaluation, then its figures.
  metrics::Registry registry;
  TrainerMetrics recorder(registry, 0, "grpc", "cpu", 0.0);
  EXPECT_EQ(registry.Serialize().find("pshard_trainer_val_loss"), std::string::npos);
  recorder.RecordEval(*later);
  const std::string text = registry.Serialize();
  EXPECT_NE(text.find(absl::StrCat("pshard_trainer_val_loss{rank=\"0\"} ")), std::string::npos) << text;
  EXPECT_NE(text.find("pshard_trainer_val_step{rank=\"0\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("pshard_trainer_eval_seconds_total{rank=\"0\"} "), std::string::npos) << text;
}

}  // namespace
}  // namespace pshard::testing
