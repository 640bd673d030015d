#include "tools/process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/signals.h"

extern char** environ;

namespace pshard {

absl::StatusOr<ChildProcess> ChildProcess::Spawn(const std::vector<std::string>& argv,
                                                  const std::string& log_path) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  // This environment, naming this process as the child's launcher: a pshard
  // child stops when its launcher dies (CallOnTerminationSignal).
  const std::string launcher = absl::StrCat(kLauncherPidVariable, "=", getpid());
  std::vector<char*> env;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, launcher.c_str(), std::strlen(kLauncherPidVariable) + 1) != 0) env.push_back(*e);
  }
  env.push_back(const_cast<char*>(launcher.c_str()));
  env.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (!log_path.empty()) {
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_path.c_str(),
                                     O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  }
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  // Own process group: a Ctrl-C reaches the launcher, which stops children in order.
  posix_spawnattr_setpgroup(&attr, 0);
  sigset_t defaults;
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGINT);
  sigaddset(&defaults, SIGTERM);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK);
  ChildProcess child;
  child.name_ = argv[0];
  const int rc = posix_spawn(&child.pid_, argv[0].c_str(), &actions, &attr, args.data(), env.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) {
    return absl::InternalError(absl::StrCat("posix_spawn ", argv[0], ": ", std::strerror(rc)));
  }
  return child;
}

std::optional<int> ChildProcess::Poll() {
  if (exit_code_ || pid_ <= 0) return exit_code_;
  int status = 0;
  const pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  return exit_code_;
}

std::optional<int> ChildProcess::WaitUntil(absl::Time deadline) {
  while (!Poll() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  return exit_code_;
}

void ChildProcess::Signal(int signo) const {
  if (pid_ > 0 && !exit_code_) kill(pid_, signo);
}

absl::StatusOr<int> WaitForPortFile(const std::string& path, ChildProcess& child, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    std::ifstream in(path);
    int port = 0;
    if (in >> port && port > 0) return port;
    if (std::optional<int> code = child.Poll()) {
      return absl::UnavailableError(absl::StrCat(child.name(), " exited with code ", *code, " before serving"));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(
      absl::StrCat(child.name(), " did not report its port in ", path, " within ", absl::FormatDuration(timeout)));
}

}  // namespace pshard
