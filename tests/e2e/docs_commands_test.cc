// Every `pshard local` example in README.md and docs/ runs as written: the
// commands are read from the documents (shell blocks and inline code), run
// with a short step count, and must train and exit 0. `tools/demo.sh` is
// `pshard local` after the set-up script, which the test build has done.
// Every `pshard plan` example prints its plan.
#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_util.h"

namespace pshard {
namespace {

struct DocCommand {
  std::string file;
  std::string command;
  bool plan = false;  ///< `pshard plan`, not a training command
};

bool IsPlanCommand(const std::string& line) {
  static const std::regex kCommand(R"(^build/bin/pshard plan( .*)?$)");
  return std::regex_match(line, kCommand);
}

// A training command: optional VAR=value assignments, then the demo script
// or `pshard local`.
bool IsTrainingCommand(const std::string& line) {
  static const std::regex kCommand(R"(^([A-Z_]+=\S+ +)*(tools/demo\.sh|build/bin/pshard local)( .*)?$)");
  return std::regex_match(line, kCommand);
}

std::vector<DocCommand> CommandsIn(const std::string& path) {
  std::vector<DocCommand> out;
  const std::string name = std::filesystem::path(path).lexically_relative(PSHARD_SOURCE_DIR).string();
  bool in_shell_block = false;
  const std::vector<std::string> lines = absl::StrSplit(ReadFile(path), '\n');
  for (const std::string& line : lines) {
    if (absl::StartsWith(line, "```")) {
      in_shell_block = !in_shell_block && (line == "```sh" || line == "```bash");
      continue;
    }
    std::vector<std::string> candidates;
    if (in_shell_block) {
      candidates.push_back(std::string(absl::StripAsciiWhitespace(line.substr(0, line.find(" #")))));
    } else {
      // Inline code spans.
      std::vector<std::string> parts = absl::StrSplit(line, '`');
      for (size_t i = 1; i < parts.size(); i += 2) candidates.push_back(parts[i]);
    }
    for (std::string c : candidates) {
      c = std::string(absl::StripSuffix(absl::StripAsciiWhitespace(c), " &"));
      if (IsTrainingCommand(c)) out.push_back({name, c});
      if (IsPlanCommand(c)) out.push_back({name, c, /*plan=*/true});
    }
  }
  return out;
}

std::vector<DocCommand> AllDocCommands() {
  std::vector<DocCommand> all = CommandsIn(std::string(PSHARD_SOURCE_DIR) + "/README.md");
  for (const auto& entry : std::filesystem::directory_iterator(std::string(PSHARD_SOURCE_DIR) + "/docs")) {
    if (entry.path().extension() != ".md") continue;
    std::vector<DocCommand> more = CommandsIn(entry.path().string());
    all.insert(all.end(), more.begin(), more.end());
  }
  return all;
}

TEST(DocsCommandsE2E, TheDocumentsHoldTheExamplesThisTestRuns) {
  std::vector<std::string> commands;
  for (const DocCommand& c : AllDocCommands()) commands.push_back(c.command);
  EXPECT_THAT(commands, ::testing::Contains("tools/demo.sh --link_rate=50mbit --prefetch=2"));
  EXPECT_THAT(commands, ::testing::Contains(::testing::StartsWith("build/bin/pshard plan --params=7.5B")));
  EXPECT_THAT(commands, ::testing::Contains(::testing::StartsWith("PSHARD_LINK_RATE=")));
  EXPECT_GE(commands.size(), 5u);
}

TEST(DocsCommandsE2E, EveryLocalClusterExampleTrainsAndExitsZero) {
  for (const DocCommand& doc : AllDocCommands()) {
    if (doc.plan) continue;
    SCOPED_TRACE(absl::StrCat(doc.file, ": ", doc.command));
    const std::string run_dir = MakeRunDir();
    const std::string command = absl::StrReplaceAll(
        doc.command, {{"tools/demo.sh", absl::StrCat(PSHARD_BIN_DIR, "/pshard local")},
                      {"build/bin/", absl::StrCat(PSHARD_BIN_DIR, "/")}});
    // Later flags win: a short run, free ports, and a run folder and
    // checkpoint folder of our own (the quick start's resumes otherwise).
    const CommandResult result = RunCommand(absl::StrCat(
        "cd ", PSHARD_SOURCE_DIR, " && timeout 300 env ", command,
        " --steps=3 --log_every=1 --metrics_port_base=0 --run_dir=", run_dir, " --checkpoint_dir=", run_dir,
        "/checkpoints 2>&1"));
    EXPECT_EQ(result.exit_code, 0) << result.output;
    EXPECT_THAT(result.output, ::testing::HasSubstr("trainers finished")) << result.output;
    EXPECT_EQ(Losses(result.output).size(), 3u) << result.output;
  }
}

TEST(DocsCommandsE2E, EveryPlanExamplePrintsItsPlan) {
  for (const DocCommand& doc : AllDocCommands()) {
    if (!doc.plan) continue;
    SCOPED_TRACE(absl::StrCat(doc.file, ": ", doc.command));
    const CommandResult result = RunCommand(absl::StrCat(
        "cd ", PSHARD_SOURCE_DIR, " && timeout 60 ",
        absl::StrReplaceAll(doc.command, {{"build/bin/", absl::StrCat(PSHARD_BIN_DIR, "/")}}), " 2>&1"));
    EXPECT_EQ(result.exit_code, 0) << result.output;
    EXPECT_THAT(result.output, ::testing::HasSubstr("Predicted step:")) << result.output;
    EXPECT_THAT(result.output, ::testing::HasSubstr("ZeRO-3 (+ weights)")) << result.output;
  }
}

}  // namespace
}  // namespace pshard
