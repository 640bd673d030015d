// Fabric groups of separate trainer processes (`pshard local
// --fabric_group_size=G`): each member fetches 1/G of every unit, the group
// completes it over TCP, reduces its gradients and pushes once; the servers'
// checkpoints after training equal those of the same job without groups,
// byte for byte.
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_util.h"

namespace pshard {
namespace {

using ::testing::HasSubstr;

constexpr int kServers = 3;
constexpr int kTrainers = 4;
constexpr int kSteps = 4;

// Runs the job and returns its run folder (checkpoints in <run>/ckpt).
// `extra`: more flags of pshard local.
std::string Train(int group_size, const std::vector<std::string>& extra = {}) {
  const std::string run_dir = MakeRunDir();
  std::vector<std::string> flags = {absl::StrCat("--servers=", kServers), absl::StrCat("--trainers=", kTrainers),
                                    absl::StrCat("--steps=", kSteps), "--encoding=fp32", "--layers=2",
                                    "--d_model=32", "--heads=2", "--context=16", "--batch=2", "--seq_len=16",
                                    "--log_every=1", absl::StrCat("--checkpoint_dir=", run_dir, "/ckpt"),
                                    absl::StrCat("--fabric_group_size=", group_size)};
  flags.insert(flags.end(), extra.begin(), extra.end());
  auto launcher = StartLocal(run_dir, flags);
  EXPECT_TRUE(launcher.ok()) << launcher.status();
  if (!launcher.ok()) return run_dir;
  std::optional<int> code = launcher->WaitUntil(absl::Now() + absl::Minutes(5));
  EXPECT_EQ(code, 0) << ReadFile(run_dir + "/launcher.log");
  return run_dir;
}

TEST(FabricGroupE2E, GroupedProcessesTrainExactlyLikeUngroupedOnes) {
  const std::string plain = Train(1);
  for (int group_size : {2, 4}) {
    SCOPED_TRACE(absl::StrCat("groups of ", group_size));
    // The groups of 4 over an emulated fabric: slower, the same numbers.
    const std::vector<std::string> fabric = {"--fabric_rate=1gbit", "--fabric_delay=1ms"};
    const std::string grouped = Train(group_size, group_size == 4 ? fabric : std::vector<std::string>());
    // Every member announced its group (rank 0 writes to the launcher's log).
    for (int r = 1; r < kTrainers; ++r) {
      const int first = r / group_size * group_size;
      std::vector<std::string> ranks;
      for (int m = first; m < first + group_size; ++m) ranks.push_back(absl::StrCat(m));
      EXPECT_THAT(ReadFile(absl::StrCat(grouped, "/trainer", r, ".log")),
                  HasSubstr(absl::StrCat("member ", r - first, " of fabric group [", absl::StrJoin(ranks, ","), "]",
                                         group_size == 4 ? ", fabric emulated at 1000.0 Mbit/s, 1ms latency" : "")));
    }
    for (int s = 0; s < kServers; ++s) {
      const std::string name = absl::StrFormat("shard-%d-of-%d.step-%010d.ckpt", s, kServers, kSteps);
      const std::string want = ReadFile(absl::StrCat(plain, "/ckpt/", name));
      const std::string got = ReadFile(absl::StrCat(grouped, "/ckpt/", name));
      ASSERT_FALSE(want.empty()) << plain << "/ckpt/" << name << " is missing";
      EXPECT_EQ(got.size(), want.size()) << name;
      EXPECT_TRUE(got == want) << name << " differs between grouped and ungrouped training";
    }
    std::filesystem::remove_all(grouped);
  }
  std::filesystem::remove_all(plain);
}

TEST(FabricGroupE2E, GroupsThatDoNotDivideTheTrainersAreRefused) {
  const std::string run_dir = MakeRunDir();
  auto launcher = StartLocal(run_dir, {"--servers=1", "--trainers=3", "--fabric_group_size=2", "--steps=1"});
  ASSERT_TRUE(launcher.ok()) << launcher.status();
  std::optional<int> code = launcher->WaitUntil(absl::Now() + absl::Minutes(1));
  EXPECT_EQ(code, 1);
  EXPECT_THAT(ReadFile(run_dir + "/launcher.log"), HasSubstr("fabric groups of 2 do not divide 3 trainers"));
  std::filesystem::remove_all(run_dir);
}

}  // namespace
}  // namespace pshard
