// Trainers with the CUDA model against real shard servers: the same job
// trained on the GPU and on the CPU agrees within bf16 precision, step by
// step, and the trainer reports its device memory. Skips without a device.
#include <cmath>

#include "gtest/gtest.h"
#include "tests/testutil/local_cluster.h"
#include "tests/testutil/tiny_job.h"
#include "trainer_client/model/cuda/cuda_unit_model.h"
#include "trainer_client/trainer.h"

namespace pshard::testing {
namespace {

constexpr int kSteps = 4;

JobConfig Job() {
  JobConfig job = TinyGptJob(2, 1, kSteps);
  job.model = GptConfig{.num_layers = 2, .d_model = 64, .num_heads = 4, .context = 32, .vocab = 256};
  return job;
}

TrainerOptions Options(const std::string& device) {
  TrainerOptions t = TinyTrainerOptions(7);
  t.batch = 4;
  t.seq_len = 32;
  t.device = device;
  return t;
}

// Losses of kSteps steps of one trainer on a fresh cluster.
std::vector<double> Losses(const std::string& device, std::vector<std::vector<float>>* final_weights) {
  auto cluster = LocalCluster::Start(Job());
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  if (!cluster.ok()) return {};
  auto client = (*cluster)->Connect(0, WireEncoding::kFp32);
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return {};
  auto trainer = Trainer::Create(client->get(), &TestCorpus(), Options(device));
  EXPECT_TRUE(trainer.ok()) << trainer.status();
  if (!trainer.ok()) return {};
  if (device == "cuda") {
    EXPECT_NE((*trainer)->model().DeviceName().find("cuda:0"), std::string::npos);
    EXPECT_GT((*trainer)->model().DeviceBytes(), (*trainer)->model().ActivationBytes());
  }
  std::vector<double> losses;
  for (int64_t step = 0; step < kSteps; ++step) {
    absl::StatusOr<StepReport> r = (*trainer)->RunStep(step);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return losses;
    losses.push_back(r->loss);
  }
  auto weights = (*cluster)->ReadMasterWeights(kSteps);
  EXPECT_TRUE(weights.ok()) << weights.status();
  if (weights.ok()) *final_weights = std::move(*weights);
  return losses;
}

TEST(CudaTrainerTest, GpuTrainingFollowsCpuTrainingWithinBf16Precision) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::vector<std::vector<float>> cpu_weights, gpu_weights;
  const std::vector<double> cpu = Losses("cpu", &cpu_weights);
  const std::vector<double> gpu = Losses("cuda", &gpu_weights);
  ASSERT_EQ(cpu.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(gpu.size(), static_cast<size_t>(kSteps));
  for (int s = 0; s < kSteps; ++s) {
    // bf16 weights and activations: about 3 significant digits.
    EXPECT_NEAR(gpu[s], cpu[s], 2e-2 * cpu[s]) << "step " << s;
  }
  EXPECT_LT(gpu.back(), gpu.front());
  // After a few AdamW steps the weights agree to bf16 precision overall.
  double diff = 0, norm = 0;
  ASSERT_EQ(cpu_weights.size(), gpu_weights.size());
  for (size_t u = 0; u < cpu_weights.size(); ++u) {
    for (size_t i = 0; i < cpu_weights[u].size(); ++i) {
      diff += std::pow(double(gpu_weights[u][i]) - cpu_weights[u][i], 2);
      norm += std::pow(double(cpu_weights[u][i]), 2);
    }
  }
  EXPECT_LT(std::sqrt(diff / norm), 1e-2);
}

TEST(CudaTrainerTest, AskingForCudaWithoutADeviceIsAClearError) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "a CUDA device is present";
  auto cluster = LocalCluster::Start(Job());
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto client = (*cluster)->Connect(0, WireEncoding::kFp32);
  ASSERT_TRUE(client.ok()) << client.status();
  auto trainer = Trainer::Create(client->get(), &TestCorpus(), Options("cuda"));
  ASSERT_FALSE(trainer.ok());
  EXPECT_EQ(trainer.status().code(), absl::StatusCode::kFailedPrecondition) << trainer.status();
  // "auto" falls back to the CPU.
  auto fallback = Trainer::Create(client->get(), &TestCorpus(), Options("auto"));
  ASSERT_TRUE(fallback.ok()) << fallback.status();
  EXPECT_EQ((*fallback)->model().DeviceName(), "cpu");
}

}  // namespace
}  // namespace pshard::testing
