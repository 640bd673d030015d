// Helpers for end-to-end tests that run the pshard binaries as processes.
#ifndef PSHARD_TESTS_E2E_E2E_UTIL_H_
#define PSHARD_TESTS_E2E_E2E_UTIL_H_

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tools/process.h"

namespace pshard {

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline std::string MakeRunDir() {
  char tmpl[] = "/tmp/pshard-e2e-XXXXXX";
  return mkdtemp(tmpl);
}

// Processes whose command line mentions `needle` (our run dir), excluding us.
inline int CountProcessesMentioning(const std::string& needle) {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string pid = entry.path().filename();
    if (pid.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(entry.path() / "cmdline");
    if (!in) continue;
    std::string cmd((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (cmd.find(needle) != std::string::npos && cmd.find("_test") == std::string::npos) ++count;
  }
  return count;
}

inline std::vector<double> Losses(const std::string& output) {
  std::vector<double> losses;
  std::regex line(R"(step (\d+)/(\d+) \| loss ([0-9.]+) \| [0-9.kM]+ tok/s \| compute \d+ ms \| comm \d+ ms \(exposed \d+ ms\))");
  for (std::sregex_iterator it(output.begin(), output.end(), line), end; it != end; ++it) {
    losses.push_back(std::stod((*it)[3]));
  }
  return losses;
}

inline absl::StatusOr<ChildProcess> StartLocal(const std::string& run_dir, std::vector<std::string> flags) {
  std::vector<std::string> argv = {std::string(PSHARD_BIN_DIR) + "/pshard", "local",
                                   absl::StrCat("--run_dir=", run_dir),
                                   // Fixed metrics ports would collide between tests run in parallel;
                                   // a later --metrics_port_base in `flags` wins.
                                   "--metrics_port_base=0"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  return ChildProcess::Spawn(argv, run_dir + "/launcher.log");
}

}  // namespace pshard

#endif  // PSHARD_TESTS_E2E_E2E_UTIL_H_
