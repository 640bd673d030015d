// Helpers for end-to-end tests that run the pshard binaries as processes.
#ifndef PSHARD_TESTS_E2E_E2E_UTIL_H_
#define PSHARD_TESTS_E2E_E2E_UTIL_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
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
  std::regex line(R"(step (\d+)/(\d+) \| loss ([0-9.]+) \| [0-9.kM]+ tok/s \(cluster\) \| compute \d+ ms \| comm \d+ ms \(exposed \d+ ms\))");
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

// True when nothing listens on 127.0.0.1:`port` (a bind to it succeeds).
inline bool PortIsFree(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool free = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return free;
}

// Percent-encodes everything but RFC 3986 unreserved characters.
inline std::string UrlEncode(const std::string& text) {
  std::string out;
  for (unsigned char c : text) {
    if (isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      char hex[4];
      snprintf(hex, sizeof(hex), "%%%02X", c);
      out += hex;
    }
  }
  return out;
}

struct CommandResult {
  int exit_code = -1;
  std::string output;
};

// Runs `command` with /bin/sh, capturing its stdout (add 2>&1 for stderr).
inline CommandResult RunCommand(const std::string& command) {
  CommandResult result;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) result.output.append(buffer, n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

// The gRPC addresses of the shard servers of a `pshard local` run (line 1
// of RUN_DIR/serverS.port); empty when a port file is missing.
inline std::vector<std::string> LocalServerAddresses(const std::string& run_dir, int num_servers) {
  std::vector<std::string> addresses;
  for (int s = 0; s < num_servers; ++s) {
    std::ifstream in(absl::StrCat(run_dir, "/server", s, ".port"));
    int port = 0;
    if (!(in >> port) || port <= 0) return {};
    addresses.push_back(absl::StrCat("127.0.0.1:", port));
  }
  return addresses;
}

}  // namespace pshard

#endif  // PSHARD_TESTS_E2E_E2E_UTIL_H_
