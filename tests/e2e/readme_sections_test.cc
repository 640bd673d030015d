// The README's quick start (train -> evaluate -> sample -> export ->
// reshard) and its "your PyTorch model" command run as written, in a
// folder of their own, with fewer steps.
#include <filesystem>
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

using ::testing::HasSubstr;

// The lines of the first ```sh block after `heading` in README.md.
std::vector<std::string> ShellBlockAfter(const std::string& heading) {
  const std::string readme = ReadFile(std::string(PSHARD_SOURCE_DIR) + "/README.md");
  const size_t at = readme.find(heading);
  EXPECT_NE(at, std::string::npos) << heading;
  if (at == std::string::npos) return {};
  const size_t begin = readme.find("```sh\n", at);
  const size_t end = readme.find("```", begin + 6);
  std::vector<std::string> lines;
  for (absl::string_view line : absl::StrSplit(readme.substr(begin + 6, end - begin - 6), '\n', absl::SkipEmpty())) {
    lines.emplace_back(absl::StripAsciiWhitespace(line));
  }
  return lines;
}

// The checkpoint files in `dir` (shard-*.ckpt).
std::vector<std::string> ListCheckpointFilesIn(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (absl::StartsWith(name, "shard-") && absl::EndsWith(name, ".ckpt")) names.push_back(name);
  }
  return names;
}

// `line` as it runs here: this build's binaries, the source tree's files.
std::string Here(const std::string& line) {
  return absl::StrReplaceAll(line, {{"tools/demo.sh", absl::StrCat(PSHARD_BIN_DIR, "/pshard local")},
                                    {"build/bin/", absl::StrCat(PSHARD_BIN_DIR, "/")},
                                    {"build/python", absl::StrCat(PSHARD_BIN_DIR, "/../python")},
                                    {"=README.md", absl::StrCat("=", PSHARD_SOURCE_DIR, "/README.md")},
                                    {"examples/", absl::StrCat(PSHARD_SOURCE_DIR, "/examples/")}});
}

TEST(ReadmeE2E, QuickStartTrainsEvaluatesSamplesExportsAndReshards) {
  const std::vector<std::string> lines = ShellBlockAfter("## Quick start");
  ASSERT_EQ(lines.size(), 4u);
  ASSERT_TRUE(absl::StartsWith(lines[0], "tools/demo.sh "));
  const std::string dir = MakeRunDir();
  auto run = [&](const std::string& line, const std::string& extra = "") {
    return RunCommand(absl::StrCat("cd ", dir, " && timeout 600 ", Here(line), extra, " 2>&1"));
  };
  // The demo, shorter: 30 steps, evaluated after the last.
  const CommandResult train = run(lines[0], " --steps=30 --log_every=10 --metrics_port_base=0");
  ASSERT_EQ(train.exit_code, 0) << train.output;
  EXPECT_THAT(train.output, HasSubstr("eval after step 30 | val loss"));
  EXPECT_FALSE(ListCheckpointFilesIn(dir + "/runs/quickstart").empty());

  const CommandResult sample = run(lines[1]);
  ASSERT_EQ(sample.exit_code, 0) << sample.output;
  EXPECT_THAT(sample.output, HasSubstr("The shard "));
  EXPECT_THAT(sample.output, HasSubstr("pshard sample: 120 tokens from gpt layers=4"));
  EXPECT_EQ(run(lines[1]).output, sample.output) << "the same seed gives the same text";
  const CommandResult other = run(absl::StrReplaceAll(lines[1], {{"--seed=7", "--seed=8"}}));
  ASSERT_EQ(other.exit_code, 0) << other.output;
  EXPECT_NE(other.output, sample.output);

  const CommandResult exported = run(lines[2]);
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  EXPECT_THAT(exported.output, HasSubstr("at step 30 (867072 parameters, 53 tensors"));
  EXPECT_GT(std::filesystem::file_size(dir + "/runs/quickstart/model.safetensors"), 3'000'000u);

  // Fine-tuning from the export: the first step's loss is the trained
  // model's, not a fresh one's (ln 256 = 5.5).
  const CommandResult tuned = run("tools/demo.sh --init_from=runs/quickstart/model.safetensors",
                                  " --steps=2 --log_every=1 --metrics_port_base=0");
  ASSERT_EQ(tuned.exit_code, 0) << tuned.output;
  EXPECT_THAT(tuned.output, HasSubstr("pshard: initial weights from ")) << tuned.output;
  const std::vector<double> tuned_losses = Losses(tuned.output);
  ASSERT_EQ(tuned_losses.size(), 2u) << tuned.output;
  EXPECT_LT(tuned_losses[0], 3.5) << tuned.output;

  const CommandResult resharded = run(lines[3]);
  ASSERT_EQ(resharded.exit_code, 0) << resharded.output;
  EXPECT_EQ(ListCheckpointFilesIn(dir + "/runs/quickstart-2").size(), 2u);
  // Going on from the resharded checkpoint, as the text says.
  const std::string readme = ReadFile(std::string(PSHARD_SOURCE_DIR) + "/README.md");
  const std::string go_on = "tools/demo.sh --servers=2 --checkpoint_dir=runs/quickstart-2 --steps=400 --schedule_steps=300";
  ASSERT_THAT(readme, HasSubstr(absl::StrCat("`", go_on, "`")));
  const CommandResult resumed = run(go_on, " --steps=33 --schedule_steps=30 --log_every=1 --metrics_port_base=0");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("step 31/33 | loss"));  // from step 30 on
  EXPECT_EQ(Losses(resumed.output).size(), 3u) << resumed.output;
}

TEST(ReadmeE2E, TheTorchExampleTrains) {
  if (!std::filesystem::exists(std::string(PSHARD_BIN_DIR) + "/../python/pshard/torch.py")) {
    GTEST_SKIP() << "this build has no PyTorch bridge (pybind11-dev, python3-dev)";
  }
  const std::vector<std::string> lines = ShellBlockAfter("## Your PyTorch model");
  ASSERT_EQ(lines.size(), 1u);
  const std::string dir = MakeRunDir();
  const CommandResult result =
      RunCommand(absl::StrCat("cd ", dir, " && timeout 600 env ", Here(lines[0]), " --steps=40 2>&1"));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("3 servers, 2 trainers"));
  std::vector<double> losses;
  for (absl::string_view line : absl::StrSplit(result.output, '\n')) {
    if (!absl::StartsWith(line, "step ")) continue;
    const size_t at = line.find("| loss ");
    ASSERT_NE(at, absl::string_view::npos) << line;
    losses.push_back(std::stod(std::string(line.substr(at + 7))));
  }
  ASSERT_GE(losses.size(), 4u) << result.output;
  EXPECT_LT(losses.back(), losses.front() - 1.0) << result.output;
}

}  // namespace
}  // namespace pshard
