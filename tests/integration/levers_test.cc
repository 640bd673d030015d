// The slow-link levers change what crosses the wire, not what is computed:
// each one trains to the same bits as the default, and moves the bytes its
// formula says.
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/levers.h"
#include "common/status_macros.h"
#include "lab/plan.h"
#include "gtest/gtest.h"
#include "tests/testutil/cluster_training.h"
#include "tests/testutil/local_cluster.h"
#include "tests/testutil/reference_training.h"
#include "tests/testutil/tiny_job.h"
#include "trainer_client/prefetcher.h"
#include "trainer_client/trainer.h"

namespace pshard::testing {
namespace {

constexpr int kSteps = 3;

struct TrainedRun {
  std::vector<int64_t> fetched;  // wire bytes fetched, per step
  std::vector<std::vector<float>> weights;
  std::vector<int64_t> last_unit_fetch;  // wire bytes of one fetch of the last unit, per step
};

absl::StatusOr<TrainedRun> Train(const std::string& transport, bool reshard_after_forward) {
  const JobConfig job = TinyGptJob(3, 1, kSteps);
  ASSIGN_OR_RETURN(std::unique_ptr<LocalCluster> cluster, LocalCluster::Start(job));
  ASSIGN_OR_RETURN(std::unique_ptr<ShardClient> client, cluster->Connect(0, WireEncoding::kBf16, transport));
  TrainerOptions options = TinyTrainerOptions(7);
  options.reshard_after_forward = reshard_after_forward;
  ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(client.get(), &TestCorpus(), options));
  TrainedRun run;
  const int last = static_cast<int>(client->layout().spec.units.size()) - 1;
  for (int64_t step = 0; step < kSteps; ++step) {
    // The frames' sizes depend on the version's checksum (a varint): the
    // last unit is measured at the version the step fetches.
    std::shared_ptr<UnitTransfer> fetch = client->StartFetch(last, step);
    RETURN_IF_ERROR(fetch->Wait());
    run.last_unit_fetch.push_back(fetch->wire_bytes());
    ASSIGN_OR_RETURN(StepReport report, trainer->RunStep(step));
    run.fetched.push_back(report.bytes_fetched);
  }
  ASSIGN_OR_RETURN(run.weights, cluster->ReadMasterWeights(kSteps));
  return run;
}

class ReshardAfterForwardTest : public ::testing::TestWithParam<std::string> {};

// Resharding fetches units 0..K-1 in forward and 0..K-2 again in backward;
// keeping them fetches 0..K-1 once: the difference is every unit but the
// last, exactly, and the weights are the same bits.
TEST_P(ReshardAfterForwardTest, KeepingUnitsFetchesEachOncePerPassAndTrainsTheSameBits) {
  absl::StatusOr<TrainedRun> resharded = Train(GetParam(), true);
  ASSERT_TRUE(resharded.ok()) << resharded.status();
  absl::StatusOr<TrainedRun> kept = Train(GetParam(), false);
  ASSERT_TRUE(kept.ok()) << kept.status();
  ASSERT_EQ(kept->weights.size(), resharded->weights.size());
  for (size_t u = 0; u < kept->weights.size(); ++u) {
    ASSERT_EQ(kept->weights[u].size(), resharded->weights[u].size());
    EXPECT_EQ(std::memcmp(kept->weights[u].data(), resharded->weights[u].data(),
                          kept->weights[u].size() * sizeof(float)),
              0)
        << "unit " << u;
  }
  for (int step = 0; step < kSteps; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    EXPECT_GT(kept->fetched[step], 0);
    EXPECT_EQ(resharded->fetched[step] - kept->fetched[step],
              kept->fetched[step] - kept->last_unit_fetch[step]);
  }
}

INSTANTIATE_TEST_SUITE_P(AllTransports, ReshardAfterForwardTest, ::testing::ValuesIn(EnabledTransports()));

// What `pshard plan` is told about a job that trains with `trainer` and
// `encodings` in fabric groups of `group`.
PlanInput PlanInputOf(const JobConfig& job, const TrainerOptions& trainer, const WireEncodings& encodings,
                      int group) {
  PlanInput in;
  in.spec = job.model;
  in.shape = GptConfigFromSpec(job.model).value();
  in.servers = job.num_shards;
  in.trainers = job.num_trainers;
  in.group = group;
  in.micro_batches = job.micro_batches;
  in.accumulate_on_trainer = job.accumulate_on_trainer;
  in.batch = trainer.batch;
  in.seq_len = trainer.seq_len;
  in.prefetch = trainer.prefetch_depth;
  in.stage = trainer.stage;
  in.fetch_once_per_step = trainer.fetch_once_per_step;
  in.reshard = ReshardAfterForward{trainer.reshard_after_forward, trainer.secondary_shard};
  in.encodings = encodings;
  in.error_feedback = encodings.grad_format().quantized();
  in.slice_alignment = job.slice_alignment;
  in.device_flops = 1e9;
  in.mfu = 1.0;
  return in;
}

// One lever setting, and the payload per step its docs/levers.md formula
// gives for a job's layout.
struct LeverCase {
  std::string name;
  WireEncodings encodings;
  bool reshard_after_forward = true;
  int micro_batches = 1;  ///< K, pushed per micro-batch unless accumulated
  int stage = 3;
  bool accumulate_on_trainer = false;  ///< pushed once per step
  bool fetch_once_per_step = false;    ///< one pass for all K
};

// E(n): bytes of a slice of n elements in `format` (docs/levers.md,
// "Notation"): n·b for fp32 and bf16; for int8 and int4 n (or ⌈·/2⌉ per
// block) codes plus 4 bytes per block of B.
int64_t SliceBytes(const WireFormat& format, int64_t n) {
  switch (format.encoding()) {
    case WireEncoding::kFp32: return 4 * n;
    case WireEncoding::kBf16: return 2 * n;
    case WireEncoding::kInt8: return n + 4 * ((n + format.block() - 1) / format.block());
    case WireEncoding::kInt4: {
      const int64_t b = format.block();
      return (n / b) * (b / 2) + ((n % b) + 1) / 2 + 4 * ((n + b - 1) / b);
    }
  }
  return -1;
}

// Σ over the unit's N slices of E.
int64_t UnitBytes(const WireFormat& format, const UnitPartition& p, int shards) {
  int64_t bytes = 0;
  for (int s = 0; s < shards; ++s) bytes += SliceBytes(format, p.Slice(s).length);
  return bytes;
}

std::string LeverName(const ::testing::TestParamInfo<std::tuple<std::string, LeverCase>>& info) {
  return absl::StrCat(std::get<0>(info.param), "_", std::get<1>(info.param).name);
}

class LeverBytesTest : public ::testing::TestWithParam<std::tuple<std::string, LeverCase>> {};

// Per step: weights fetched P · Σ_u c_u · E_w(u), with c_u = 2 for every
// unit but the last under stage 3 and 1 when units are kept from forward,
// P = K passes (1 when fetching once per step); at stage 2, Σ_u E_w(u) once
// per step whatever K; gradients pushed K · Σ_u E_g(u) (once when
// accumulated on the trainer). Exactly, as the payload metric counts, and
// as `pshard plan` predicts.
TEST_P(LeverBytesTest, EachStepMovesThePayloadOfItsFormula) {
  const auto& [transport, c] = GetParam();
  const int shards = 3;
  JobConfig job = TinyGptJob(shards, 1, kSteps);
  job.micro_batches = c.micro_batches;
  job.accumulate_on_trainer = c.accumulate_on_trainer;
  auto cluster = LocalCluster::Start(job);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto client = (*cluster)->Connect(0, c.encodings, transport);
  ASSERT_TRUE(client.ok()) << client.status();
  TrainerOptions options = TinyTrainerOptions(7);
  options.reshard_after_forward = c.reshard_after_forward;
  options.stage = c.stage;
  options.fetch_once_per_step = c.fetch_once_per_step;
  auto trainer = Trainer::Create(client->get(), &TestCorpus(), options);
  ASSERT_TRUE(trainer.ok()) << trainer.status();

  const std::vector<UnitPartition>& units = (*client)->layout().partitions;
  int64_t fetched = 0, pushed = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    const int64_t copies = c.reshard_after_forward && u + 1 < units.size() ? 2 : 1;
    const int64_t passes = c.stage == 3 && !c.fetch_once_per_step ? c.micro_batches : 1;
    fetched += passes * (c.stage == 3 ? copies : 1) * UnitBytes(c.encodings.weight_format(), units[u], shards);
    pushed += (c.accumulate_on_trainer ? 1 : c.micro_batches) * UnitBytes(c.encodings.grad_format(), units[u], shards);
  }
  // pshard plan predicts the same bytes.
  const PlanInput plan_input = PlanInputOf(job, options, c.encodings, 1);
  ASSERT_TRUE(plan_input.Validate().ok()) << plan_input.Validate();
  const absl::StatusOr<StepBytes> planned = StepBytesOf(plan_input, 0);
  ASSERT_TRUE(planned.ok()) << planned.status();
  for (int64_t step = 0; step < kSteps; ++step) {
    auto report = (*trainer)->RunStep(step);
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_EQ(report->payload_fetched, fetched) << "step " << step;
    EXPECT_EQ(report->payload_pushed, pushed) << "step " << step;
    EXPECT_EQ(report->payload_fetched, planned->fetched) << "step " << step;
    EXPECT_EQ(report->payload_pushed, planned->pushed) << "step " << step;
    // The wire adds framing to the payload, and only a little.
    EXPECT_GT(report->bytes_fetched, report->payload_fetched);
    EXPECT_LT(report->bytes_fetched, report->payload_fetched + 4096 * static_cast<int64_t>(units.size()) * 2);
  }
}

std::vector<LeverCase> LeverCases() {
  constexpr WireEncoding kFp32 = WireEncoding::kFp32, kBf16 = WireEncoding::kBf16, kInt8 = WireEncoding::kInt8,
                         kInt4 = WireEncoding::kInt4;
  return {
      {"stage3_bf16", WireEncoding::kBf16},
      {"stage3_fp32_weights_bf16_grads", WireEncodings(kFp32, kBf16)},
      {"stage3_K2", WireEncoding::kBf16, true, 2},
      {"kept_from_forward", WireEncoding::kBf16, false},
      {"int8_weights", WireEncodings(kInt8, kBf16, 48)},
      {"int8_grads", WireEncodings(kBf16, kInt8, 48)},
      {"int4_grads", WireEncodings(kBf16, kInt4, 48)},
      {"int8_weights_int4_grads_kept", WireEncodings(kInt8, kInt4, 48), false},
      {"stage2_K2", WireEncoding::kBf16, true, 2, /*stage=*/2},
      {"stage2_K2_int8_weights_int4_grads", WireEncodings(kInt8, kInt4, 48), true, 2, 2},
      {"K2_accumulated", WireEncoding::kBf16, true, 2, 3, /*accumulate_on_trainer=*/true},
      {"K2_fetched_once_per_step", WireEncoding::kBf16, true, 2, 3, true, /*fetch_once_per_step=*/true},
  };
}

INSTANTIATE_TEST_SUITE_P(AllTransports, LeverBytesTest,
                         ::testing::Combine(::testing::ValuesIn(EnabledTransports()), ::testing::ValuesIn(LeverCases())),
                         LeverName);

// Fabric groups of 2 (N = 3, M = 2): each member moves over the slow link
// only its shards' slices (member 0 shards 0 and 2, member 1 shard 1), and
// receives the rest of every unit, and of its gradient parts' sums, on the
// fabric. Per member m with shards S_m, per step:
//   fetched   Σ_u c_u · Σ_{s∈S_m} E_w(u, s), c_u = 2 for all units but the
//             last, or 1 for all with the secondary shard;
//   pushed    Σ_u Σ_{s∈S_m} E_g(u, s);
//   gathered  Σ_u c'_u · Σ_{s∉S_m} E_w(u, s), c'_u = 2 for all units but
//             the last, with or without the secondary shard (the fabric
//             moves the other members' slices encoded as they were fetched);
//   reduced   Σ_u (G − 1) · Σ_{s∈S_m} E_g(u, s) (each other member hands
//             over its part of this member's slices encoded as pushed).
struct GroupLeverCase {
  std::string name;
  WireEncodings encodings;
  int secondary_shard = 0;
};

class GroupLeverBytesTest : public ::testing::TestWithParam<std::tuple<std::string, GroupLeverCase>> {};

TEST_P(GroupLeverBytesTest, EachMemberMovesItsShareOverEachLink) {
  const auto& [transport, c] = GetParam();
  constexpr int kShards = 3, kTrainers = 2, kGroup = 2;
  const JobConfig job = TinyGptJob(kShards, kTrainers, kSteps);
  auto cluster = LocalCluster::Start(job);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<std::vector<StepReport>> reports;
  ClusterTraining how;
  how.encoding = c.encodings;
  how.transport = transport;
  how.trainer = TinyTrainerOptions(7);
  how.trainer.secondary_shard = c.secondary_shard;
  how.group_size = kGroup;
  how.steps = kSteps;
  how.reports = &reports;
  ASSERT_TRUE(TrainInThreads(**cluster, kTrainers, TestCorpus(), how).ok());
  auto layout = MakeJobLayout(job);
  ASSERT_TRUE(layout.ok());
  const std::vector<UnitPartition>& units = layout->partitions;
  for (int r = 0; r < kTrainers; ++r) {
    const std::vector<int> mine = MemberShards(kShards, kGroup, r % kGroup);
    int64_t fetched = 0, pushed = 0, gathered = 0, reduced = 0;
    for (size_t u = 0; u < units.size(); ++u) {
      const bool last = u + 1 == units.size();
      // The fabric carries the slices as the wire does: the other members'
      // as fetched, every other member's part of this member's as pushed.
      int64_t fetch_bytes = 0, push_bytes = 0, others_bytes = 0;
      for (int s = 0; s < kShards; ++s) {
        const int64_t n = units[u].Slice(s).length;
        if (std::find(mine.begin(), mine.end(), s) == mine.end()) {
          others_bytes += SliceBytes(c.encodings.weight_format(), n);
          continue;
        }
        fetch_bytes += SliceBytes(c.encodings.weight_format(), n);
        push_bytes += SliceBytes(c.encodings.grad_format(), n);
      }
      fetched += (c.secondary_shard > 0 || last ? 1 : 2) * fetch_bytes;
      pushed += push_bytes;
      gathered += (last ? 1 : 2) * others_bytes;
      reduced += (kGroup - 1) * push_bytes;
    }
    const absl::StatusOr<StepBytes> planned = StepBytesOf(PlanInputOf(job, how.trainer, c.encodings, kGroup), r);
    ASSERT_TRUE(planned.ok()) << planned.status();
    ASSERT_EQ(reports[r].size(), static_cast<size_t>(kSteps));
    for (const StepReport& report : reports[r]) {
      SCOPED_TRACE(absl::StrCat("trainer ", r, ", step ", report.step));
      EXPECT_EQ(report.payload_fetched, fetched);
      EXPECT_EQ(report.payload_pushed, pushed);
      EXPECT_EQ(report.fabric_gathered, gathered);
      EXPECT_EQ(report.fabric_reduced, reduced);
      // And pshard plan predicts them.
      EXPECT_EQ(report.payload_fetched, planned->fetched);
      EXPECT_EQ(report.payload_pushed, planned->pushed);
      EXPECT_EQ(report.fabric_gathered, planned->gathered);
      EXPECT_EQ(report.fabric_reduced, planned->reduced);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllTransports, GroupLeverBytesTest,
    ::testing::Combine(::testing::ValuesIn(EnabledTransports()),
                       ::testing::Values(GroupLeverCase{"groups_bf16", WireEncoding::kBf16},
                                         GroupLeverCase{"groups_fp32", WireEncoding::kFp32},
                                         GroupLeverCase{"secondary_shard_bf16", WireEncoding::kBf16, 2},
                                         GroupLeverCase{"secondary_shard_int8_int4",
                                                        WireEncodings(WireEncoding::kInt8, WireEncoding::kInt4, 48),
                                                        2})),
    [](const auto& info) { return absl::StrCat(std::get<0>(info.param), "_", std::get<1>(info.param).name); });

class ErrorFeedbackRestartTest : public ::testing::TestWithParam<std::string> {};

struct FeedbackRun {
  std::vector<std::vector<float>> weights;
  std::vector<double> losses;  // per step
};

// Trains steps [0, total) with one trainer pushing int4 gradients with error
// feedback; with `restart_at`, the trainer (and its client) is replaced by a
// new one before that step, as a restarted process would be.
absl::StatusOr<FeedbackRun> TrainWithFeedback(const std::string& transport, const JobConfig& job,
                                              const WireEncodings& encodings, int64_t total,
                                              std::optional<int64_t> restart_at) {
  ASSIGN_OR_RETURN(std::unique_ptr<LocalCluster> cluster, LocalCluster::Start(job));
  ASSIGN_OR_RETURN(std::unique_ptr<ShardClient> client, cluster->Connect(0, encodings, transport));
  ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(client.get(), &TestCorpus(), TinyTrainerOptions(7)));
  FeedbackRun run;
  for (int64_t step = 0; step < total; ++step) {
    if (restart_at && step == *restart_at) {
      if (client->residual_bytes() == 0) return absl::InternalError("the first trainer kept no residual");
      trainer.reset();
      client.reset();
      ASSIGN_OR_RETURN(client, cluster->Connect(0, encodings, transport));
      if (client->residual_bytes() != 0) return absl::InternalError("a new trainer starts with a residual");
      ASSIGN_OR_RETURN(trainer, Trainer::Create(client.get(), &TestCorpus(), TinyTrainerOptions(7)));
    }
    ASSIGN_OR_RETURN(StepReport report, trainer->RunStep(step));
    run.losses.push_back(report.loss);
  }
  ASSIGN_OR_RETURN(run.weights, cluster->ReadMasterWeights(total));
  return run;
}

double MeanOfLast(const std::vector<double>& v, size_t n) {
  double sum = 0.0;
  for (size_t i = v.size() - n; i < v.size(); ++i) sum += v[i];
  return sum / static_cast<double>(n);
}

// A restarted trainer starts with a zero residual (docs/levers.md): the job
// then trains exactly as the reference does when it forgets the residual at
// that step, and converges as if nothing had happened.
TEST_P(ErrorFeedbackRestartTest, ARestartedTrainerStartsWithAZeroResidualAndTrainsOn) {
  constexpr int64_t kTotal = 60, kRestartAt = 30;
  const JobConfig job = TinyGptJob(2, 1, kTotal);
  const WireEncodings encodings(WireEncoding::kBf16, WireEncoding::kInt4, 48);
  absl::StatusOr<FeedbackRun> restarted = TrainWithFeedback(GetParam(), job, encodings, kTotal, kRestartAt);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  absl::StatusOr<FeedbackRun> uninterrupted = TrainWithFeedback(GetParam(), job, encodings, kTotal, std::nullopt);
  ASSERT_TRUE(uninterrupted.ok()) << uninterrupted.status();

  auto reference = ReferenceTraining::Create(job, encodings, TinyTrainerOptions(7), &TestCorpus());
  ASSERT_TRUE(reference.ok()) << reference.status();
  for (int64_t step = 0; step < kTotal; ++step) {
    if (step == kRestartAt) reference->ResetResidual(0);
    ASSERT_TRUE(reference->Step(step).ok());
  }
  EXPECT_TRUE(BitIdentical(restarted->weights, reference->MasterWeights()));
  EXPECT_FALSE(BitIdentical(restarted->weights, uninterrupted->weights)) << "the residual made no difference";

  const double start = MeanOfLast({uninterrupted->losses.begin(), uninterrupted->losses.begin() + 5}, 5);
  const double want = MeanOfLast(uninterrupted->losses, 10);
  const double got = MeanOfLast(restarted->losses, 10);
  EXPECT_LT(want, start - 0.5) << "the job did not learn";
  EXPECT_NEAR(got, want, 0.02 * want) << "restarting the trainer changed where training ends";
}

INSTANTIATE_TEST_SUITE_P(AllTransports, ErrorFeedbackRestartTest, ::testing::ValuesIn(EnabledTransports()));

TEST(ReshardAfterForwardFlag, TakesTrueOrFalseAndRefusesTheRest) {
  EXPECT_TRUE(ParseReshardAfterForward("true").value().reshard);
  EXPECT_EQ(ParseReshardAfterForward("true").value().group, 0);
  EXPECT_FALSE(ParseReshardAfterForward("false").value().reshard);
  EXPECT_TRUE(ParseReshardAfterForward("2").value().reshard);
  EXPECT_EQ(ParseReshardAfterForward("2").value().group, 2);
  for (const char* bad : {"1", "0", "-2", "yes"}) {
    EXPECT_EQ(ParseReshardAfterForward(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(StageFlag, TakesOneTwoOrThree) {
  for (int stage : {1, 2, 3}) EXPECT_TRUE(CheckStage(stage).ok()) << stage;
  for (int stage : {0, 4, -1}) {
    const absl::Status s = CheckStage(stage);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << stage;
    EXPECT_NE(std::string(s.message()).find("1 and 2 coincide"), std::string::npos) << s;
  }
}

TEST(ErrorFeedbackFlag, AutoFollowsTheGradientEncodingAndTrueNeedsAQuantizedOne) {
  EXPECT_EQ(ParseErrorFeedback("auto", WireEncoding::kInt4).value(), true);
  EXPECT_EQ(ParseErrorFeedback("auto", WireEncoding::kInt8).value(), true);
  EXPECT_EQ(ParseErrorFeedback("auto", WireEncoding::kBf16).value(), false);
  EXPECT_EQ(ParseErrorFeedback("false", WireEncoding::kInt4).value(), false);
  EXPECT_EQ(ParseErrorFeedback("true", WireEncoding::kInt8).value(), true);
  const absl::Status bf16 = ParseErrorFeedback("true", WireEncoding::kBf16).status();
  EXPECT_EQ(bf16.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(bf16.message()).find("no quantization residual"), std::string::npos) << bf16;
  EXPECT_EQ(ParseErrorFeedback("on", WireEncoding::kInt8).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pshard::testing
