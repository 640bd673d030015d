// The slow-link levers change what crosses the wire, not what is computed:
// each one trains to the same bits as the default, and moves the bytes its
// formula says.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/levers.h"
#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "tests/testutil/cluster_training.h"
#include "tests/testutil/local_cluster.h"
#include "tests/testutil/tiny_job.h"
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

TEST(ReshardAfterForwardFlag, TakesTrueOrFalseAndRefusesTheRest) {
  EXPECT_EQ(ParseReshardAfterForward("true").value(), true);
  EXPECT_EQ(ParseReshardAfterForward("false").value(), false);
  EXPECT_EQ(ParseReshardAfterForward("2").status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(std::string(ParseReshardAfterForward("2").status().message()).find("not implemented yet"),
            std::string::npos);
  EXPECT_EQ(ParseReshardAfterForward("yes").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pshard::testing
