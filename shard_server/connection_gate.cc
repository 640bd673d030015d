#include "shard_server/connection_gate.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace pshard {
namespace {

// How often connections gRPC has closed are looked for (their places freed).
constexpr int kPruneEveryMs = 200;

absl::Status Errno(const std::string& what) { return absl::UnavailableError(absl::StrCat(what, ": ", strerror(errno))); }

// The peer's host, as a cap's key ("host 10.0.0.7").
std::string PeerHost(const sockaddr_storage& addr) {
  char text[INET6_ADDRSTRLEN] = "?";
  if (addr.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in&>(addr).sin_addr, text, sizeof(text));
  } else if (addr.ss_family == AF_INET6) {
    const in6_addr& a = reinterpret_cast<const sockaddr_in6&>(addr).sin6_addr;
    if (IN6_IS_ADDR_V4MAPPED(&a)) {
      inet_ntop(AF_INET, &a.s6_addr[12], text, sizeof(text));
    } else {
      inet_ntop(AF_INET6, &a, text, sizeof(text));
    }
  }
  return absl::StrCat("host ", text);
}

// A listening socket on `ai`'s address with `port` (0: any), or why not.
absl::StatusOr<int> ListenOn(const addrinfo& ai, int port, bool v6_only) {
  sockaddr_storage addr{};
  std::memcpy(&addr, ai.ai_addr, ai.ai_addrlen);
  if (ai.ai_family == AF_INET) reinterpret_cast<sockaddr_in&>(addr).sin_port = htons(static_cast<uint16_t>(port));
  if (ai.ai_family == AF_INET6) reinterpret_cast<sockaddr_in6&>(addr).sin6_port = htons(static_cast<uint16_t>(port));
  const int fd = socket(ai.ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("socket");
  const int one = 1;
  const int v6only = v6_only ? 1 : 0;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // a restarted server takes its port back
  if (ai.ai_family == AF_INET6) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, sizeof(v6only));
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), ai.ai_addrlen) != 0 || listen(fd, SOMAXCONN) != 0) {
    absl::Status s = Errno("bind");
    close(fd);
    return s;
  }
  return fd;
}

int BoundPort(int fd) {
  sockaddr_storage addr{};
  socklen_t length = sizeof(addr);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length) != 0) return 0;
  if (addr.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in&>(addr).sin_port);
  return ntohs(reinterpret_cast<sockaddr_in6&>(addr).sin6_port);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ConnectionGate>> ConnectionGate::Listen(const std::string& address,
                                                                        ConnectionCaps* caps,
                                                                        metrics::Counter* refused) {
  // The caps, not the descriptor limit, decide which connections are taken.
  if (rlimit files{}; getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    setrlimit(RLIMIT_NOFILE, &files);
  }
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return absl::InvalidArgumentError(absl::StrCat("\"", address, "\" is not host:port"));
  std::string host = address.substr(0, colon);
  const std::string service = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* resolved = nullptr;
  if (const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &resolved); rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat("cannot listen on ", address, ": ", gai_strerror(rc)));
  }
  bool has_v4 = false;
  for (const addrinfo* ai = resolved; ai != nullptr; ai = ai->ai_next) has_v4 |= ai->ai_family == AF_INET;
  // Every address the host names, on one port (the first one's, where 0
  // asks for any): "localhost" is both 127.0.0.1 and ::1.
  std::vector<int> listeners;
  int port = std::atoi(service.c_str());
  absl::Status first_error;
  for (const addrinfo* ai = resolved; ai != nullptr; ai = ai->ai_next) {
    if (ai->ai_family != AF_INET && ai->ai_family != AF_INET6) continue;
    absl::StatusOr<int> fd = ListenOn(*ai, port, /*v6_only=*/has_v4);
    if (!fd.ok()) {
      if (first_error.ok()) first_error = fd.status();
      continue;
    }
    listeners.push_back(*fd);
    port = BoundPort(*fd);
  }
  freeaddrinfo(resolved);
  if (listeners.empty()) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address, ": ", first_error.message()));
  }
  return std::unique_ptr<ConnectionGate>(new ConnectionGate(std::move(listeners), port, caps, refused));
}

ConnectionGate::ConnectionGate(std::vector<int> listeners, int port, ConnectionCaps* caps, metrics::Counter* refused)
    : listeners_(std::move(listeners)), port_(port), caps_(caps), refused_(refused) {
  wake_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
}

ConnectionGate::~ConnectionGate() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    (void)!write(wake_, &one, sizeof(one));
    thread_.join();
  }
  for (int fd : listeners_) close(fd);
  if (wake_ >= 0) close(wake_);
}

void ConnectionGate::Start(grpc::experimental::ExternalConnectionAcceptor* acceptor) {
  acceptor_ = acceptor;
  thread_ = std::thread([this] { Run(); });
}

void ConnectionGate::Run() {
  std::vector<pollfd> polled;
  for (int fd : listeners_) polled.push_back({fd, POLLIN, 0});
  polled.push_back({wake_, POLLIN, 0});
  absl::Time next_prune = absl::Now();
  for (;;) {
    const int ready = poll(polled.data(), polled.size(), kPruneEveryMs);
    if (ready < 0 && errno != EINTR) {
      std::fprintf(stderr, "pshard-server: the listening socket failed (poll: %s); no new connections\n",
                   strerror(errno));
      return;
    }
    if (polled.back().revents != 0) return;  // stopping
    if (absl::Now() >= next_prune) {
      ForgetClosed();
      next_prune = absl::Now() + absl::Milliseconds(kPruneEveryMs);
    }
    for (size_t i = 0; i + 1 < polled.size(); ++i) {
      if (polled[i].revents != 0) Accept(polled[i].fd);
    }
  }
}

void ConnectionGate::Accept(int listener) {
  for (;;) {
    sockaddr_storage addr{};
    socklen_t length = sizeof(addr);
    const int fd = accept4(listener, reinterpret_cast<sockaddr*>(&addr), &length, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOMEM || errno == ENOBUFS) {
        std::fprintf(stderr, "pshard-server: cannot accept a connection: %s\n", strerror(errno));
        absl::SleepFor(absl::Milliseconds(50));  // poll would report the same connection at once
      }
      return;  // EAGAIN: none left; others (the peer gave up): the next
    }
    const std::string host = PeerHost(addr);
    absl::StatusOr<std::shared_ptr<ConnectionCaps::Place>> place = caps_->Take(host, 1);
    if (!place.ok()) {
      ForgetClosed();  // the count may hold connections gRPC closed since the last look
      place = caps_->Take(host, 1);
    }
    if (!place.ok()) {
      close(fd);
      if (refused_) refused_->Increment();
      if (refusals_logged_++ % 1000 == 0) {
        std::fprintf(stderr, "pshard-server: a connection from %s closed unanswered: %s (%lld so far)\n",
                     host.substr(5).c_str(), std::string(place.status().message()).c_str(),
                     static_cast<long long>(refusals_logged_));
      }
      continue;
    }
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    struct stat st {};
    fstat(fd, &st);
    // A descriptor number accept gives again was closed by gRPC: the
    // connection it held is gone (its place is freed by the assignment).
    open_[fd] = Open{st.st_ino, std::move(*place)};
    grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters connection;
    connection.listener_fd = listener;
    connection.fd = fd;
    acceptor_->HandleNewConnection(&connection);
  }
}

void ConnectionGate::ForgetClosed() {
  absl::erase_if(open_, [](const auto& entry) {
    struct stat st {};
    return fstat(entry.first, &st) != 0 || !S_ISSOCK(st.st_mode) || st.st_ino != entry.second.inode;
  });
}

}  // namespace pshard
