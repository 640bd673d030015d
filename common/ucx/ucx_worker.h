// One UCP context and worker with its own progress thread: the engine under
// the UCX data path of both the shard server and the trainer. Compiled only
// when UCX is (this header includes ucp.h).
#ifndef PSHARD_COMMON_UCX_UCX_WORKER_H_
#define PSHARD_COMMON_UCX_UCX_WORKER_H_

#include <ucp/api/ucp.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace pshard::ucx {

/// `call` failed with `status`, as an absl::Status naming the call and the place.
absl::Status UcxError(const char* call, ucs_status_t status, const char* file, int line);
#define PSHARD_UCX_ERROR(call, status) ::pshard::ucx::UcxError(call, status, __FILE__, __LINE__)

/// Owns a UCP context (active messages + wakeup) and one worker, and runs
/// the worker's progress on a thread that sleeps on the worker's event fd
/// when there is nothing to do. Every UCP call on the worker happens on that
/// thread: other threads hand work over with Post(). Active-message handlers
/// run on it too.
class UcxWorker {
 public:
  struct AmHandler {
    uint16_t id = 0;
    ucp_am_recv_callback_t callback = nullptr;
    void* arg = nullptr;
  };
  /// Active-message ids below this that `handlers` leave out are dropped on
  /// arrival: every id the wire can carry (16 bits), so that no peer
  /// reaches UCX's missing-handler path (about 1.5 MiB of handler table).
  static constexpr uint32_t kGuardedAmIds = 1u << 16;
  /// Creates the context and worker (UCX reads its UCX_* environment here),
  /// registers `handlers` and starts the progress thread.
  static absl::StatusOr<std::unique_ptr<UcxWorker>> Create(const std::vector<AmHandler>& handlers);
  /// Stops the thread (see Stop) and destroys the worker and the context.
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;

  /// The worker's address (ucp_worker_get_address), to hand to peers.
  const std::string& address() const { return address_; }
  /// Only on the progress thread.
  ucp_worker_h worker() const { return worker_; }
  /// Runs `fn` on the progress thread soon. Thread-safe; false (and `fn`
  /// dropped) once the worker is stopping.
  bool Post(std::function<void()> fn);
  /// Stops the progress thread after running `last` on it (e.g. closing
  /// endpoints, failing pending requests). Idempotent; the destructor calls it.
  void Stop(std::function<void()> last = nullptr);

 private:
  UcxWorker() = default;
  void Run();
  void RunPosted();

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int event_fd_ = -1;
  std::string address_;
  std::thread thread_;
  absl::Mutex mu_;
  std::vector<std::function<void()>> posted_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::function<void()> last_ ABSL_GUARDED_BY(mu_);
};

/// Sends an active message from the progress thread. `header` and the data
/// must stay valid until `done` runs (once; with the send's status).
void SendAm(ucp_ep_h ep, uint16_t id, const void* header, size_t header_length, const void* data,
            size_t length, bool reply, std::function<void(ucs_status_t)> done);

}  // namespace pshard::ucx

#endif  // PSHARD_COMMON_UCX_UCX_WORKER_H_
