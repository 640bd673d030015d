// Trainers with the CUDA model against real shard servers: the same job
// trained on the GPU and on the CPU agrees within bf16 precision, step by
// step, and the trainer reports its device memory. Skips without a device.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/reduction_tree.h"
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

struct TrainingRun {
  std::vector<double> losses;
  std::vector<std::vector<float>> final_weights;
};

// kSteps steps of one trainer on a fresh cluster.
TrainingRun Train(const TrainerOptions& options, const JobConfig& job = Job()) {
  TrainingRun run;
  auto cluster = LocalCluster::Start(job);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  if (!cluster.ok()) return run;
  auto client = (*cluster)->Connect(0, WireEncoding::kFp32);
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return run;
  auto trainer = Trainer::Create(client->get(), &TestCorpus(), options);
  EXPECT_TRUE(trainer.ok()) << trainer.status();
  if (!trainer.ok()) return run;
  if (options.device == "cuda") {
    EXPECT_NE((*trainer)->model().DeviceName().find("cuda:0"), std::string::npos);
    // Activations + (prefetch depth + 1) bf16 weight units + 2 fp32 gradient
    // units (each with room for the partial sums of the lanes).
    const ModelMemory memory = (*trainer)->model().Memory();
    const int lanes = (*trainer)->model().lanes();
    EXPECT_EQ(lanes, options.fetch_once_per_step ? job.micro_batches : 1);
    int64_t largest_unit = 0;
    for (const UnitSpec& unit : (*client)->layout().spec.units) largest_unit = std::max(largest_unit, unit.numel);
    EXPECT_EQ(memory.weights, (options.prefetch_depth + 1) * largest_unit * 2);
    EXPECT_EQ(memory.gradients, 2 * InOrderTreeSum::SlotsNeeded(lanes) * largest_unit * 4);
    EXPECT_EQ(memory.device, memory.activations + memory.weights + memory.gradients);
  }
  for (int64_t step = 0; step < kSteps; ++step) {
    absl::StatusOr<StepReport> r = (*trainer)->RunStep(step);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return run;
    // The phases split the wall time; the device computed for part of it.
    const StepTimes& t = r->times;
    EXPECT_GT(t.compute, absl::ZeroDuration());
    EXPECT_GE(t.comm_exposed, absl::ZeroDuration());
    EXPECT_GE(t.other, absl::ZeroDuration());
    EXPECT_EQ(t.compute + t.comm_exposed + t.data + t.other, t.wall);
    EXPECT_GE(t.comm_busy, t.comm_exposed);
    run.losses.push_back(r->loss);
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

TEST(CudaTrainerTest, GpuTrainingFollowsCpuTrainingWithinBf16Precision) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const TrainingRun cpu_run = Train(Options("cpu"));
  const TrainingRun gpu_run = Train(Options("cuda"));
  const std::vector<double>& cpu = cpu_run.losses;
  const std::vector<double>& gpu = gpu_run.losses;
  const std::vector<std::vector<float>>& cpu_weights = cpu_run.final_weights;
  const std::vector<std::vector<float>>& gpu_weights = gpu_run.final_weights;
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

// The copies overlap the compute on their own streams, ordered by events
// only: however deep the pipeline, and with blocks recomputed, the GPU
// computes exactly the same thing.
TEST(CudaTrainerTest, PipelineDepthAndRecomputeChangeNoBit) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const TrainingRun base = Train(Options("cuda"));
  ASSERT_EQ(base.losses.size(), static_cast<size_t>(kSteps));
  for (int depth : {0, 3}) {
    TrainerOptions options = Options("cuda");
    options.prefetch_depth = depth;
    EXPECT_TRUE(BitIdentical(Train(options), base)) << "prefetch depth " << depth;
  }
  TrainerOptions recompute = Options("cuda");
  recompute.recompute_blocks = true;
  EXPECT_TRUE(BitIdentical(Train(recompute), base)) << "recomputed blocks";
}

// Gradient accumulation on the GPU, every way: pushing every micro-batch,
// accumulating on the trainer, and all micro-batches in one pass (lanes
// sharing a workspace, their gradients summed on the device in the
// reduction tree's order; also with recomputed blocks) give the servers
// the same sums.
TEST(CudaTrainerTest, AccumulationModesAgree) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  JobConfig job = Job();
  job.micro_batches = 3;
  job.accumulate_on_trainer = false;
  const TrainingRun pushed = Train(Options("cuda"), job);
  job.accumulate_on_trainer = true;
  const TrainingRun accumulated = Train(Options("cuda"), job);
  TrainerOptions once = Options("cuda");
  once.fetch_once_per_step = true;
  const TrainingRun one_pass = Train(once, job);
  once.recompute_blocks = true;
  const TrainingRun one_pass_recomputed = Train(once, job);
  ASSERT_EQ(pushed.losses.size(), static_cast<size_t>(kSteps));
  EXPECT_TRUE(BitIdentical(pushed, accumulated));
  EXPECT_TRUE(BitIdentical(one_pass, accumulated));
  EXPECT_TRUE(BitIdentical(one_pass_recomputed, accumulated));
  EXPECT_LT(pushed.losses.back(), pushed.losses.front());
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
