// Gradient accumulation (pushing every micro-batch, or accumulating on the
// trainer) and fabric groups (all-gather of fetches, reduce-scatter of
// gradients inside the group) keep bit-for-bit parity.
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testutil/local_cluster.h"
#include "tests/testutil/reference_training.h"
#include "trainer_client/data/default_corpus.h"
#include "trainer_client/group_collective.h"
#include "trainer_client/trainer.h"

namespace pshard::testing {
namespace {

constexpr int kSteps = 4;

JobConfig Job(int shards, int trainers, int micro_batches, bool accumulate) {
  JobConfig job;
  job.model = GptConfig{.num_layers = 2, .d_model = 16, .num_heads = 2, .context = 8, .vocab = 256};
  job.optimizer.lr = 1e-2;
  job.optimizer.warmup_steps = 1;
  job.optimizer.total_steps = kSteps;
  job.optimizer.grad_clip = 0.5;
  job.num_shards = shards;
  job.num_trainers = trainers;
  job.slice_alignment = 8;
  job.micro_batches = micro_batches;
  job.accumulate_on_trainer = accumulate;
  return job;
}

TrainerOptions Tiny() {
  TrainerOptions t;
  t.batch = 2;
  t.seq_len = 8;
  t.data_seed = 11;
  return t;
}

const TokenDataset& Corpus() {
  static const TokenDataset* data = new TokenDataset(TokenDataset::FromText(DefaultCorpus()));
  return *data;
}

// Trains kSteps with every trainer in a thread; `group_size` > 1 puts
// consecutive ranks into host fabric groups. Returns the master weights.
std::vector<std::vector<float>> TrainSharded(const JobConfig& job, WireEncoding encoding, int group_size) {
  auto cluster = LocalCluster::Start(job);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  if (!cluster.ok()) return {};
  std::vector<std::vector<std::unique_ptr<GroupCollective>>> groups;
  if (group_size > 1) {
    for (int g = 0; g < job.num_trainers / group_size; ++g) groups.push_back(CreateHostGroup(group_size));
  }
  std::vector<absl::Status> results(job.num_trainers);
  std::vector<std::thread> threads;
  for (int r = 0; r < job.num_trainers; ++r) {
    threads.emplace_back([&, r] {
      auto client = (*cluster)->Connect(r, encoding);
      if (!client.ok()) {
        results[r] = client.status();
        return;
      }
      TrainerOptions options = Tiny();
      if (group_size > 1) options.group = groups[r / group_size][r % group_size].get();
      auto trainer = Trainer::Create(client->get(), &Corpus(), options);
      if (!trainer.ok()) {
        results[r] = trainer.status();
        return;
      }
      for (int64_t step = 0; step < kSteps; ++step) {
        absl::StatusOr<StepReport> report = (*trainer)->RunStep(step);
        if (!report.ok()) {
          results[r] = report.status();
          return;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < job.num_trainers; ++r) EXPECT_TRUE(results[r].ok()) << "trainer " << r << ": " << results[r];
  auto weights = (*cluster)->ReadMasterWeights();
  EXPECT_TRUE(weights.ok()) << weights.status();
  return weights.ok() ? *weights : std::vector<std::vector<float>>();
}

std::vector<std::vector<float>> Reference(const JobConfig& job, WireEncoding encoding) {
  auto ref = ReferenceTraining::Create(job, encoding, Tiny(), &Corpus());
  EXPECT_TRUE(ref.ok()) << ref.status();
  for (int64_t step = 0; step < kSteps; ++step) EXPECT_TRUE(ref->Step(step).ok());
  return ref->MasterWeights();
}

bool BitIdentical(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size() || a.empty()) return false;
  for (size_t u = 0; u < a.size(); ++u) {
    if (a[u].size() != b[u].size() || std::memcmp(a[u].data(), b[u].data(), a[u].size() * sizeof(float)) != 0) {
      return false;
    }
  }
  return true;
}

struct Case {
  int micro_batches;
  bool accumulate;
  WireEncoding encoding;
};

class AccumulationTest : public ::testing::TestWithParam<Case> {};

TEST_P(AccumulationTest, EqualsUnshardedReferenceBitForBit) {
  const Case c = GetParam();
  const JobConfig job = Job(/*shards=*/3, /*trainers=*/2, c.micro_batches, c.accumulate);
  const auto sharded = TrainSharded(job, c.encoding, 1);
  EXPECT_TRUE(BitIdentical(sharded, Reference(job, c.encoding)));
}

INSTANTIATE_TEST_SUITE_P(
    Modes, AccumulationTest,
    ::testing::Values(Case{2, false, WireEncoding::kFp32}, Case{2, true, WireEncoding::kFp32},
                      Case{3, false, WireEncoding::kBf16}, Case{3, true, WireEncoding::kBf16},
                      Case{4, true, WireEncoding::kFp32}),
    [](const auto& info) {
      return absl::StrCat("K", info.param.micro_batches, info.param.accumulate ? "_accumulate_" : "_push_every_",
                          std::string(WireEncodingName(info.param.encoding)));
    });

// Accumulating on the trainer changes the order of the sum, so the two
// modes differ in the last bits — but both train: weights move the same way.
TEST(AccumulationTest, BothModesMoveTheWeights) {
  const auto pushed = Reference(Job(3, 2, 2, false), WireEncoding::kFp32);
  const auto accumulated = Reference(Job(3, 2, 2, true), WireEncoding::kFp32);
  auto initial = ReferenceTraining::Create(Job(3, 2, 2, false), WireEncoding::kFp32, Tiny(), &Corpus());
  ASSERT_TRUE(initial.ok());
  EXPECT_FALSE(BitIdentical(pushed, initial->MasterWeights()));
  EXPECT_FALSE(BitIdentical(accumulated, initial->MasterWeights()));
}

struct GroupCase {
  int group_size;
  int micro_batches;
  bool accumulate;
};

class FabricGroupTest : public ::testing::TestWithParam<GroupCase> {};

TEST_P(FabricGroupTest, GroupedEqualsUngroupedBitForBit) {
  const GroupCase c = GetParam();
  const JobConfig job = Job(/*shards=*/3, /*trainers=*/4, c.micro_batches, c.accumulate);
  const auto grouped = TrainSharded(job, WireEncoding::kFp32, c.group_size);
  const auto ungrouped = TrainSharded(job, WireEncoding::kFp32, 1);
  EXPECT_TRUE(BitIdentical(grouped, ungrouped));
  EXPECT_TRUE(BitIdentical(grouped, Reference(job, WireEncoding::kFp32)));
}

INSTANTIATE_TEST_SUITE_P(HostGroups, FabricGroupTest,
                         ::testing::Values(GroupCase{2, 1, false}, GroupCase{4, 1, false}, GroupCase{2, 2, false},
                                           GroupCase{4, 2, true}, GroupCase{2, 2, true}),
                         [](const auto& info) {
                           return absl::StrCat("G", info.param.group_size, "_K", info.param.micro_batches,
                                               info.param.accumulate ? "_accumulate" : "_push_every");
                         });

TEST(FabricGroupTest, MisalignedGroupIsRefused) {
  const JobConfig job = Job(2, 3, 1, false);
  auto cluster = LocalCluster::Start(job);
  ASSERT_TRUE(cluster.ok());
  auto client = (*cluster)->Connect(1, WireEncoding::kFp32);  // ranks 1..2 of 3
  ASSERT_TRUE(client.ok());
  auto group = CreateHostGroup(2);
  TrainerOptions options = Tiny();
  options.group = group[0].get();
  auto trainer = Trainer::Create(client->get(), &Corpus(), options);
  ASSERT_FALSE(trainer.ok());
  EXPECT_NE(trainer.status().message().find("does not align"), std::string::npos) << trainer.status();
}

}  // namespace
}  // namespace pshard::testing
