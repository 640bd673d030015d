// The main job as the README runs it learns the default corpus.
#include <regex>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_util.h"

namespace pshard {
namespace {

// The demo's default configuration learns: its final loss ends clearly below
// the corpus's unigram entropy, and both are printed. Text sampled from its
// final checkpoint is the same for the same seed, and reads like the corpus
// (printable ASCII).
TEST(LocalClusterE2E, DemoLossEndsBelowUnigramEntropy) {
  const std::string run_dir = MakeRunDir();
  auto launcher = StartLocal(run_dir, {absl::StrCat("--checkpoint_dir=", run_dir, "/checkpoints")});
  ASSERT_TRUE(launcher.ok());
  std::optional<int> code = launcher->WaitUntil(absl::Now() + absl::Minutes(10));
  const std::string out = ReadFile(run_dir + "/launcher.log");
  ASSERT_TRUE(code.has_value()) << out;
  ASSERT_EQ(*code, 0) << out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex(R"(final loss ([0-9.]+) .* unigram entropy ([0-9.]+) nats)")))
      << out;
  const double final_loss = std::stod(m[1]);
  const double entropy = std::stod(m[2]);
  EXPECT_LT(final_loss, entropy - 1.0) << out;

  const std::string sample = absl::StrCat(PSHARD_BIN_DIR, "/pshard sample --from=", run_dir,
                                          "/checkpoints --prompt='The ' --tokens=200 --seed=3");
  const CommandResult first = RunCommand(sample);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_EQ(RunCommand(sample).output, first.output);
  ASSERT_EQ(first.output.size(), 4u + 200u + 1u) << first.output;
  int printable = 0;
  for (char c : first.output) printable += (c >= 32 && c < 127) || c == '\n';
  EXPECT_GE(printable, 190) << first.output;
}

}  // namespace
}  // namespace pshard
