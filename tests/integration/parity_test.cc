// Parity: training sharded over N real servers with M trainers leaves the
// fp32 master weights bit-identical to unsharded training in one process.
#include <algorithm>
#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "pshard/config.h"
#include "tests/testutil/cluster_training.h"
#include "tests/testutil/local_cluster.h"
#include "tests/testutil/tiny_job.h"
#include "tests/testutil/reference_training.h"
#include "trainer_client/data/default_corpus.h"
#include "trainer_client/trainer.h"

namespace pshard::testing {
namespace {

constexpr int kSteps = 5;

JobConfig TinyJob(int shards, int trainers) { return TinyGptJob(shards, trainers, kSteps); }

TrainerOptions TinyTrainer() { return TinyTrainerOptions(7); }


void ExpectBitIdentical(const std::vector<std::vector<float>>& got,
                        const std::vector<std::vector<float>>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t u = 0; u < got.size(); ++u) {
    ASSERT_EQ(got[u].size(), want[u].size()) << "unit " << u;
    int64_t mismatches = 0;
    size_t first = 0;
    for (size_t i = 0; i < got[u].size(); ++i) {
      if (std::memcmp(&got[u][i], &want[u][i], sizeof(float)) != 0) {
        if (mismatches++ == 0) first = i;
      }
    }
    EXPECT_EQ(mismatches, 0) << "unit " << u << ": first mismatch at " << first << ": got "
                             << got[u][first] << ", want " << want[u][first];
  }
}

std::vector<std::vector<float>> Reference(const JobConfig& job, WireEncodings encoding, bool error_feedback) {
  auto weights = TrainReference(job, encoding, TinyTrainer(), TestCorpus(), kSteps, error_feedback);
  EXPECT_TRUE(weights.ok()) << weights.status();
  return weights.ok() ? *weights : std::vector<std::vector<float>>();
}

struct ParityCase {
  std::string transport;  ///< every trainer's data path
  int shards;
  int trainers;
  WireEncodings encoding;
  bool reshard_after_forward = true;
  bool error_feedback = true;  ///< for quantized gradients
  int stage = 3;
  int micro_batches = 1;  ///< K, pushed per micro-batch
};

std::string CaseName(const ::testing::TestParamInfo<ParityCase>& info) {
  const WireEncodings& e = info.param.encoding;
  std::string encoding = e.weights == e.grads ? std::string(WireEncodingName(e.weights))
                                              : absl::StrCat("weights_", std::string(WireEncodingName(e.weights)),
                                                             "_grads_", std::string(WireEncodingName(e.grads)));
  if (IsQuantized(e.weights) || IsQuantized(e.grads)) absl::StrAppend(&encoding, "_block", e.quant_block);
  if (IsQuantized(e.grads) && !info.param.error_feedback) absl::StrAppend(&encoding, "_no_feedback");
  return absl::StrCat(info.param.transport, "_N", info.param.shards, "_M", info.param.trainers, "_", encoding,
                      info.param.reshard_after_forward ? "" : "_kept_from_forward",
                      info.param.stage == 3 ? "" : absl::StrCat("_stage", info.param.stage),
                      info.param.micro_batches == 1 ? "" : absl::StrCat("_K", info.param.micro_batches));
}

/// The data paths this build has.
class ParityTest : public ::testing::TestWithParam<ParityCase> {};

TEST_P(ParityTest, ShardedTrainingEqualsUnshardedBitForBit) {
  const ParityCase c = GetParam();
  JobConfig job = TinyJob(c.shards, c.trainers);
  job.micro_batches = c.micro_batches;
  auto cluster = LocalCluster::Start(job);
  ASSERT_TRUE(cluster.ok()) << cluster.status();

  ClusterTraining how;
  how.encoding = c.encoding;
  how.error_feedback = c.error_feedback;
  how.transport = c.transport;
  how.trainer = TinyTrainer();
  how.trainer.reshard_after_forward = c.reshard_after_forward;
  how.trainer.stage = c.stage;
  how.steps = kSteps;
  absl::Status trained = TrainInThreads(**cluster, c.trainers, TestCorpus(), how);
  ASSERT_TRUE(trained.ok()) << trained;

  auto sharded = (*cluster)->ReadMasterWeights(kSteps);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  const auto reference = Reference(job, c.encoding, c.error_feedback);
  ExpectBitIdentical(*sharded, reference);

  // The weights moved: a parity check against untouched weights proves nothing.
  auto initial = ReferenceTraining::Create(job, c.encoding, TinyTrainer(), &TestCorpus());
  ASSERT_TRUE(initial.ok());
  EXPECT_NE(initial->MasterWeights(), reference);
}

// Every (N, M, encoding) over gRPC; other transports take a subset that
// still has N = 1 and several shards, one and several trainers, both encodings.
// Each direction's own encoding (bf16 weights with fp32 gradients, and the
// other way round), and units kept from forward to backward, for N in
// {1, 3}, M in {1, 2}, over every transport.
std::vector<ParityCase> AllCases() {
  std::vector<ParityCase> cases;
  constexpr WireEncoding kFp32 = WireEncoding::kFp32, kBf16 = WireEncoding::kBf16;
  for (const std::string& transport : EnabledTransports()) {
    const bool full = transport == "grpc";
    for (WireEncoding e : {kFp32, kBf16}) {
      for (int n : {1, 2, 3, 5}) {
        for (int m : {1, 2, 3}) {
          if (full || (n != 2 && m != 2)) cases.push_back({transport, n, m, e});
        }
      }
    }
    for (WireEncodings e : {WireEncodings(kBf16, kFp32), WireEncodings(kFp32, kBf16)}) {
      for (int n : {1, 3}) {
        for (int m : {1, 2}) cases.push_back({transport, n, m, e});
      }
    }
    // Units kept from forward to backward (--reshard_after_forward=false).
    for (int n : {1, 3}) {
      for (int m : {1, 2}) cases.push_back({transport, n, m, kBf16, /*reshard_after_forward=*/false});
    }
    // Block quantization: int8 weights, int8 and int4 gradients with error
    // feedback, and all three levers together. Blocks of 48 do not divide
    // the slices, so every slice ends in a short block.
    constexpr WireEncoding kInt8 = WireEncoding::kInt8, kInt4 = WireEncoding::kInt4;
    for (int n : {1, 3}) {
      for (int m : {1, 2}) {
        cases.push_back({transport, n, m, WireEncodings(kInt8, kBf16, 48)});
        cases.push_back({transport, n, m, WireEncodings(kBf16, kInt8, 48)});
        cases.push_back({transport, n, m, WireEncodings(kBf16, kInt4, 48)});
        cases.push_back({transport, n, m, WireEncodings(kInt8, kInt4, 48), /*reshard_after_forward=*/false});
      }
    }
    cases.push_back({transport, 3, 2, WireEncodings(kBf16, kInt4, 48), true, /*error_feedback=*/false});
    // Stage 2: a resident replica per step, used by both micro-batches'
    // passes; and with int8 weights and int4 gradients.
    for (int n : {1, 3}) {
      for (int m : {1, 2}) {
        cases.push_back({transport, n, m, kBf16, true, true, /*stage=*/2, /*micro_batches=*/2});
        cases.push_back({transport, n, m, WireEncodings(kInt8, kInt4, 48), true, true, 2, 2});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllTransports, ParityTest, ::testing::ValuesIn(AllCases()), CaseName);

// Contributions that arrive in a shuffled rank order reduce to the same
// bits: the owner sums in rank order whatever the order of arrival. Each push
// is acknowledged before the next starts, so the servers see exactly the
// shuffled order, and every step has units whose ranks arrive out of order.
TEST(ParityArrivalOrder, ShuffledPushesGiveTheSameWeights) {
  const int kShards = 3;
  const int kTrainers = 3;
  const JobConfig job = TinyJob(kShards, kTrainers);
  auto cluster = LocalCluster::Start(job);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<std::unique_ptr<ShardClient>> clients;
  for (int r = 0; r < kTrainers; ++r) {
    auto c = (*cluster)->Connect(r, WireEncoding::kFp32);
    ASSERT_TRUE(c.ok()) << c.status();
    clients.push_back(std::move(*c));
  }
  // The gradients come from a reference that follows the servers' weights.
  auto oracle = ReferenceTraining::Create(job, WireEncoding::kFp32, TinyTrainer(), &TestCorpus());
  ASSERT_TRUE(oracle.ok());
  std::mt19937 rng(42);
  for (int64_t step = 0; step < kSteps; ++step) {
    std::vector<std::vector<std::vector<float>>> grads;
    for (int r = 0; r < kTrainers; ++r) {
      auto g = oracle->MicroBatchGradient(step, r);
      ASSERT_TRUE(g.ok()) << g.status();
      grads.push_back(std::move(*g));
    }
    const int units = static_cast<int>(grads[0].size());
    std::vector<std::pair<int, int>> order;  // (rank, unit)
    for (int r = 0; r < kTrainers; ++r) {
      for (int u = 0; u < units; ++u) order.emplace_back(r, u);
    }
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<std::vector<int>> arrival(units);  // ranks, in the order each unit's pushes arrived
    for (auto [r, u] : order) {
      absl::Status s = clients[r]->StartPush(u, step, grads[r][u])->Wait();
      ASSERT_TRUE(s.ok()) << s;
      arrival[u].push_back(r);
    }
    int out_of_order = 0;
    for (const std::vector<int>& ranks : arrival) out_of_order += std::is_sorted(ranks.begin(), ranks.end()) ? 0 : 1;
    ASSERT_GT(out_of_order, 0) << "step " << step << ": every unit's pushes arrived in rank order";
    ASSERT_TRUE(oracle->Step(step).ok());
    // Wait until the step is applied everywhere before the next one.
    for (int u = 0; u < units; ++u) {
      ASSERT_TRUE(clients[0]->StartFetch(u, step + 1)->Wait().ok());
    }
  }
  auto sharded = (*cluster)->ReadMasterWeights(kSteps);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  ExpectBitIdentical(*sharded, oracle->MasterWeights());
}

}  // namespace
}  // namespace pshard::testing
