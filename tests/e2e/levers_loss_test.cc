// The quantized levers keep the demo's loss: its 300 steps as `pshard local`
// runs them by default, each lever against bf16 both ways, the final loss
// being the mean of the last 10 steps (docs/levers.md has the figures).
#include <cmath>
#include <cstdio>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_util.h"

namespace pshard {
namespace {

struct Trained {
  double final_loss = -1;
  std::string out;
};

// The demo with `flags`, to the end.
Trained Demo(const std::vector<std::string>& flags) {
  Trained t;
  const std::string run_dir = MakeRunDir();
  absl::StatusOr<ChildProcess> launcher = StartLocal(run_dir, flags);
  EXPECT_TRUE(launcher.ok()) << launcher.status();
  if (!launcher.ok()) return t;
  std::optional<int> code = launcher->WaitUntil(absl::Now() + absl::Minutes(5));
  t.out = ReadFile(run_dir + "/launcher.log");
  EXPECT_TRUE(code.has_value()) << "still running after 5 minutes:\n" << t.out;
  EXPECT_EQ(code.value_or(-1), 0) << t.out;
  std::smatch m;
  if (std::regex_search(t.out, m, std::regex(R"(trainer 0 summary: 300 steps \| final loss ([0-9.]+))"))) {
    t.final_loss = std::stod(m[1]);
  }
  EXPECT_GT(t.final_loss, 0) << t.out;
  return t;
}

TEST(LeversLossE2E, QuantizedLeversKeepTheDemosLossWithinTheirBounds) {
  const Trained bf16 = Demo({"--encoding=bf16"});
  ASSERT_GT(bf16.final_loss, 0);
  struct Lever {
    std::vector<std::string> flags;
    double bound;  // relative to bf16
  };
  const std::vector<Lever> levers = {
      {{"--weight_encoding=int8"}, 0.01},
      {{"--grad_encoding=int8"}, 0.01},
      {{"--grad_encoding=int4"}, 0.02},  // error feedback is on by default
      {{"--weight_encoding=int8", "--grad_encoding=int4", "--reshard_after_forward=false"}, 0.02},
  };
  std::printf("bf16 both ways: final loss %.3f\n", bf16.final_loss);
  for (const Lever& lever : levers) {
    const Trained t = Demo(lever.flags);
    const double relative = t.final_loss / bf16.final_loss - 1.0;
    std::printf("%s: final loss %.3f (%+.1f%% against bf16)\n", absl::StrJoin(lever.flags, " ").c_str(),
                t.final_loss, 100.0 * relative);
    EXPECT_LT(std::abs(relative), lever.bound) << absl::StrJoin(lever.flags, " ") << ":\n" << t.out;
    if (lever.flags[0] == "--grad_encoding=int4" && lever.flags.size() == 1) {
      // The startup line says what travels and what error feedback holds.
      EXPECT_NE(t.out.find("weights bf16, gradients int4, blocks of 64 on the wire"), std::string::npos) << t.out;
      EXPECT_NE(t.out.find("of gradient residuals in host memory"), std::string::npos) << t.out;
    }
  }
}

}  // namespace
}  // namespace pshard
