// Choosing where a trainer's model runs: cpu, cuda or auto, and a clear
// error for what this build or machine cannot do.
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pshard/cuda_config.h"
#include "tests/testutil/local_cluster.h"
#include "tests/testutil/tiny_job.h"
#include "trainer_client/trainer.h"

namespace pshard::testing {
namespace {

using ::testing::HasSubstr;

class TrainerDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cluster = LocalCluster::Start(TinyGptJob(1, 1));
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
    auto client = cluster_->Connect(0, WireEncoding::kFp32);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
  }
  absl::StatusOr<std::unique_ptr<Trainer>> Make(const std::string& device) {
    TrainerOptions options = TinyTrainerOptions();
    options.device = device;
    return Trainer::Create(client_.get(), &TestCorpus(), options);
  }
  std::unique_ptr<LocalCluster> cluster_;
  std::unique_ptr<ShardClient> client_;
};

TEST_F(TrainerDeviceTest, CpuRunsEverywhere) {
  auto trainer = Make("cpu");
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  EXPECT_EQ((*trainer)->model().DeviceName(), "cpu");
  const ModelMemory memory = (*trainer)->model().Memory();
  EXPECT_GT(memory.activations, 0);
  EXPECT_EQ(memory.weights, 0);
  EXPECT_EQ(memory.gradients, 0);
  EXPECT_EQ(memory.device, 0);
  absl::StatusOr<StepReport> r = (*trainer)->RunStep(0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GT(r->loss, 0);
}

TEST_F(TrainerDeviceTest, UnknownDevicesAreRefused) {
  auto trainer = Make("tpu");
  ASSERT_FALSE(trainer.ok());
  EXPECT_EQ(trainer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(trainer.status().message(), HasSubstr("expected cpu, cuda, cuda:N or auto"));
}

TEST_F(TrainerDeviceTest, UnknownAttentionIsRefused) {
  TrainerOptions options = TinyTrainerOptions();
  options.attention = "flash";
  auto trainer = Trainer::Create(client_.get(), &TestCorpus(), options);
  ASSERT_FALSE(trainer.ok());
  EXPECT_EQ(trainer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(trainer.status().message(), HasSubstr("expected auto, fused or materialized"));
}

TEST_F(TrainerDeviceTest, CudaNeedsACudaBuild) {
  if (PSHARD_WITH_CUDA) GTEST_SKIP() << "this build has CUDA (cuda_trainer_test covers it)";
  auto trainer = Make("cuda");
  ASSERT_FALSE(trainer.ok());
  EXPECT_EQ(trainer.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(trainer.status().message(), HasSubstr("-DPSHARD_WITH_CUDA=ON"));
  auto fallback = Make("auto");
  ASSERT_TRUE(fallback.ok()) << fallback.status();
  EXPECT_EQ((*fallback)->model().DeviceName(), "cpu");
}

}  // namespace
}  // namespace pshard::testing
