// The layout is data: servers train a model that is not a GPT (an MLP),
// over any N, bit-identically to one process training it alone; a job
// starts from given weights (--init_from); trainers refuse layouts their
// model does not compute.
#include <filesystem>
#include <string>
#include <vector>

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "common/initial_weights.h"
#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testutil/cluster_training.h"
#include "tests/testutil/local_cluster.h"
#include "tests/testutil/mlp_model.h"
#include "tests/testutil/reference_training.h"
#include "tests/testutil/tiny_job.h"

namespace pshard::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kSteps = 4;

// An MLP over `shards` servers and `trainers` trainers, optimised as the
// tiny GPT job is (clipping active, so the exact norm matters).
JobConfig MlpJob(int shards, int trainers) {
  JobConfig job = TinyGptJob(shards, trainers, kSteps);
  job.model = MakeMlpSpec(256, 12, 2).value();
  job.slice_alignment = 8;
  return job;
}

struct LayoutCase {
  std::string transport;
  int shards;
  WireEncoding encoding;
};

class MlpLayoutTest : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(MlpLayoutTest, TrainsBitIdenticallyToTheSingleProcessReference) {
  const LayoutCase c = GetParam();
  const JobConfig job = MlpJob(c.shards, 2);
  const TrainerOptions trainer = TinyTrainerOptions(7);
  absl::StatusOr<std::vector<std::vector<float>>> want =
      TrainReference(job, c.encoding, trainer, TestCorpus(), kSteps, true, 1, CreateCpuMlp);
  ASSERT_TRUE(want.ok()) << want.status();

  auto cluster = LocalCluster::Start(job);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ClusterTraining how;
  how.encoding = c.encoding;
  how.transport = c.transport;
  how.trainer = trainer;
  how.steps = kSteps;
  how.model = CreateCpuMlp;
  ASSERT_TRUE(TrainInThreads(**cluster, 2, TestCorpus(), how).ok());
  absl::StatusOr<std::vector<std::vector<float>>> got = (*cluster)->ReadMasterWeights(kSteps);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(BitIdentical(*got, *want));
  // The weights moved: the test compares training, not initial values.
  absl::StatusOr<std::vector<std::vector<float>>> initial =
      TrainReference(job, c.encoding, trainer, TestCorpus(), 0, true, 1, CreateCpuMlp);
  ASSERT_TRUE(initial.ok());
  EXPECT_FALSE(BitIdentical(*got, *initial));
}

std::vector<LayoutCase> Cases() {
  std::vector<LayoutCase> cases;
  for (const std::string& transport : EnabledTransports()) {
    for (int shards : {1, 3}) {
      for (WireEncoding e : {WireEncoding::kFp32, WireEncoding::kBf16}) cases.push_back({transport, shards, e});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllTransports, MlpLayoutTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<LayoutCase>& info) {
                           return absl::StrCat(info.param.transport, "_N", info.param.shards, "_",
                                               std::string(WireEncodingName(info.param.encoding)));
                         });

TEST(MlpLayoutTest, TheWeightsDoNotDependOnN) {
  // Clipping is active, and the exact norm makes it the same over 1 and 3 shards.
  std::vector<std::vector<std::vector<float>>> by_n;
  for (int shards : {1, 3}) {
    auto cluster = LocalCluster::Start(MlpJob(shards, 2));
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    ClusterTraining how;
    how.encoding = WireEncoding::kFp32;
    how.trainer = TinyTrainerOptions(7);
    how.steps = kSteps;
    how.model = CreateCpuMlp;
    ASSERT_TRUE(TrainInThreads(**cluster, 2, TestCorpus(), how).ok());
    absl::StatusOr<std::vector<std::vector<float>>> got = (*cluster)->ReadMasterWeights(kSteps);
    ASSERT_TRUE(got.ok()) << got.status();
    by_n.push_back(*got);
  }
  EXPECT_TRUE(BitIdentical(by_n[0], by_n[1]));
}

TEST(MlpLayoutTest, TheGptTrainerRefusesALayoutItDoesNotCompute) {
  auto cluster = LocalCluster::Start(MlpJob(2, 1));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto client = (*cluster)->Connect(0, WireEncoding::kFp32);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ((*client)->layout().spec.model, "mlp vocab=256 width=12 hidden=2");
  absl::StatusOr<std::unique_ptr<Trainer>> trainer =
      Trainer::Create(client->get(), &TestCorpus(), TinyTrainerOptions(7));
  ASSERT_FALSE(trainer.ok());
  EXPECT_EQ(trainer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(trainer.status().message(), HasSubstr("\"mlp vocab=256 width=12 hidden=2\", not a GPT"));
}

class InitFromTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / absl::StrCat("pshard-init-from-", getpid());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Writes every tensor of `spec` with values f(tensor index, element).
  template <typename Fn>
  std::string WriteWeights(const ModelSpec& spec, const std::string& name, Fn f) {
    std::vector<std::vector<float>> values;
    std::vector<SafetensorsTensorView> views;
    for (const UnitSpec& unit : spec.units) {
      for (const TensorSpec& t : unit.tensors) {
        std::vector<float> v(t.numel);
        for (int64_t i = 0; i < t.numel; ++i) v[i] = f(static_cast<int>(t.rng_stream), i);
        values.push_back(std::move(v));
      }
    }
    size_t k = 0;
    for (const UnitSpec& unit : spec.units) {
      for (const TensorSpec& t : unit.tensors) {
        const std::vector<float>& v = values[k++];
        views.push_back({t.name, SafetensorsDtype::kF32, t.shape,
                         {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(float)}});
      }
    }
    const std::string path = (dir_ / name).string();
    EXPECT_TRUE(WriteSafetensors(path, views, {}).ok());
    return path;
  }

  std::filesystem::path dir_;
};

TEST_F(InitFromTest, TheServersStartFromTheFilesValuesOverAnyN) {
  const ModelSpec spec = MakeMlpSpec(256, 12, 2).value();
  auto value = [](int tensor, int64_t i) { return 0.001f * static_cast<float>(i % 97) - 0.01f * tensor; };
  const std::string path = WriteWeights(spec, "init.safetensors", value);
  for (int shards : {1, 3}) {
    JobConfig job = MlpJob(shards, 1);
    LocalCluster::Options options;
    options.init_from = path;
    auto cluster = LocalCluster::Start(job, options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    // It says so in its log.
    EXPECT_THAT((*cluster)->server(0).start_notes(),
                ::testing::Contains(absl::StrCat("initial weights from ", path, " (--init_from)")));
    absl::StatusOr<std::vector<std::vector<float>>> got = (*cluster)->ReadMasterWeights(0);
    ASSERT_TRUE(got.ok()) << got.status();
    for (size_t u = 0; u < spec.units.size(); ++u) {
      for (const TensorSpec& t : spec.units[u].tensors) {
        for (int64_t i = 0; i < t.numel; ++i) {
          ASSERT_EQ((*got)[u][t.offset + i], value(static_cast<int>(t.rng_stream), i)) << t.name << " " << i;
        }
      }
    }
    // The file's fingerprint is part of the job the trainers are told.
    auto client = (*cluster)->Connect(0, WireEncoding::kFp32);
    ASSERT_TRUE(client.ok()) << client.status();
    EXPECT_EQ((*client)->job().init_fingerprint, InitialWeights::Load(path, spec)->fingerprint());
  }
}

TEST_F(InitFromTest, AFileThatDoesNotFitTheLayoutStopsTheServerNamingTheTensor) {
  const ModelSpec other = MakeMlpSpec(256, 12, 1).value();  // one hidden layer fewer
  const std::string path = WriteWeights(other, "other.safetensors", [](int, int64_t) { return 1.0f; });
  LocalCluster::Options options;
  options.init_from = path;
  auto cluster = LocalCluster::Start(MlpJob(2, 1), options);
  ASSERT_FALSE(cluster.ok());
  EXPECT_EQ(cluster.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(cluster.status().message(), HasSubstr("no tensor hidden1.weight"));
}

TEST_F(InitFromTest, ALayoutWithGivenTensorsNeedsAFile) {
  ModelSpecBuilder b("given");
  b.AddUnit("u");
  b.AddTensor("u.w", {4, 4}, InitKind::kGiven, 0.0, true);
  JobConfig job = MlpJob(1, 1);
  job.model = *std::move(b).Build();
  auto cluster = LocalCluster::Start(job);
  ASSERT_FALSE(cluster.ok());
  EXPECT_THAT(cluster.status().message(), HasSubstr("initial-weights file"));
}

}  // namespace
}  // namespace pshard::testing
