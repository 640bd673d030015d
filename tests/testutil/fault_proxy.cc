#include "tests/testutil/fault_proxy.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace pshard::testing {

struct FaultProxy::Connection {
  int client = -1;    // the trainer's end
  int server = -1;    // ours to the server
  std::atomic<bool> reset{false};
};

namespace {

sockaddr_in Loopback(int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return addr;
}

// Closing with a zero linger sends RST instead of FIN.
void Abort(int fd) {
  linger l{1, 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
  shutdown(fd, SHUT_RDWR);
}

}  // namespace

absl::StatusOr<std::unique_ptr<FaultProxy>> FaultProxy::Start(int upstream_port) {
  std::unique_ptr<FaultProxy> proxy(new FaultProxy());
  proxy->upstream_port_ = upstream_port;
  proxy->listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = Loopback(0);
  socklen_t length = sizeof(addr);
  if (proxy->listen_fd_ < 0 || bind(proxy->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(proxy->listen_fd_, 64) != 0 ||
      getsockname(proxy->listen_fd_, reinterpret_cast<sockaddr*>(&addr), &length) != 0) {
    return absl::InternalError(absl::StrCat("fault proxy: cannot listen: ", std::strerror(errno)));
  }
  proxy->port_ = ntohs(addr.sin_port);
  proxy->acceptor_ = std::thread([raw = proxy.get()] { raw->Accept(); });
  return proxy;
}

FaultProxy::~FaultProxy() {
  stopping_ = true;
  shutdown(listen_fd_, SHUT_RDWR);
  if (acceptor_.joinable()) acceptor_.join();
  close(listen_fd_);
  ResetEverything();
  std::vector<std::thread> pumps;
  {
    absl::MutexLock lock(&mu_);
    pumps.swap(pumps_);
  }
  for (auto& t : pumps) t.join();
}

std::string FaultProxy::address() const { return absl::StrCat("127.0.0.1:", port_); }

void FaultProxy::ResetAfter(Direction direction, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  armed_ = true;
  armed_direction_ = direction;
  armed_bytes_ = bytes;
}

bool FaultProxy::armed() const {
  absl::MutexLock lock(&mu_);
  return armed_;
}

bool FaultProxy::Count(Direction direction, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (!armed_ || direction != armed_direction_) return false;
  armed_bytes_ -= bytes;
  if (armed_bytes_ > 0) return false;
  armed_ = false;
  return true;
}

void FaultProxy::ResetEverything() {
  // Under the lock: a pump closes its sockets under it too, after leaving
  // the list, so no descriptor here has been closed (and reused).
  absl::MutexLock lock(&mu_);
  for (auto& c : connections_) {
    if (c->reset.exchange(true)) continue;
    Abort(c->client);
    Abort(c->server);
    ++resets_;
  }
  connections_.clear();
}

void FaultProxy::Accept() {
  while (!stopping_) {
    const int client = accept(listen_fd_, nullptr, nullptr);
    if (client < 0) {
      if (errno == EINTR) continue;
      return;  // shut down
    }
    const int server = socket(AF_INET, SOCK_STREAM, 0);
    const sockaddr_in upstream = Loopback(upstream_port_);
    if (server < 0 || connect(server, reinterpret_cast<const sockaddr*>(&upstream), sizeof(upstream)) != 0) {
      Abort(client);
      close(client);
      if (server >= 0) close(server);
      continue;
    }
    // Forwarded as it comes, as gRPC's own sockets send (no Nagle delay).
    const int one = 1;
    setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    setsockopt(server, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    auto connection = std::make_shared<Connection>();
    connection->client = client;
    connection->server = server;
    absl::MutexLock lock(&mu_);
    connections_.push_back(connection);
    pumps_.emplace_back([this, connection] { Pump(connection); });
  }
}

void FaultProxy::Pump(std::shared_ptr<Connection> c) {
  char buffer[16384];
  pollfd fds[2] = {{c->client, POLLIN, 0}, {c->server, POLLIN, 0}};
  while (!c->reset.load()) {
    if (poll(fds, 2, 100) < 0 && errno != EINTR) break;
    bool closed = false;
    for (int i = 0; i < 2 && !closed; ++i) {
      if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      const ssize_t n = read(fds[i].fd, buffer, sizeof(buffer));
      if (n <= 0) {
        closed = true;
        break;
      }
      const Direction direction = i == 0 ? Direction::kToServer : Direction::kToClient;
      const int to = i == 0 ? c->server : c->client;
      // The armed reset fires in the middle of this read: part of it goes
      // through, the rest never arrives.
      if (Count(direction, n)) {
        (void)!send(to, buffer, static_cast<size_t>(n / 2), MSG_NOSIGNAL);
        ResetEverything();
        closed = true;
        break;
      }
      for (ssize_t sent = 0; sent < n;) {
        const ssize_t w = send(to, buffer + sent, static_cast<size_t>(n - sent), MSG_NOSIGNAL);  // a closed peer is an error here, not SIGPIPE
        if (w <= 0) {
          closed = true;
          break;
        }
        sent += w;
      }
    }
    if (closed) break;
  }
  absl::MutexLock lock(&mu_);
  // The other end learns of a close as the original peer would have.
  if (!c->reset.exchange(true)) {
    shutdown(c->client, SHUT_RDWR);
    shutdown(c->server, SHUT_RDWR);
  }
  connections_.erase(std::remove(connections_.begin(), connections_.end(), c), connections_.end());
  close(c->client);
  close(c->server);
}

}  // namespace pshard::testing
