// The NCCL fabric group on one GPU (a group of 1, as one device allows):
// its unique id travels through the servers' rendezvous, its collectives
// agree with the shared-memory group's, and training with it equals
// training without a group, bit for bit with fp32 on the wire. Skips
// without a CUDA device.
#include <cstring>
#include <random>

#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "tests/testutil/local_cluster.h"
#include "tests/testutil/reference_training.h"
#include "tests/testutil/tiny_job.h"
#include "trainer_client/group/host/host_group.h"
#include "trainer_client/gpu_plugin.h"
#include "trainer_client/trainer.h"

namespace pshard::testing {
namespace {

// CUDA devices that the GPU plugin sees (0 when it cannot be loaded).
int GpuDevices() {
  const absl::StatusOr<const GpuPlugin*> gpu = LoadGpuPlugin();
  return gpu.ok() ? (*gpu)->device_count() : 0;
}

constexpr int kSteps = 3;

absl::StatusOr<std::unique_ptr<GroupCollective>> JoinAlone(ShardClient& client, const std::string& group) {
  ASSIGN_OR_RETURN(const GpuPlugin* gpu, LoadGpuPlugin());
  if (gpu->join_nccl_group == nullptr) return absl::FailedPreconditionError("the GPU plugin has no NCCL");
  return gpu->join_nccl_group(0, 1, 0, [&](const std::string& payload) {
    return client.Rendezvous(group, 0, 1, payload, absl::Seconds(30));
  });
}

TEST(NcclGroupTest, CollectivesOfAGroupOfOneMatchTheSharedMemoryGroup) {
  if (GpuDevices() == 0) GTEST_SKIP() << "no CUDA device";
  auto cluster = LocalCluster::Start(TinyGptJob(1, 1));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto client = (*cluster)->Connect(-1, WireEncoding::kFp32);
  ASSERT_TRUE(client.ok()) << client.status();
  auto nccl = JoinAlone(**client, "nccl-collectives");
  ASSERT_TRUE(nccl.ok()) << nccl.status();
  auto host = CreateHostGroup(1);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  std::vector<float> a(4099);
  for (float& x : a) x = normal(rng);
  std::vector<float> b = a;
  const GroupOwnership owned = {{{0, 1000}, {2000, 2099}}};
  ASSERT_TRUE((*nccl)->ReduceScatter(a, owned).ok());
  ASSERT_TRUE(host[0]->ReduceScatter(b, owned).ok());
  ASSERT_TRUE((*nccl)->AllGather(a, owned).ok());
  ASSERT_TRUE(host[0]->AllGather(b, owned).ok());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
}

TEST(NcclGroupTest, TrainingInAGroupOfOneEqualsTrainingWithoutBitForBit) {
  if (GpuDevices() == 0) GTEST_SKIP() << "no CUDA device";
  const JobConfig job = TinyGptJob(2, 1, kSteps);
  auto cluster = LocalCluster::Start(job);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto client = (*cluster)->Connect(0, WireEncoding::kFp32);
  ASSERT_TRUE(client.ok()) << client.status();
  auto nccl = JoinAlone(**client, "nccl-training");
  ASSERT_TRUE(nccl.ok()) << nccl.status();
  TrainerOptions options = TinyTrainerOptions(7);
  options.group = nccl->get();
  auto trainer = Trainer::Create(client->get(), &TestCorpus(), options);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  for (int64_t step = 0; step < kSteps; ++step) ASSERT_TRUE((*trainer)->RunStep(step).ok());
  auto got = (*cluster)->ReadMasterWeights(kSteps);
  ASSERT_TRUE(got.ok()) << got.status();
  auto want = TrainReference(job, WireEncoding::kFp32, TinyTrainerOptions(7), TestCorpus(), kSteps);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_TRUE(BitIdentical(*got, *want));
}

}  // namespace
}  // namespace pshard::testing
