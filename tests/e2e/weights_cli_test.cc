// The layout and weights commands as users run them: a layout file from
// `pshard layout` serves the same job as the GPT flags (the same initial
// weights, exported from the live servers); a server given both is refused;
// the commands refuse bad flags with exit code 2 and say why.
#include <csignal>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_util.h"

namespace pshard {
namespace {

using ::testing::HasSubstr;

const std::vector<std::string> kGpt = {"--layers=2", "--d_model=32", "--heads=2", "--context=16"};

// Starts one pshard-server (a job of one shard) with `flags`; its address.
absl::StatusOr<std::string> StartServer(const std::string& dir, const std::string& name,
                                        const std::vector<std::string>& flags, std::vector<ChildProcess>& children) {
  std::vector<std::string> argv = {std::string(PSHARD_BIN_DIR) + "/pshard-server", "--metrics_address=",
                                   absl::StrCat("--port_file=", dir, "/", name, ".port")};
  argv.insert(argv.end(), flags.begin(), flags.end());
  absl::StatusOr<ChildProcess> child = ChildProcess::Spawn(argv, absl::StrCat(dir, "/", name, ".log"));
  if (!child.ok()) return child.status();
  children.push_back(*std::move(child));
  absl::StatusOr<int> port = WaitForPortFile(absl::StrCat(dir, "/", name, ".port"), children.back(), absl::Seconds(30));
  if (!port.ok()) return port.status();
  return absl::StrCat("127.0.0.1:", *port);
}

TEST(WeightsCliE2E, ALayoutFileServesTheSameJobAsTheGptFlags) {
  const std::string dir = MakeRunDir();
  const std::string pshard = std::string(PSHARD_BIN_DIR) + "/pshard";
  std::string layout_command = absl::StrCat(pshard, " layout --to=", dir, "/gpt.json");
  for (const std::string& f : kGpt) absl::StrAppend(&layout_command, " ", f);
  const CommandResult layout = RunCommand(layout_command + " 2>&1");
  ASSERT_EQ(layout.exit_code, 0) << layout.output;
  EXPECT_THAT(layout.output, HasSubstr("gpt layers=2 d_model=32 heads=2 context=16 vocab=256 (42368 parameters"));

  std::vector<ChildProcess> children;
  absl::StatusOr<std::string> from_flags = StartServer(dir, "flags", kGpt, children);
  ASSERT_TRUE(from_flags.ok()) << from_flags.status();
  absl::StatusOr<std::string> from_file = StartServer(dir, "file", {absl::StrCat("--layout=", dir, "/gpt.json")}, children);
  ASSERT_TRUE(from_file.ok()) << from_file.status();
  for (const auto& [address, name] : {std::pair{*from_flags, "flags"}, std::pair{*from_file, "file"}}) {
    const CommandResult exported =
        RunCommand(absl::StrCat(pshard, " export --from=", address, " --to=", dir, "/", name, ".safetensors 2>&1"));
    EXPECT_EQ(exported.exit_code, 0) << exported.output;
    EXPECT_THAT(exported.output, HasSubstr("at step 0 (42368 parameters, 29 tensors, fp32)"));
  }
  const std::string a = ReadFile(dir + "/flags.safetensors"), b = ReadFile(dir + "/file.safetensors");
  EXPECT_GT(a.size(), 4u * 42368u);  // embed 256x32 + 16x32, 2 blocks of 12x32^2 + 13x32, head 2x32 + 256x32
  EXPECT_TRUE(a == b) << "the servers' initial weights differ";
  for (ChildProcess& c : children) c.Signal(SIGTERM);
  for (ChildProcess& c : children) EXPECT_TRUE(c.WaitUntil(absl::Now() + absl::Seconds(20)).has_value());

  // Both a layout and GPT sizes: which one would the server mean?
  std::vector<ChildProcess> refused;
  EXPECT_FALSE(StartServer(dir, "both", {absl::StrCat("--layout=", dir, "/gpt.json"), "--layers=3"}, refused).ok());
  EXPECT_THAT(ReadFile(dir + "/both.log"), HasSubstr("--layers describes a GPT, and --layout gives the layout"));
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_EQ(refused[0].WaitUntil(absl::Now() + absl::Seconds(20)), std::optional<int>(2));
}

TEST(WeightsCliE2E, BadFlagsExitTwoAndSayWhy) {
  const std::string dir = MakeRunDir();
  const std::string pshard = std::string(PSHARD_BIN_DIR) + "/pshard";
  struct Case {
    std::string args, says;
  };
  const std::vector<Case> cases = {
      {"export --to=x.safetensors", "give --from=CHECKPOINT_DIR or --from=HOST:PORT"},
      {absl::StrCat("export --from=", dir, "/absent --to=x.safetensors"), "neither a checkpoint folder"},
      {absl::StrCat("export --from=", dir, " --to=x.safetensors --dtype=fp16"), "--dtype is fp32 or bf16"},
      {"export --from=127.0.0.1:1 --step=3 --to=x.safetensors", "--step and --from_shards choose among checkpoints"},
      {absl::StrCat("reshard --from=", dir, " --to=", dir, "/new"), "--num_shards=N (>= 1)"},
      {"sample --from=", "give --from=CHECKPOINT_DIR, --from=FILE.safetensors or --from=HOST:PORT"},
      {"sample --from=127.0.0.1:99999", "neither a checkpoint folder, a file `pshard export` wrote"},
      {"sample --from=foreign.safetensors", "does not say its layout"},
      {"sample --from=foreign.safetensors --step=3", "a file holds one step"},
      {absl::StrCat("sample --from=", dir, " --prompt="), "--prompt must hold at least one byte"},
      {"layout --heads=3", "width 128 is not divisible by heads 3"},
      {"export extra --from=a --to=b", "unexpected argument 'extra'"},
  };
  // A safetensors file that is not an export: no metadata to tell its layout.
  {
    const std::vector<float> one = {1.0f};
    const SafetensorsTensorView view{"w", SafetensorsDtype::kF32, {1},
                                     {reinterpret_cast<const uint8_t*>(one.data()), sizeof(float)}};
    ASSERT_TRUE(WriteSafetensors(dir + "/foreign.safetensors", {&view, 1}, {}).ok());
  }
  for (const Case& c : cases) {
    const CommandResult result = RunCommand(absl::StrCat("cd ", dir, " && ", pshard, " ", c.args, " 2>&1"));
    EXPECT_EQ(result.exit_code, 2) << c.args << ": " << result.output;
    EXPECT_THAT(result.output, HasSubstr(c.says)) << c.args;
  }
  // A folder without checkpoints is no bad flag: nothing to read (exit 1).
  const CommandResult empty =
      RunCommand(absl::StrCat(pshard, " export --from=", dir, " --to=", dir, "/x.safetensors 2>&1"));
  EXPECT_EQ(empty.exit_code, 1) << empty.output;
  EXPECT_THAT(empty.output, HasSubstr("no pshard checkpoints in"));
}

}  // namespace
}  // namespace pshard
