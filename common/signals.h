// Turns SIGINT/SIGTERM into a callback for clean shutdown of a main().
#ifndef PSHARD_COMMON_SIGNALS_H_
#define PSHARD_COMMON_SIGNALS_H_

#include <functional>

namespace pshard {

/// Runs `on_signal(signo)` on a helper thread when SIGINT or SIGTERM
/// arrives (once, for the first one). The signals' handler only writes the
/// number to a pipe, so whichever thread the kernel picks to take the
/// signal (libraries may start threads before main(), with no signal
/// blocked) hands it over. Call once, early in main().
///
/// A process started by a pshard launcher (`ChildProcess::Spawn`, which
/// names itself in kLauncherPidVariable) also gets SIGTERM when that
/// launcher dies, even by SIGKILL, so a killed `pshard local` takes its
/// servers and trainers with it; one whose launcher is already gone gets it
/// at once.
void CallOnTerminationSignal(std::function<void(int)> on_signal);

/// The environment variable that names a child's launcher (a process id).
inline constexpr char kLauncherPidVariable[] = "PSHARD_LAUNCHER_PID";

}  // namespace pshard

#endif  // PSHARD_COMMON_SIGNALS_H_
