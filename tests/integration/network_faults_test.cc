// Network faults between trainers and a shard server: connections reset in
// the middle of a fetch's response and of a push's request (a TCP proxy
// that sends RST both ways). The trainers rejoin and redo their step, the
// server takes every contribution once, and the job's weights end bit for
// bit those of a job nobody disturbed.
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "common/status_macros.h"
#include "tests/testutil/cluster_training.h"
#include "tests/testutil/fault_proxy.h"
#include "tests/testutil/local_cluster.h"
#include "tests/testutil/reference_training.h"
#include "tests/testutil/tiny_job.h"
#include "tools/cluster_status.h"
#include "trainer_client/rejoining_trainer.h"

namespace pshard::testing {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kSteps = 12;

TEST(NetworkFaults, ConnectionResetsMidFetchAndMidPushEndBitIdentical) {
  const JobConfig job = TinyGptJob(2, 2, kSteps);
  auto cluster = LocalCluster::Start(job);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto proxy = FaultProxy::Start((*cluster)->server(1).port());
  ASSERT_TRUE(proxy.ok()) << proxy.status();
  const std::vector<std::string> addresses = {(*cluster)->addresses()[0], (*proxy)->address()};

  absl::Mutex mu;
  std::vector<std::string> lines;
  std::vector<absl::Status> results(job.num_trainers);
  std::vector<int> rejoins(job.num_trainers, 0);
  std::atomic<int> finished{0};
  auto train = [&](int rank) -> absl::Status {
    RejoiningTrainer::Options options;
    options.client.server_addresses = addresses;
    options.client.trainer_rank = rank;
    options.client.encodings = WireEncodings(WireEncoding::kFp32);
    options.client.transport = "grpc";
    options.trainer = TinyTrainerOptions(7);
    options.retry_limit = absl::Minutes(1);
    options.log = [&](const std::string& line) {
      absl::MutexLock lock(&mu);
      lines.push_back(line);
    };
    ASSIGN_OR_RETURN(std::unique_ptr<ShardClient> client, ShardClient::Connect(options.client));
    ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer,
                     Trainer::Create(client.get(), &TestCorpus(), options.trainer));
    RejoiningTrainer runner(options, &TestCorpus(), std::move(client), std::move(trainer));
    while (runner.next_step() < kSteps) RETURN_IF_ERROR(runner.Step().status());
    rejoins[rank] = runner.rejoins();
    return absl::OkStatus();
  };
  std::vector<std::thread> trainers;
  for (int r = 0; r < job.num_trainers; ++r) {
    trainers.emplace_back([&, r] {
      results[r] = train(r);
      ++finished;
    });
  }
  // Resets at random points: alternately in what the server sends (fetch
  // responses) and in what the trainers send (pushes), each once its bytes
  // have gone by.
  // The seed is printed (and PSHARD_TEST_SEED replays one).
  const char* given = std::getenv("PSHARD_TEST_SEED");
  const uint32_t seed = given != nullptr ? static_cast<uint32_t>(std::strtoul(given, nullptr, 10))
                                         : std::random_device{}();
  std::printf("network faults: seed %u (PSHARD_TEST_SEED=%u replays the reset points)\n", seed, seed);
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  ::testing::Test::RecordProperty("seed", absl::StrCat(seed));
  std::mt19937 rng(seed);
  int armed = 0;
  while (finished.load() < job.num_trainers && armed < 6) {
    const auto direction = armed % 2 == 0 ? FaultProxy::Direction::kToClient : FaultProxy::Direction::kToServer;
    (*proxy)->ResetAfter(direction, 1 + static_cast<int64_t>(rng() % 60000));
    ++armed;
    while ((*proxy)->armed() && finished.load() < job.num_trainers) absl::SleepFor(absl::Milliseconds(2));
  }
  for (auto& t : trainers) t.join();
  for (int r = 0; r < job.num_trainers; ++r) ASSERT_TRUE(results[r].ok()) << "trainer " << r << ": " << results[r];

  EXPECT_GE((*proxy)->resets(), 2);
  EXPECT_GE(rejoins[0] + rejoins[1], 1);
  {
    absl::MutexLock lock(&mu);
    bool named = false;
    for (const std::string& line : lines) named |= line.find(absl::StrCat("shard 1 (", (*proxy)->address(), ")")) != std::string::npos;
    EXPECT_TRUE(named) << ::testing::PrintToString(lines);
  }
  auto got = (*cluster)->ReadMasterWeights(kSteps);
  ASSERT_TRUE(got.ok()) << got.status();
  auto want = TrainReference(job, WireEncoding::kFp32, TinyTrainerOptions(7), TestCorpus(), kSteps);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_TRUE(BitIdentical(*got, *want));
  // The trainers are done once their last pushes are acknowledged; the
  // servers apply that last step after it, so the counts are read once
  // shard 1 has counted kSteps updates (or 30 s have passed).
  absl::StatusOr<MetricsText> page;
  absl::StatusOr<double> applied;
  for (const absl::Time deadline = absl::Now() + absl::Seconds(30);;) {
    page = ParseMetricsText((*cluster)->server(1).registry().Serialize());
    ASSERT_TRUE(page.ok()) << page.status();
    applied = SampleValue(*page, "pshard_server_applied_updates_total", {});
    ASSERT_TRUE(applied.ok()) << applied.status();
    if (*applied >= kSteps || absl::Now() > deadline) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(*applied, static_cast<double>(kSteps));
  ::testing::Test::RecordProperty("resets", static_cast<int>((*proxy)->resets()));
  // A trainer that rejoins redoes one step: what it had pushed of that step
  // arrives again and is acknowledged, not applied. So shard 1 counts at
  // most one step's pushes per rejoin as duplicates (one per unit), and
  // applies one update per step, no more.
  absl::StatusOr<double> duplicates = SampleValue(*page, "pshard_server_duplicate_pushes_total", {});
  ASSERT_TRUE(duplicates.ok()) << duplicates.status();
  ::testing::Test::RecordProperty("duplicate_pushes", static_cast<int>(*duplicates));
  const int units = static_cast<int>((*cluster)->server(1).state().layout().partitions.size());
  EXPECT_LE(*duplicates, (rejoins[0] + rejoins[1]) * units);
}

}  // namespace
}  // namespace pshard::testing
