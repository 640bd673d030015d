// Gradient accumulation (pushing every micro-batch, accumulating on the
// trainer, or all micro-batches in one pass that fetches once per step) and
// fabric groups (all-gather of fetches, reduce-scatter of gradients inside
// the group) keep bit-for-bit parity.
#include <cstring>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testutil/cluster_training.h"
#include "tests/testutil/local_cluster.h"
#include "tests/testutil/tiny_job.h"
#include "tests/testutil/reference_training.h"
#include "trainer_client/group/host/host_group.h"
#include "trainer_client/data/default_corpus.h"
#include "trainer_client/group/group_collective.h"
#include "trainer_client/trainer.h"

namespace pshard::testing {
namespace {

constexpr int kSteps = 4;

JobConfig Job(int shards, int trainers, int micro_batches, bool accumulate) {
  JobConfig job = TinyGptJob(shards, trainers, kSteps);
  job.micro_batches = micro_batches;
  job.accumulate_on_trainer = accumulate;
  return job;
}

TrainerOptions Tiny() { return TinyTrainerOptions(11); }


// Trains kSteps with every trainer in a thread; `group_size` > 1 puts
// consecutive ranks into host fabric groups. Returns the master weights.
std::vector<std::vector<float>> TrainSharded(const JobConfig& job, WireEncodings encoding, int group_size,
                                             const std::string& transport, bool fetch_once_per_step = false,
                                             int secondary_shard = 0) {
  auto cluster = LocalCluster::Start(job);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  if (!cluster.ok()) return {};
  ClusterTraining how;
  how.encoding = encoding;
  how.transport = transport;
  how.trainer = Tiny();
  how.trainer.fetch_once_per_step = fetch_once_per_step;
  how.trainer.secondary_shard = secondary_shard;
  how.group_size = group_size;
  how.steps = kSteps;
  absl::Status trained = TrainInThreads(**cluster, job.num_trainers, TestCorpus(), how);
  EXPECT_TRUE(trained.ok()) << trained;
  auto weights = (*cluster)->ReadMasterWeights(kSteps);
  EXPECT_TRUE(weights.ok()) << weights.status();
  return weights.ok() ? *weights : std::vector<std::vector<float>>();
}

std::vector<std::vector<float>> Reference(const JobConfig& job, WireEncoding encoding) {
  auto weights = TrainReference(job, encoding, Tiny(), TestCorpus(), kSteps);
  EXPECT_TRUE(weights.ok()) << weights.status();
  return weights.ok() ? *weights : std::vector<std::vector<float>>();
}

struct Case {
  int micro_batches;
  bool accumulate;
  WireEncoding encoding;
};

class AccumulationTest : public ::testing::TestWithParam<std::tuple<Case, std::string>> {};

TEST_P(AccumulationTest, EqualsUnshardedReferenceBitForBit) {
  const auto& [c, transport] = GetParam();
  const JobConfig job = Job(/*shards=*/3, /*trainers=*/2, c.micro_batches, c.accumulate);
  const auto sharded = TrainSharded(job, c.encoding, 1, transport);
  EXPECT_TRUE(BitIdentical(sharded, Reference(job, c.encoding)));
}

INSTANTIATE_TEST_SUITE_P(
    Modes, AccumulationTest,
    ::testing::Combine(::testing::Values(Case{2, false, WireEncoding::kFp32}, Case{2, true, WireEncoding::kFp32},
                                         Case{3, false, WireEncoding::kBf16}, Case{3, true, WireEncoding::kBf16},
                                         Case{4, true, WireEncoding::kFp32}),
                       ::testing::ValuesIn(EnabledTransports())),
    [](const auto& info) {
      const Case& c = std::get<0>(info.param);
      return absl::StrCat(std::get<1>(info.param), "_K", c.micro_batches, c.accumulate ? "_accumulate_" : "_push_every_",
                          std::string(WireEncodingName(c.encoding)));
    });

// Accumulating on the trainer changes the order of the sum, so the two
// modes differ in the last bits — but both train: weights move the same way.
TEST(AccumulationTest, BothModesMoveTheWeights) {
  const auto pushed = Reference(Job(3, 2, 2, false), WireEncoding::kFp32);
  const auto accumulated = Reference(Job(3, 2, 2, true), WireEncoding::kFp32);
  auto initial = ReferenceTraining::Create(Job(3, 2, 2, false), WireEncoding::kFp32, Tiny(), &TestCorpus());
  ASSERT_TRUE(initial.ok());
  EXPECT_FALSE(BitIdentical(pushed, initial->MasterWeights()));
  EXPECT_FALSE(BitIdentical(accumulated, initial->MasterWeights()));
}

struct GroupCase {
  int group_size;
  int micro_batches;
  bool accumulate;
};

class FabricGroupTest : public ::testing::TestWithParam<std::tuple<GroupCase, std::string>> {};

TEST_P(FabricGroupTest, GroupedEqualsUngroupedBitForBit) {
  const auto& [c, transport] = GetParam();
  const JobConfig job = Job(/*shards=*/3, /*trainers=*/4, c.micro_batches, c.accumulate);
  const auto grouped = TrainSharded(job, WireEncoding::kFp32, c.group_size, transport);
  const auto ungrouped = TrainSharded(job, WireEncoding::kFp32, 1, transport);
  EXPECT_TRUE(BitIdentical(grouped, ungrouped));
  EXPECT_TRUE(BitIdentical(grouped, Reference(job, WireEncoding::kFp32)));
}

INSTANTIATE_TEST_SUITE_P(HostGroups, FabricGroupTest,
                         ::testing::Combine(::testing::Values(GroupCase{2, 1, false}, GroupCase{4, 1, false},
                                                              GroupCase{2, 2, false}, GroupCase{4, 2, true},
                                                              GroupCase{2, 2, true}),
                                            ::testing::ValuesIn(EnabledTransports())),
                         [](const auto& info) {
                           const GroupCase& c = std::get<0>(info.param);
                           return absl::StrCat(std::get<1>(info.param), "_G", c.group_size, "_K", c.micro_batches,
                                               c.accumulate ? "_accumulate" : "_push_every");
                         });

// Quantized gradients in fabric groups: each member quantizes its part of
// the other members' slices (with its residual of them) for the group's
// reduce-scatter, the owner sums, and quantizes each slice of the sum once
// more, carrying its residual, to push it; the reference does the same (and
// int8 weights are fetched by each member for its own shards, then
// all-gathered as int8 blocks that decode to the same bits).
class FabricGroupQuantizedTest : public ::testing::TestWithParam<std::tuple<GroupCase, std::string>> {};

TEST_P(FabricGroupQuantizedTest, GroupedEqualsTheReferenceBitForBit) {
  const auto& [c, transport] = GetParam();
  const JobConfig job = Job(/*shards=*/3, /*trainers=*/4, c.micro_batches, c.accumulate);
  for (const WireEncodings& encodings : {WireEncodings(WireEncoding::kInt8, WireEncoding::kInt4, 48),
                                         WireEncodings(WireEncoding::kBf16, WireEncoding::kInt8, 48)}) {
    SCOPED_TRACE(encodings.ToString());
    const auto grouped = TrainSharded(job, encodings, c.group_size, transport);
    auto reference = TrainReference(job, encodings, Tiny(), TestCorpus(), kSteps, /*error_feedback=*/true,
                                    c.group_size);
    ASSERT_TRUE(reference.ok()) << reference.status();
    EXPECT_TRUE(BitIdentical(grouped, *reference));
    // The group's roundings are not those of trainers pushing alone.
    auto ungrouped = TrainReference(job, encodings, Tiny(), TestCorpus(), kSteps);
    ASSERT_TRUE(ungrouped.ok());
    EXPECT_FALSE(BitIdentical(*reference, *ungrouped));
  }
}

INSTANTIATE_TEST_SUITE_P(HostGroups, FabricGroupQuantizedTest,
                         ::testing::Combine(::testing::Values(GroupCase{2, 1, false}, GroupCase{2, 2, true}),
                                            ::testing::ValuesIn(EnabledTransports())),
                         [](const auto& info) {
                           const GroupCase& c = std::get<0>(info.param);
                           return absl::StrCat(std::get<1>(info.param), "_G", c.group_size, "_K", c.micro_batches,
                                               c.accumulate ? "_accumulate" : "_push_every");
                         });

// The secondary shard: each member keeps its half of every unit from
// forward and backward all-gathers the unit within the group instead of
// fetching it; the same bits as the reference (which, for quantized
// gradients, quantizes each group's sum once), for N in {1, 3}.
struct SecondaryCase {
  int shards;
  int trainers;
  int micro_batches;
  bool accumulate;
};

class SecondaryShardTest : public ::testing::TestWithParam<std::tuple<SecondaryCase, std::string>> {};

TEST_P(SecondaryShardTest, BackwardAllGathersWithinTheGroupAndTrainsTheSameBits) {
  const auto& [c, transport] = GetParam();
  const JobConfig job = Job(c.shards, c.trainers, c.micro_batches, c.accumulate);
  for (const WireEncodings& encodings : {WireEncodings(WireEncoding::kFp32),
                                         WireEncodings(WireEncoding::kInt8, WireEncoding::kInt4, 48)}) {
    SCOPED_TRACE(encodings.ToString());
    const auto trained = TrainSharded(job, encodings, 2, transport, false, /*secondary_shard=*/2);
    auto reference = TrainReference(job, encodings, Tiny(), TestCorpus(), kSteps, /*error_feedback=*/true, 2);
    ASSERT_TRUE(reference.ok()) << reference.status();
    EXPECT_TRUE(BitIdentical(trained, *reference));
  }
}

INSTANTIATE_TEST_SUITE_P(HostGroups, SecondaryShardTest,
                         ::testing::Combine(::testing::Values(SecondaryCase{1, 2, 1, false}, SecondaryCase{3, 2, 1, false},
                                                              SecondaryCase{3, 4, 2, false}, SecondaryCase{3, 2, 2, true}),
                                            ::testing::ValuesIn(EnabledTransports())),
                         [](const auto& info) {
                           const SecondaryCase& c = std::get<0>(info.param);
                           return absl::StrCat(std::get<1>(info.param), "_N", c.shards, "_M", c.trainers, "_K",
                                               c.micro_batches, c.accumulate ? "_accumulate" : "_push_every");
                         });

// A secondary shard needs a fabric group of its size.
TEST(SecondaryShardTest, NeedsAFabricGroupOfItsSize) {
  const JobConfig job = Job(2, 1, 1, false);
  auto cluster = LocalCluster::Start(job);
  ASSERT_TRUE(cluster.ok());
  auto client = (*cluster)->Connect(0, WireEncoding::kFp32);
  ASSERT_TRUE(client.ok());
  TrainerOptions options = Tiny();
  options.secondary_shard = 2;
  auto trainer = Trainer::Create(client->get(), &TestCorpus(), options);
  ASSERT_FALSE(trainer.ok());
  EXPECT_EQ(trainer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(trainer.status().message().find("fabric group"), std::string::npos) << trainer.status();
}

// Fetching once per step: all micro-batches in one pass, their gradients
// summed by the model in the reduction tree's order, so the servers see
// exactly what accumulation on the trainer gives them; alone and in groups.
struct FetchOnceCase {
  int micro_batches;
  int group_size;
};

class FetchOncePerStepTest : public ::testing::TestWithParam<std::tuple<FetchOnceCase, std::string>> {};

TEST_P(FetchOncePerStepTest, EqualsAccumulationBitForBit) {
  const auto& [c, transport] = GetParam();
  const JobConfig job = Job(/*shards=*/3, /*trainers=*/2 * c.group_size, c.micro_batches, /*accumulate=*/true);
  const auto once = TrainSharded(job, WireEncoding::kFp32, c.group_size, transport, /*fetch_once_per_step=*/true);
  EXPECT_TRUE(BitIdentical(once, Reference(job, WireEncoding::kFp32)));
}

INSTANTIATE_TEST_SUITE_P(Modes, FetchOncePerStepTest,
                         ::testing::Combine(::testing::Values(FetchOnceCase{2, 1}, FetchOnceCase{3, 1},
                                                              FetchOnceCase{4, 1}, FetchOnceCase{3, 2}),
                                            ::testing::ValuesIn(EnabledTransports())),
                         [](const auto& info) {
                           const FetchOnceCase& c = std::get<0>(info.param);
                           return absl::StrCat(std::get<1>(info.param), "_K", c.micro_batches, "_G", c.group_size);
                         });

// One trainer, step by step: the same losses and pushes, 1/K of the fetches.
TEST(FetchOncePerStepTest, FetchesOncePerStepAndPushesTheSame) {
  constexpr int kMicro = 4;
  const JobConfig job = Job(/*shards=*/2, /*trainers=*/1, kMicro, /*accumulate=*/true);
  std::vector<StepReport> reports[2];
  for (bool once : {false, true}) {
    auto cluster = LocalCluster::Start(job);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    auto client = (*cluster)->Connect(0, WireEncoding::kFp32);
    ASSERT_TRUE(client.ok()) << client.status();
    TrainerOptions options = Tiny();
    options.fetch_once_per_step = once;
    auto trainer = Trainer::Create(client->get(), &TestCorpus(), options);
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    EXPECT_EQ((*trainer)->model().lanes(), once ? kMicro : 1);
    for (int64_t step = 0; step < 2; ++step) {
      absl::StatusOr<StepReport> r = (*trainer)->RunStep(step);
      ASSERT_TRUE(r.ok()) << r.status();
      reports[once].push_back(*r);
    }
  }
  for (size_t s = 0; s < reports[0].size(); ++s) {
    const StepReport& per_micro = reports[0][s];
    const StepReport& once = reports[1][s];
    EXPECT_EQ(once.loss, per_micro.loss) << "step " << s;
    EXPECT_EQ(once.tokens, per_micro.tokens);
    EXPECT_EQ(once.bytes_pushed, per_micro.bytes_pushed);
    EXPECT_EQ(once.bytes_fetched * kMicro, per_micro.bytes_fetched) << "step " << s;
    EXPECT_EQ(once.fetch_latencies.size() * kMicro, per_micro.fetch_latencies.size());
    EXPECT_GT(once.grad_norm, 0);
  }
}

TEST(FetchOncePerStepTest, NeedsAccumulationOnTheTrainer) {
  const JobConfig job = Job(2, 1, /*micro_batches=*/2, /*accumulate=*/false);
  auto cluster = LocalCluster::Start(job);
  ASSERT_TRUE(cluster.ok());
  auto client = (*cluster)->Connect(0, WireEncoding::kFp32);
  ASSERT_TRUE(client.ok());
  TrainerOptions options = Tiny();
  options.fetch_once_per_step = true;
  auto trainer = Trainer::Create(client->get(), &TestCorpus(), options);
  ASSERT_FALSE(trainer.ok());
  EXPECT_EQ(trainer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(trainer.status().message().find("accumulate_on_trainer"), std::string::npos) << trainer.status();
}

TEST(FabricGroupTest, MisalignedGroupIsRefused) {
  const JobConfig job = Job(2, 3, 1, false);
  auto cluster = LocalCluster::Start(job);
  ASSERT_TRUE(cluster.ok());
  auto client = (*cluster)->Connect(1, WireEncoding::kFp32);  // ranks 1..2 of 3
  ASSERT_TRUE(client.ok());
  auto group = CreateHostGroup(2);
  TrainerOptions options = Tiny();
  options.group = group[0].get();
  auto trainer = Trainer::Create(client->get(), &TestCorpus(), options);
  ASSERT_FALSE(trainer.ok());
  EXPECT_NE(trainer.status().message().find("does not align"), std::string::npos) << trainer.status();
}

}  // namespace
}  // namespace pshard::testing
