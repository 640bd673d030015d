#include "common/metrics/metrics_server.h"

#include <arpa/inet.h>
#include <link.h>
#include <netinet/in.h>

#include <cctype>
#include <mutex>

#include "absl/algorithm/container.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "civetweb.h"
#include "common/host_port.h"

namespace pshard::metrics {
namespace {

constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";

void InitCivetwebOnce() {
  static std::once_flag once;
  std::call_once(once, [] { mg_init_library(0); });
}

// Bytes of static thread-local storage the loaded libraries put in every
// thread's stack (civetweb's threads get 100 KiB in Debian's build).
int64_t StaticTlsBytes() {
  int64_t total = 0;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* sum) {
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          if (info->dlpi_phdr[i].p_type == PT_TLS) *static_cast<int64_t*>(sum) += info->dlpi_phdr[i].p_memsz;
        }
        return 0;
      },
      &total);
  return total;
}

// A host civetweb can bind: a host name, a dotted IPv4 address or a bracketed
// IPv6 one. civetweb itself would wrap "999.0.0.1" around to 231.0.0.1.
bool IsValidHost(const std::string& host) {
  unsigned char addr[sizeof(in6_addr)];
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    return inet_pton(AF_INET6, host.substr(1, host.size() - 2).c_str(), addr) == 1;
  }
  if (absl::c_all_of(host, [](char c) { return c == '.' || (c >= '0' && c <= '9'); })) {
    return inet_pton(AF_INET, host.c_str(), addr) == 1;
  }
  return absl::c_all_of(host, [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.';
  });
}

// Splits "host:port" and checks both parts.
absl::Status ParseAddress(const std::string& address, std::string* host, int* port) {
  absl::StatusOr<HostPort> parsed = ParseHostPort(address, /*min_port=*/0);
  if (!parsed.ok() || !IsValidHost(address.substr(0, address.rfind(':')))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics server address \"", address,
        "\" is not host:port (a host name, IPv4 or [IPv6] address; a port in 0..65535)"));
  }
  *host = address.substr(0, address.rfind(':'));  // IPv6 in brackets, as civetweb takes it
  *port = parsed->port;
  return absl::OkStatus();
}

}  // namespace

struct MetricsServer::Impl {
  const Registry* registry = nullptr;
  mg_context* context = nullptr;
  // civetweb's messages while starting (why binding failed), for the error;
  // later ones are dropped rather than printed to stderr.
  absl::Mutex mu;
  bool starting ABSL_GUARDED_BY(mu) = true;
  std::string start_messages ABSL_GUARDED_BY(mu);

  static int LogMessage(const mg_connection* conn, const char* message) {
    const mg_context* context = mg_get_context(conn);
    auto* impl = context != nullptr ? static_cast<Impl*>(mg_get_user_data(context)) : nullptr;
    if (impl == nullptr) return 1;
    absl::MutexLock lock(&impl->mu);
    if (impl->starting) {
      absl::StrAppend(&impl->start_messages, impl->start_messages.empty() ? "" : "; ", message);
    }
    return 1;  // handled: civetweb prints nothing
  }

  // Serves GET/HEAD /metrics; everything else is 404 (or 405 for other
  // methods on /metrics). Returns the HTTP status, as civetweb expects.
  static int HandleRequest(mg_connection* conn, void* cbdata) {
    const auto* impl = static_cast<const Impl*>(cbdata);
    const mg_request_info* request = mg_get_request_info(conn);
    const absl::string_view uri = request->local_uri != nullptr ? request->local_uri : "";
    if (uri != "/metrics") {
      mg_send_http_error(conn, 404, "Not found: only /metrics is served\n");
      return 404;
    }
    const absl::string_view method = request->request_method;
    if (method != "GET" && method != "HEAD") {
      mg_send_http_error(conn, 405, "Method not allowed: use GET\n");
      return 405;
    }
    const std::string body = impl->registry->Serialize();
    mg_send_http_ok(conn, kContentType, static_cast<long long>(body.size()));
    if (method == "GET") mg_write(conn, body.data(), body.size());
    return 200;
  }
};

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& address,
                                                                     const Registry* registry) {
  if (registry == nullptr) return absl::InvalidArgumentError("metrics server needs a registry");
  std::string host;
  int port = 0;
  if (absl::Status s = ParseAddress(address, &host, &port); !s.ok()) return s;
  InitCivetwebOnce();

  std::unique_ptr<MetricsServer> server(new MetricsServer());
  server->impl_ = std::make_unique<Impl>();
  server->impl_->registry = registry;
  server->host_ = host;

  const char* options[] = {
      "listening_ports", address.c_str(),
      "num_threads", "2",
      "request_timeout_ms", "10000",
      nullptr,
  };
  mg_callbacks callbacks = {};
  callbacks.log_message = &Impl::LogMessage;
  mg_init_data init = {};
  init.callbacks = &callbacks;
  init.user_data = server->impl_.get();
  init.configuration_options = options;
  mg_context* context = mg_start2(&init, /*error=*/nullptr);
  {
    absl::MutexLock lock(&server->impl_->mu);
    server->impl_->starting = false;
    if (context == nullptr) {
      const std::string& why = server->impl_->start_messages;
      std::string hint;
      if (absl::StrContains(why, "Cannot create threads")) {
        hint = absl::StrCat(" (the libraries loaded into this process keep ", StaticTlsBytes() / 1024,
                            " KiB of thread-local storage in every thread's stack, and civetweb's threads may "
                            "get only 100 KiB)");
      }
      return absl::UnavailableError(absl::StrCat("cannot serve metrics on \"", address, "\": ",
                                                 why.empty() ? "civetweb failed to start" : why, hint));
    }
  }
  server->impl_->context = context;  // from here on, ~MetricsServer stops it
  mg_set_request_handler(context, "/", &Impl::HandleRequest, server->impl_.get());

  mg_server_port ports[4] = {};
  const int num_ports = mg_get_server_ports(context, 4, ports);
  if (num_ports < 1) {
    return absl::InternalError(
        absl::StrCat("metrics server on \"", address, "\" has no listening port"));
  }
  server->port_ = ports[0].port;
  return server;
}

MetricsServer::~MetricsServer() {
  if (impl_ != nullptr && impl_->context != nullptr) mg_stop(impl_->context);
}

std::string MetricsServer::address() const { return absl::StrCat(host_, ":", port_); }

}  // namespace pshard::metrics
