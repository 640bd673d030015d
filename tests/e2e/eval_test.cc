// Evaluation on held-out data (--val_data, --eval_every): a real local
// cluster reports the loss, and evaluating changes nothing of the training.
#include <cmath>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_util.h"

namespace pshard {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Held-out text unlike the built-in corpus in its words, like it in kind.
std::string WriteValText(const std::string& dir) {
  const std::string path = dir + "/val.txt";
  std::ofstream out(path);
  for (int i = 0; i < 60; ++i) {
    out << "Held-out line " << i << ": the quick brown fox jumps over the lazy dog, and the dog sleeps on.\n";
  }
  return path;
}

struct EvalLine {
  int step;
  double loss;
  int batches;
};

std::vector<EvalLine> EvalLines(const std::string& log) {
  std::vector<EvalLine> lines;
  const std::regex line(R"(eval after step (\d+) \| val loss ([0-9.]+) over (\d+) batches \((\d+) tokens\))");
  for (std::sregex_iterator it(log.begin(), log.end(), line), end; it != end; ++it) {
    lines.push_back({std::stoi((*it)[1]), std::stod((*it)[2]), std::stoi((*it)[3])});
  }
  return lines;
}

TEST(EvalE2E, TheValidationLossIsReportedAndTrainingIsUnchanged) {
  const std::string with_dir = MakeRunDir();
  const std::string val = WriteValText(with_dir);
  const std::vector<std::string> common = {"--servers=2", "--trainers=2", "--steps=6", "--log_every=1"};
  std::vector<std::string> flags = common;
  flags.insert(flags.end(), {absl::StrCat("--val_data=", val), "--eval_every=3", "--val_batches=4"});
  absl::StatusOr<ChildProcess> with = StartLocal(with_dir, flags);
  ASSERT_TRUE(with.ok()) << with.status();
  ASSERT_EQ(with->WaitUntil(absl::Now() + absl::Minutes(3)), 0) << ReadFile(with_dir + "/launcher.log");

  const std::string log = ReadFile(with_dir + "/launcher.log");
  const std::vector<EvalLine> evals = EvalLines(log);
  ASSERT_EQ(evals.size(), 2u) << log;
  EXPECT_EQ(evals[0].step, 3);
  EXPECT_EQ(evals[1].step, 6);
  for (const EvalLine& e : evals) {
    EXPECT_EQ(e.batches, 4);
    // Between a trained byte model's and a uniform guess's (ln 256 = 5.55).
    EXPECT_GT(e.loss, 0.5);
    EXPECT_LT(e.loss, 6.5);
  }
  // Only trainer 0 evaluates (no fabric groups here).
  EXPECT_THAT(ReadFile(with_dir + "/trainer1.log"), Not(HasSubstr("eval after step")));

  // The same job without evaluations trains the same losses: evaluating
  // pushed nothing and moved no step.
  const std::string without_dir = MakeRunDir();
  absl::StatusOr<ChildProcess> without = StartLocal(without_dir, common);
  ASSERT_TRUE(without.ok()) << without.status();
  ASSERT_EQ(without->WaitUntil(absl::Now() + absl::Minutes(3)), 0) << ReadFile(without_dir + "/launcher.log");
  const std::vector<double> trained = Losses(log);
  ASSERT_EQ(trained.size(), 6u) << log;
  EXPECT_EQ(Losses(ReadFile(without_dir + "/launcher.log")), trained);
  EXPECT_THAT(ReadFile(without_dir + "/launcher.log"), Not(HasSubstr("eval after step")));
}

// Bad evaluation flags are refused before the trainer connects anywhere.
TEST(EvalE2E, BadEvaluationFlagsAreRefusedBeforeJoining) {
  const std::string dir = MakeRunDir();
  const std::string val = WriteValText(dir);
  {
    std::ofstream(dir + "/tiny.txt") << "too short";
  }
  const std::string trainer = std::string(PSHARD_BIN_DIR) + "/pshard-trainer --servers=127.0.0.1:1 ";
  struct Case {
    std::string flags;
    std::string message;
  };
  for (const Case& c : std::vector<Case>{
           {"--eval_every=3", "--val_data and --eval_every go together"},
           {absl::StrCat("--val_data=", val), "--val_data and --eval_every go together"},
           {absl::StrCat("--val_data=", val, " --eval_every=-1"), "go together"},
           {absl::StrCat("--val_data=", val, " --eval_every=2 --val_batches=0"), "--val_batches=0 must be >= 1"},
           {absl::StrCat("--val_data=", dir, "/missing.txt --eval_every=2"), "--val_data:"},
           {absl::StrCat("--val_data=", dir, "/tiny.txt --eval_every=2"), "not more than --seq_len=64"},
       }) {
    const CommandResult r = RunCommand(trainer + c.flags + " 2>&1");
    EXPECT_EQ(r.exit_code, 2) << c.flags << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr(c.message)) << c.flags;
    EXPECT_THAT(r.output, Not(HasSubstr("joined"))) << c.flags;
  }
}

}  // namespace
}  // namespace pshard
