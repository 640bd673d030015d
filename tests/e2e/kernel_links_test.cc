// The kernel's links against the in-process emulation: the same job over
// links that tc tbf shapes between network namespaces, and over the
// emulation, both comm-bound and moving the same bytes. How close their
// step times are is a benchmark (bench/link_emulation.sh: within 10%), not
// a test: a loaded machine moves it. Needs root and iproute2; skips without
// them.
#include <unistd.h>

#include <cstdio>
#include <filesystem>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lab/sweep.h"
#include "tests/e2e/e2e_util.h"

namespace pshard {
namespace {

bool CanMakeNetworkNamespaces() {
  if (geteuid() != 0) return false;
  const std::string name = "pshard-probe-" + std::to_string(getpid());
  const CommandResult add = RunCommand("ip netns add " + name + " 2>&1");
  if (add.exit_code != 0) return false;
  RunCommand("ip netns del " + name + " 2>&1");
  return true;
}

// Mean step of trainer 0 after 2 warm-up steps.
absl::StatusOr<PointMeasurement> RunJob(const std::string& mode) {
  const std::string run_dir = MakeRunDir();
  absl::StatusOr<ChildProcess> job = StartLocal(
      run_dir, {"--servers=2", "--trainers=1", "--steps=8", "--log_every=0", "--link_rate=50mbit",
                absl::StrCat("--link_mode=", mode)});
  if (!job.ok()) return job.status();
  std::optional<int> code = job->WaitUntil(absl::Now() + absl::Minutes(3));
  if (code != 0) {
    return absl::InternalError(absl::StrCat(mode, " run failed:\n", ReadFile(run_dir + "/launcher.log")));
  }
  return MeasureStepLogs({run_dir + "/trainer0.steps.jsonl"}, 2);
}

TEST(KernelLinksE2E, TheKernelsLinksCarryTheEmulatedJob) {
  if (!CanMakeNetworkNamespaces()) GTEST_SKIP() << "needs root and ip netns (iproute2)";
  absl::StatusOr<PointMeasurement> kernel = RunJob("kernel");
  ASSERT_TRUE(kernel.ok()) << kernel.status();
  absl::StatusOr<PointMeasurement> emulated = RunJob("emulated");
  ASSERT_TRUE(emulated.ok()) << emulated.status();
  std::printf("step at 50 Mbit/s: kernel (tc tbf, veth) %.1f ms, in-process emulation %.1f ms (%+.1f%%)\n",
              kernel->step_seconds * 1e3, emulated->step_seconds * 1e3,
              100 * (emulated->step_seconds / kernel->step_seconds - 1));
  // Comm-bound over both: the link, not compute, sets the step.
  EXPECT_GT(kernel->exposed_seconds, kernel->compute_seconds);
  EXPECT_GT(emulated->exposed_seconds, emulated->compute_seconds);
  EXPECT_EQ(kernel->fetched_bytes, emulated->fetched_bytes);
  // The namespaces are gone.
  EXPECT_THAT(RunCommand("ip netns list").output, ::testing::Not(::testing::HasSubstr("pshard-")));
}

// What the kernel mode cannot do is refused before anything starts.
TEST(KernelLinksE2E, KernelModeRefusesDelaysAndGroups) {
  for (const std::vector<std::string>& flags :
       {std::vector<std::string>{"--link_mode=kernel", "--link_rate=50mbit", "--link_delay=5ms"},
        std::vector<std::string>{"--link_mode=kernel"},
        std::vector<std::string>{"--link_mode=kernel", "--link_rate=50mbit", "--fabric_group_size=2"},
        std::vector<std::string>{"--link_mode=wire"}}) {
    const std::string run_dir = MakeRunDir();
    std::vector<std::string> all = {"--servers=2", "--trainers=2"};
    all.insert(all.end(), flags.begin(), flags.end());
    absl::StatusOr<ChildProcess> job = StartLocal(run_dir, all);
    ASSERT_TRUE(job.ok());
    EXPECT_EQ(job->WaitUntil(absl::Now() + absl::Seconds(30)), 2) << ReadFile(run_dir + "/launcher.log");
    EXPECT_THAT(ReadFile(run_dir + "/launcher.log"), ::testing::HasSubstr("--link_mode="));
    EXPECT_FALSE(std::filesystem::exists(run_dir + "/server0.port"));
  }
}

}  // namespace
}  // namespace pshard
