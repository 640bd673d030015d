#include "common/signals.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <thread>

#include "absl/strings/numbers.h"

namespace pshard {
namespace {

int g_signal_pipe[2] = {-1, -1};

void OnSignal(int signo) {
  const int saved = errno;
  const unsigned char byte = static_cast<unsigned char>(signo);
  // Async-signal-safe; a full pipe means a signal is already waiting.
  [[maybe_unused]] const ssize_t n = write(g_signal_pipe[1], &byte, 1);
  errno = saved;
}

// SIGTERM when the launcher named in the environment dies. The kernel sends
// it when the launcher's spawning thread ends, which for pshard's launchers
// is their main thread.
void StopWithLauncher() {
  const char* named = std::getenv(kLauncherPidVariable);
  pid_t launcher = 0;
  if (named == nullptr || !absl::SimpleAtoi(named, &launcher) || launcher <= 1) return;
  if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0) return;
  if (getppid() == launcher) return;
  if (kill(launcher, 0) != 0 && errno == ESRCH) {
    raise(SIGTERM);  // it died before the line above took effect
  } else {
    prctl(PR_SET_PDEATHSIG, 0);  // inherited from further up: not this process's launcher
  }
}

}  // namespace

void CallOnTerminationSignal(std::function<void(int)> on_signal) {
  if (pipe2(g_signal_pipe, O_CLOEXEC) != 0) return;
  struct sigaction action = {};
  action.sa_handler = OnSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  // A signal mask survives exec: a parent may have left them blocked.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  std::thread([on_signal = std::move(on_signal)] {
    unsigned char byte = 0;
    ssize_t n = 0;
    do {
      n = read(g_signal_pipe[0], &byte, 1);
    } while (n < 0 && errno == EINTR);
    if (n == 1) on_signal(byte);
  }).detach();
  StopWithLauncher();
}

}  // namespace pshard
