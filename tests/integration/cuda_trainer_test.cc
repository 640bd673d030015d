// Trainers with the CUDA model against real shard servers: the same job
// trained on the GPU and on the CPU agrees within bf16 precision, step by
// step, and the trainer reports its device memory. Skips without a device.
#include <cmath>

#include "common/reduction_tree.h"
#include "gtest/gtest.h"
#include "tests/testutil/local_cluster.h"
#include "tests/testutil/single_trainer.h"
#include "tests/testutil/tiny_job.h"
#include "trainer_client/gpu_plugin.h"
#include "trainer_client/trainer.h"
#include "trainer_client/model/gpt_spec.h"

namespace pshard::testing {
namespace {

// CUDA devices that the GPU plugin sees (0 when it cannot be loaded).
int GpuDevices() {
  const absl::StatusOr<const GpuPlugin*> gpu = LoadGpuPlugin();
  return gpu.ok() ? (*gpu)->device_count() : 0;
}

constexpr int kSteps = 4;

JobConfig Job() {
  JobConfig job = TinyGptJob(2, 1, kSteps);
  job.model = MakeGptSpec(GptConfig{.num_layers = 2, .d_model = 64, .num_heads = 4, .context = 32, .vocab = 256}).value();
  return job;
}

TrainerOptions Options(const std::string& device) {
  TrainerOptions t = TinyTrainerOptions(7);
  t.batch = 4;
  t.seq_len = 32;
  t.device = device;
  return t;
}

// kSteps steps of one trainer on a fresh cluster, checking the model's
// memory and every step's time accounting.
SingleTrainerRun Train(const TrainerOptions& options, const JobConfig& job = Job()) {
  absl::StatusOr<SingleTrainerRun> run = TrainSingleTrainer(job, options, kSteps);
  EXPECT_TRUE(run.ok()) << run.status();
  if (!run.ok()) return SingleTrainerRun();
  if (options.device == "cuda") {
    EXPECT_NE(run->device_name.find("cuda:0"), std::string::npos);
    // Activations + (prefetch depth + 1) bf16 weight units + 2 fp32 gradient
    // units (each with room for the partial sums of the lanes).
    const ModelMemory& memory = run->memory;
    EXPECT_EQ(run->lanes, options.fetch_once_per_step ? job.micro_batches : 1);
    EXPECT_EQ(memory.weights, (options.prefetch_depth + 1) * run->largest_unit * 2);
    EXPECT_EQ(memory.gradients, 2 * InOrderTreeSum::SlotsNeeded(run->lanes) * run->largest_unit * 4);
    EXPECT_EQ(memory.device, memory.activations + memory.weights + memory.gradients);
  }
  for (const StepReport& r : run->reports) {
    // The phases split the wall time; the device computed for part of it.
    const StepTimes& t = r.times;
    EXPECT_GT(t.compute, absl::ZeroDuration());
    EXPECT_GE(t.comm_exposed, absl::ZeroDuration());
    EXPECT_GE(t.other, absl::ZeroDuration());
    EXPECT_EQ(t.compute + t.comm_exposed + t.data + t.other, t.wall);
    EXPECT_GE(t.comm_busy, t.comm_exposed);
  }
  return *std::move(run);
}

TEST(CudaTrainerTest, GpuTrainingFollowsCpuTrainingWithinBf16Precision) {
  if (GpuDevices() == 0) GTEST_SKIP() << "no CUDA device";
  const SingleTrainerRun cpu_run = Train(Options("cpu"));
  const SingleTrainerRun gpu_run = Train(Options("cuda"));
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
  if (GpuDevices() == 0) GTEST_SKIP() << "no CUDA device";
  const SingleTrainerRun base = Train(Options("cuda"));
  ASSERT_EQ(base.losses.size(), static_cast<size_t>(kSteps));
  for (int depth : {0, 3}) {
    TrainerOptions options = Options("cuda");
    options.prefetch_depth = depth;
    EXPECT_TRUE(SameTraining(Train(options), base)) << "prefetch depth " << depth;
  }
  TrainerOptions recompute = Options("cuda");
  recompute.recompute_blocks = true;
  EXPECT_TRUE(SameTraining(Train(recompute), base)) << "recomputed blocks";
}

// Gradient accumulation on the GPU, every way: pushing every micro-batch,
// accumulating on the trainer, and all micro-batches in one pass (lanes
// sharing a workspace, their gradients summed on the device in the
// reduction tree's order; also with recomputed blocks) give the servers
// the same sums.
TEST(CudaTrainerTest, AccumulationModesAgree) {
  if (GpuDevices() == 0) GTEST_SKIP() << "no CUDA device";
  JobConfig job = Job();
  job.micro_batches = 3;
  job.accumulate_on_trainer = false;
  const SingleTrainerRun pushed = Train(Options("cuda"), job);
  job.accumulate_on_trainer = true;
  const SingleTrainerRun accumulated = Train(Options("cuda"), job);
  TrainerOptions once = Options("cuda");
  once.fetch_once_per_step = true;
  const SingleTrainerRun one_pass = Train(once, job);
  once.recompute_blocks = true;
  const SingleTrainerRun one_pass_recomputed = Train(once, job);
  ASSERT_EQ(pushed.losses.size(), static_cast<size_t>(kSteps));
  EXPECT_TRUE(SameTraining(pushed, accumulated));
  EXPECT_TRUE(SameTraining(one_pass, accumulated));
  EXPECT_TRUE(SameTraining(one_pass_recomputed, accumulated));
  EXPECT_LT(pushed.losses.back(), pushed.losses.front());
}

TEST(CudaTrainerTest, AskingForCudaWithoutADeviceIsAClearError) {
  if (GpuDevices() > 0) GTEST_SKIP() << "a CUDA device is present";
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
