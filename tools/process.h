// Child processes for the local cluster: spawn with redirected output, wait
// with a deadline, signal.
#ifndef PSHARD_TOOLS_PROCESS_H_
#define PSHARD_TOOLS_PROCESS_H_

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace pshard {

/// One child process. Not thread-safe.
class ChildProcess {
 public:
  /// Starts `argv` in its own process group. Output goes to `log_path`
  /// (appended, stdout and stderr) or, when empty, to this process's own.
  /// The child's environment names this process as its launcher
  /// (kLauncherPidVariable): a pshard child stops when it dies.
  static absl::StatusOr<ChildProcess> Spawn(const std::vector<std::string>& argv,
                                            const std::string& log_path);

  pid_t pid() const { return pid_; }
  const std::string& name() const { return name_; }
  /// Exit code if the child has exited (128 + signal if killed), else nullopt.
  std::optional<int> Poll();
  /// Waits until the child exits or `deadline`; nullopt on timeout.
  std::optional<int> WaitUntil(absl::Time deadline);
  void Signal(int signo) const;

 private:
  pid_t pid_ = -1;
  std::string name_;
  std::optional<int> exit_code_;
};

/// Waits up to `timeout` for `path` to hold a port number written by a
/// starting server; fails early if `child` exits.
absl::StatusOr<int> WaitForPortFile(const std::string& path, ChildProcess& child, absl::Duration timeout);

}  // namespace pshard

#endif  // PSHARD_TOOLS_PROCESS_H_
