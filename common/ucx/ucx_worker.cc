#include "common/ucx/ucx_worker.h"

#include <poll.h>

#include "absl/strings/str_cat.h"

namespace pshard::ucx {

absl::Status UcxError(const char* call, ucs_status_t status, const char* file, int line) {
  return absl::UnavailableError(
      absl::StrCat(call, ": ", ucs_status_string(status), " (", file, ":", line, ")"));
}

namespace {

ucs_status_t DropMessage(void*, const void*, size_t, void*, size_t, const ucp_am_recv_param_t*) {
  return UCS_OK;  // rendezvous data not asked for is released by UCX
}

}  // namespace

absl::StatusOr<std::unique_ptr<UcxWorker>> UcxWorker::Create(const std::vector<AmHandler>& handlers) {
  std::unique_ptr<UcxWorker> w(new UcxWorker());
  ucp_config_t* config = nullptr;
  if (ucs_status_t s = ucp_config_read(nullptr, nullptr, &config); s != UCS_OK) {
    return PSHARD_UCX_ERROR("ucp_config_read", s);
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.name = "pshard";
  ucs_status_t s = ucp_init(&params, config, &w->context_);
  ucp_config_release(config);
  if (s != UCS_OK) return PSHARD_UCX_ERROR("ucp_init", s);

  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_MULTI;  // Post() signals from any thread
  if (s = ucp_worker_create(w->context_, &worker_params, &w->worker_); s != UCS_OK) {
    return PSHARD_UCX_ERROR("ucp_worker_create", s);
  }
  if (s = ucp_worker_get_efd(w->worker_, &w->event_fd_); s != UCS_OK) {
    return PSHARD_UCX_ERROR("ucp_worker_get_efd", s);
  }
  ucp_address_t* address = nullptr;
  size_t address_length = 0;
  if (s = ucp_worker_get_address(w->worker_, &address, &address_length); s != UCS_OK) {
    return PSHARD_UCX_ERROR("ucp_worker_get_address", s);
  }
  w->address_.assign(reinterpret_cast<const char*>(address), address_length);
  ucp_worker_release_address(w->worker_, address);
  // Every other id gets a handler that drops the message: UCX 1.13
  // dereferences a missing handler when a rendezvous message arrives for an
  // id without one (below the highest registered id it reads an entry it
  // never initialised, above it past the end of its table), so any peer
  // could stop the process with one large message (both found by
  // fuzz/ucx_fuzzer).
  std::vector<AmHandler> all(handlers);
  all.reserve(kGuardedAmIds);
  for (uint32_t id = 0; id < kGuardedAmIds; ++id) {
    bool handled = false;
    for (const AmHandler& h : handlers) handled |= h.id == id;
    if (!handled) all.push_back(AmHandler{static_cast<uint16_t>(id), &DropMessage, nullptr});
  }
  for (const AmHandler& h : all) {
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = h.id;
    hp.cb = h.callback;
    hp.arg = h.arg;
    if (s = ucp_worker_set_am_recv_handler(w->worker_, &hp); s != UCS_OK) {
      return PSHARD_UCX_ERROR("ucp_worker_set_am_recv_handler", s);
    }
  }
  w->thread_ = std::thread([raw = w.get()] { raw->Run(); });
  return w;
}

UcxWorker::~UcxWorker() {
  Stop();
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
}

bool UcxWorker::Post(std::function<void()> fn) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return false;
    posted_.push_back(std::move(fn));
  }
  ucp_worker_signal(worker_);
  return true;
}

void UcxWorker::Stop(std::function<void()> last) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    last_ = std::move(last);
  }
  if (!thread_.joinable()) return;
  ucp_worker_signal(worker_);
  thread_.join();
}

void UcxWorker::RunPosted() {
  std::vector<std::function<void()>> work;
  {
    absl::MutexLock lock(&mu_);
    work.swap(posted_);
  }
  for (auto& fn : work) fn();
}

void UcxWorker::Run() {
  while (true) {
    RunPosted();
    while (ucp_worker_progress(worker_) != 0) {
    }
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) break;
      if (!posted_.empty()) continue;
    }
    const ucs_status_t armed = ucp_worker_arm(worker_);
    if (armed == UCS_ERR_BUSY) continue;  // events arrived meanwhile
    pollfd fd{event_fd_, POLLIN, 0};
    // Post() and Stop() signal the worker; the timeout is a safety net only.
    poll(&fd, 1, armed == UCS_OK ? 1000 : 1);
  }
  // Final work (posted before Stop, then the caller's last words), with a
  // bounded amount of progress so that closes and replies can complete.
  RunPosted();
  for (int i = 0; i < 1000 && ucp_worker_progress(worker_) != 0; ++i) {
  }
  std::function<void()> last;
  {
    absl::MutexLock lock(&mu_);
    last = std::move(last_);
  }
  if (last) last();
}

namespace {

struct SendContext {
  std::function<void(ucs_status_t)> done;
};

void SendCallback(void* request, ucs_status_t status, void* user_data) {
  auto* ctx = static_cast<SendContext*>(user_data);
  ctx->done(status);
  delete ctx;
  ucp_request_free(request);
}

}  // namespace

void SendAm(ucp_ep_h ep, uint16_t id, const void* header, size_t header_length, const void* data,
            size_t length, bool reply, std::function<void(ucs_status_t)> done) {
  auto* ctx = new SendContext{std::move(done)};
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.send = SendCallback;
  param.user_data = ctx;
  param.flags = reply ? UCP_AM_SEND_FLAG_REPLY : 0;
  ucs_status_ptr_t request = ucp_am_send_nbx(ep, id, header, header_length, data, length, &param);
  if (request == nullptr) {
    ctx->done(UCS_OK);
    delete ctx;
  } else if (UCS_PTR_IS_ERR(request)) {
    ctx->done(UCS_PTR_STATUS(request));
    delete ctx;
  }
}

}  // namespace pshard::ucx
