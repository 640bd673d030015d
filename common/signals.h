// Turns SIGINT/SIGTERM into a callback for clean shutdown of a main().
#ifndef PSHARD_COMMON_SIGNALS_H_
#define PSHARD_COMMON_SIGNALS_H_

#include <functional>

namespace pshard {

/// Blocks SIGINT and SIGTERM in the calling thread (and every thread it
/// starts afterwards) and runs `on_signal(signo)` on a helper thread when
/// one arrives. Call at the top of main(), before any thread is started.
void CallOnTerminationSignal(std::function<void(int)> on_signal);

}  // namespace pshard

#endif  // PSHARD_COMMON_SIGNALS_H_
