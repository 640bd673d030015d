// The main job as the README runs it learns the default corpus.
#include <regex>
#include <string>

#include "gtest/gtest.h"
#include "tests/e2e/e2e_util.h"

namespace pshard {
namespace {

// The demo's default configuration learns: its final loss ends clearly below
// the corpus's unigram entropy, and both are printed.
TEST(LocalClusterE2E, DemoLossEndsBelowUnigramEntropy) {
  const std::string run_dir = MakeRunDir();
  auto launcher = StartLocal(run_dir, {});
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
}

}  // namespace
}  // namespace pshard
