// Network faults between trainers and a shard server: connections reset in
// the middle of a fetch's response and of a push's request (a TCP proxy
// that sends RST both ways). The trainers rejoin and redo their step, the
// server takes every contribution once, and the job's weights end bit for
// bit those of a job nobody disturbed.
#include <cstdio>
#include <cstdlib>
#include <functional>
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

// Trains `rank` to `steps` through the servers at `addresses`, rejoining
// after each failure a rejoin can cure; its lines go to `log`. The rejoins
// it took.
absl::StatusOr<int> TrainRejoining(const std::vector<std::string>& addresses, int rank, int64_t steps,
                                   std::function<void(const std::string&)> log) {
  RejoiningTrainer::Options options;
  options.client.server_addresses = addresses;
  options.client.trainer_rank = rank;
  options.client.encodings = WireEncodings(WireEncoding::kFp32);
  options.client.transport = "grpc";
  options.trainer = TinyTrainerOptions(7);
  options.retry_limit = absl::Minutes(1);
  options.log = std::move(log);
  ASSIGN_OR_RETURN(std::unique_ptr<ShardClient> client, ShardClient::Connect(options.client));
  ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(client.get(), &TestCorpus(), options.trainer));
  RejoiningTrainer runner(options, &TestCorpus(), std::move(client), std::move(trainer));
  while (runner.next_step() < steps) RETURN_IF_ERROR(runner.Step().status());
  return runner.rejoins();
}

// The seed of a test's reset points: PSHARD_TEST_SEED, or `fallback`;
// printed and recorded, so that a failure can be replayed.
uint32_t ResetSeed(uint32_t fallback) {
  const char* given = std::getenv("PSHARD_TEST_SEED");
  const uint32_t seed = given != nullptr ? static_cast<uint32_t>(std::strtoul(given, nullptr, 10)) : fallback;
  std::printf("network faults: seed %u (PSHARD_TEST_SEED=%u replays the reset points)\n", seed, seed);
  ::testing::Test::RecordProperty("seed", absl::StrCat(seed));
  return seed;
}

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
  std::vector<std::thread> trainers;
  for (int r = 0; r < job.num_trainers; ++r) {
    trainers.emplace_back([&, r] {
      absl::StatusOr<int> took = TrainRejoining(addresses, r, kSteps, [&](const std::string& line) {
        absl::MutexLock lock(&mu);
        lines.push_back(line);
      });
      results[r] = took.status();
      if (took.ok()) rejoins[r] = *took;
      ++finished;
    });
  }
  // Resets at random points: alternately in what the server sends (fetch
  // responses) and in what the trainers send (pushes), each once its bytes
  // have gone by.
  const uint32_t seed = ResetSeed(std::random_device{}());
  SCOPED_TRACE(absl::StrCat("seed ", seed));
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

// The rejoin path under many resets: every reset drops the trainers'
// clients (their channels, calls and the callbacks still finishing them) and
// joins again. The seed is fixed (and logged); the weights end those of a
// job nobody disturbed. PSHARD_TEST_RESETS sets the number of resets.
TEST(NetworkFaults, HundredsOfResetsRejoinCleanlyAndEndBitIdentical) {
  const char* given = std::getenv("PSHARD_TEST_RESETS");
  const int want_resets = given != nullptr ? std::atoi(given) : 500;
  // A reset costs a step or two: room for every reset and some steps after.
  const int64_t steps = 3 * want_resets + 20;
  const JobConfig job = TinyGptJob(2, 2, steps);
  auto cluster = LocalCluster::Start(job);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto proxy = FaultProxy::Start((*cluster)->server(1).port());
  ASSERT_TRUE(proxy.ok()) << proxy.status();
  const std::vector<std::string> addresses = {(*cluster)->addresses()[0], (*proxy)->address()};

  std::vector<absl::StatusOr<int>> results(job.num_trainers, 0);
  std::atomic<int> finished{0};
  std::vector<std::thread> trainers;
  for (int r = 0; r < job.num_trainers; ++r) {
    trainers.emplace_back([&, r] {
      results[r] = TrainRejoining(addresses, r, steps, [](const std::string& line) { if (std::getenv("PSHARD_TEST_VERBOSE")) std::fprintf(stderr, "%s %s\n", absl::FormatTime("%H:%M:%E3S", absl::Now(), absl::UTCTimeZone()).c_str(), line.c_str()); });
      ++finished;
    });
  }
  // A reset event resets every connection open through the proxy at once.
  std::mt19937 rng(ResetSeed(20261205));
  int events = 0;
  while (finished.load() < job.num_trainers && events < want_resets) {
    const auto direction = rng() % 2 == 0 ? FaultProxy::Direction::kToClient : FaultProxy::Direction::kToServer;
    const int64_t before = (*proxy)->resets();
    (*proxy)->ResetAfter(direction, 1 + static_cast<int64_t>(rng() % 200000));
    while ((*proxy)->armed() && finished.load() < job.num_trainers) absl::SleepFor(absl::Milliseconds(1));
    if ((*proxy)->resets() > before) ++events;
  }
  for (auto& t : trainers) t.join();
  for (int r = 0; r < job.num_trainers; ++r) ASSERT_TRUE(results[r].ok()) << "trainer " << r << ": " << results[r].status();
  const int rejoins = *results[0] + *results[1];
  std::printf("network faults: %d reset events (%lld connections), %d rejoins\n", events,
              static_cast<long long>((*proxy)->resets()), rejoins);
  ::testing::Test::RecordProperty("reset_events", events);
  ::testing::Test::RecordProperty("rejoins", rejoins);
  ASSERT_GE(events, want_resets) << "the trainers finished " << steps << " steps first";
  // A reset between a trainer's calls costs it nothing (its channel
  // connects again); one in the middle of a call makes it rejoin.
  EXPECT_GE(rejoins, want_resets / 2);

  auto got = (*cluster)->ReadMasterWeights(steps);
  ASSERT_TRUE(got.ok()) << got.status();
  auto want = TrainReference(job, WireEncoding::kFp32, TinyTrainerOptions(7), TestCorpus(), steps);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_TRUE(BitIdentical(*got, *want));
}

}  // namespace
}  // namespace pshard::testing
