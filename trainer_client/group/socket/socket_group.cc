#include "trainer_client/group/socket/socket_group.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/host_port.h"
#include "common/reduction_tree.h"

namespace pshard {
namespace {

constexpr uint32_t kHelloMagic = 0x70734731;  // "psG1"
constexpr uint32_t kFrameMagic = 0x70734746;  // "psGF"

enum class Op : uint32_t { kAllGather = 1, kReduceScatter = 2, kExchange = 3 };

const char* OpName(Op op) {
  switch (op) {
    case Op::kAllGather:
      return "all-gather";
    case Op::kReduceScatter:
      return "reduce-scatter";
    case Op::kExchange:
      return "exchange";
  }
  return "unknown";
}

struct Hello {
  uint32_t magic = kHelloMagic;
  uint32_t rank = 0;
  uint32_t size = 0;
};

struct FrameHeader {
  uint32_t magic = kFrameMagic;
  uint32_t op = 0;
  uint64_t call = 0;
  uint64_t bytes = 0;
};

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      Reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  ~Fd() { Reset(); }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }

 private:
  void Reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  int fd_ = -1;
};

// Waits until `fd` is ready for `events` or `deadline` passes.
absl::Status WaitFor(int fd, short events, absl::Time deadline, const std::string& what) {
  while (true) {
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left_ms <= 0) return absl::DeadlineExceededError(what);
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left_ms, 1000)));
    if (n > 0) return absl::OkStatus();
    if (n < 0 && errno != EINTR) return absl::UnavailableError(absl::StrCat(what, ": poll: ", std::strerror(errno)));
  }
}

// Moves all `size` bytes with `io` (one send or recv, non-blocking),
// waiting for `events` between tries; fails at `deadline` saying `what`.
template <typename Io>
absl::Status MoveAll(int fd, short events, size_t size, absl::Time deadline, const std::string& what, Io io) {
  size_t done = 0;
  while (done < size) {
    if (absl::Status s = WaitFor(fd, events, deadline, what); !s.ok()) return s;
    const ssize_t n = io(done, size - done);
    if (n == 0 && events == POLLIN) return absl::UnavailableError(absl::StrCat(what, ": connection closed"));
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status SendAll(int fd, const void* data, size_t size, absl::Time deadline, const std::string& what) {
  const char* p = static_cast<const char*>(data);
  return MoveAll(fd, POLLOUT, size, deadline, what, [&](size_t at, size_t n) {
    return ::send(fd, p + at, n, MSG_NOSIGNAL | MSG_DONTWAIT);
  });
}

absl::Status RecvAll(int fd, void* data, size_t size, absl::Time deadline, const std::string& what) {
  char* p = static_cast<char*>(data);
  return MoveAll(fd, POLLIN, size, deadline, what, [&](size_t at, size_t n) { return ::recv(fd, p + at, n, MSG_DONTWAIT); });
}

void NoDelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

absl::StatusOr<std::pair<std::string, int>> SplitHostPort(const std::string& address) {
  absl::StatusOr<HostPort> parsed = ParseHostPort(address);
  if (!parsed.ok()) return parsed.status();
  return std::make_pair(parsed->host, parsed->port);
}

absl::StatusOr<sockaddr_storage> Resolve(const std::string& host, int port, socklen_t* length) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string service = absl::StrCat(port);
  if (const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat("cannot resolve ", host, ": ", ::gai_strerror(rc)));
  }
  sockaddr_storage out{};
  std::memcpy(&out, found->ai_addr, found->ai_addrlen);
  *length = found->ai_addrlen;
  ::freeaddrinfo(found);
  return out;
}

absl::StatusOr<Fd> Listen(const std::string& host, std::string* address) {
  socklen_t length = 0;
  absl::StatusOr<sockaddr_storage> addr = Resolve(host, 0, &length);
  if (!addr.ok()) return addr.status();
  Fd fd(::socket(addr->ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&*addr), length) != 0 || ::listen(fd.get(), 64) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", host, ": ", std::strerror(errno)));
  }
  sockaddr_storage bound{};
  socklen_t bound_length = sizeof(bound);
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &bound_length);
  const int port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                     : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  *address = host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port) : absl::StrCat(host, ":", port);
  return fd;
}

absl::StatusOr<Fd> Connect(const std::string& address, absl::Time deadline, const std::string& what) {
  absl::StatusOr<std::pair<std::string, int>> hp = SplitHostPort(address);
  if (!hp.ok()) return hp.status();
  std::string host = hp->first;
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  socklen_t length = 0;
  absl::StatusOr<sockaddr_storage> addr = Resolve(host, hp->second, &length);
  if (!addr.ok()) return addr.status();
  while (true) {
    Fd fd(::socket(addr->ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd.valid()) return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&*addr), length) == 0) {
      NoDelay(fd.get());
      return fd;
    }
    const int error = errno;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(what, ": cannot connect to ", address, ": ",
                                                      std::strerror(error)));
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
}

class SocketGroupMember final : public GroupCollective {
 public:
  SocketGroupMember(int rank, std::vector<std::string> addresses, std::vector<Fd> peers, absl::Duration timeout,
                    const LinkSpec& fabric)
      : rank_(rank),
        addresses_(std::move(addresses)),
        peers_(std::move(peers)),
        timeout_(timeout),
        fabric_(fabric),
        outgoing_(LinkBucket::InProcess()) {}

  int size() const override { return static_cast<int>(addresses_.size()); }
  int rank() const override { return rank_; }

  absl::Status AllGather(std::span<float> buffer, const GroupOwnership& owned) override {
    if (absl::Status s = Check(buffer, owned); !s.ok()) return s;
    const std::vector<float> mine = Pack(buffer, owned[rank_]);
    std::vector<std::vector<float>> received;
    if (absl::Status s = Transfer(Op::kAllGather, [&](int) -> const std::vector<float>& { return mine; },
                                  [&](int peer) { return RangeElements(owned[peer]); }, &received);
        !s.ok()) {
      return s;
    }
    for (int m = 0; m < size(); ++m) {
      if (m != rank_) UnpackRanges(received[m].data(), owned[m], buffer);
    }
    return absl::OkStatus();
  }

  absl::Status ReduceScatter(std::span<float> buffer, const GroupOwnership& owned) override {
    if (absl::Status s = Check(buffer, owned); !s.ok()) return s;
    std::vector<std::vector<float>> outgoing(size());
    for (int m = 0; m < size(); ++m) {
      if (m != rank_) outgoing[m] = Pack(buffer, owned[m]);
    }
    std::vector<std::vector<float>> received;
    const int64_t mine = RangeElements(owned[rank_]);
    if (absl::Status s = Transfer(Op::kReduceScatter,
                                  [&](int peer) -> const std::vector<float>& { return outgoing[peer]; },
                                  [&](int) { return mine; }, &received);
        !s.ok()) {
      return s;
    }
    received[rank_] = Pack(buffer, owned[rank_]);
    // Range by range, the members' parts summed in member order.
    int64_t at = 0;
    for (const ElementRange& r : owned[rank_]) {
      std::vector<std::vector<float>> parts;
      for (int m = 0; m < size(); ++m) {
        parts.emplace_back(received[m].begin() + at, received[m].begin() + at + r.length);
      }
      const std::vector<float> sum = TreeSum(std::move(parts));
      std::memcpy(buffer.data() + r.begin, sum.data(), sum.size() * sizeof(float));
      at += r.length;
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<std::vector<float>>> Exchange(const std::vector<std::vector<float>>& outgoing,
                                                           const std::vector<int64_t>& expected) override {
    if (static_cast<int>(outgoing.size()) != size() || static_cast<int>(expected.size()) != size()) {
      return absl::InvalidArgumentError(absl::StrCat("fabric group exchange: parts for ", outgoing.size(),
                                                     " members and sizes for ", expected.size(), "; the group has ",
                                                     size()));
    }
    std::vector<std::vector<float>> received;
    if (absl::Status s = Transfer(Op::kExchange, [&](int peer) -> const std::vector<float>& { return outgoing[peer]; },
                                  [&](int peer) { return expected[peer]; }, &received);
        !s.ok()) {
      return s;
    }
    return received;
  }

 private:
  static std::vector<float> Pack(std::span<const float> buffer, const std::vector<ElementRange>& ranges) {
    std::vector<float> out(RangeElements(ranges));
    PackRanges(buffer, ranges, out.data());
    return out;
  }

  std::string Peer(int m) const { return absl::StrCat("member ", m, " (", addresses_[m], ")"); }

  // Sends outgoing(peer) to every peer (each on its own thread) while
  // receiving expected(peer) floats from each, in member order.
  template <typename Outgoing, typename Expected>
  absl::Status Transfer(Op op, Outgoing outgoing, Expected expected, std::vector<std::vector<float>>* received) {
    const uint64_t call = calls_++;
    const absl::Time deadline = absl::Now() + timeout_;
    const std::string context = absl::StrCat("fabric group ", OpName(op), " (call ", call, ", member ", rank_, ")");
    received->assign(size(), {});
    std::vector<absl::Status> sent(size());
    std::vector<std::thread> senders;
    for (int m = 0; m < size(); ++m) {
      if (m == rank_) continue;
      senders.emplace_back([&, m] {
        const std::vector<float>& data = outgoing(m);
        FrameHeader header{kFrameMagic, static_cast<uint32_t>(op), call, data.size() * sizeof(float)};
        const std::string what = absl::StrCat(context, ": sending to ", Peer(m));
        HoldForFabric(sizeof(header) + header.bytes);
        sent[m] = SendAll(peers_[m].get(), &header, sizeof(header), deadline, what);
        if (sent[m].ok()) sent[m] = SendAll(peers_[m].get(), data.data(), header.bytes, deadline, what);
      });
    }
    absl::Status status;
    for (int m = 0; m < size() && status.ok(); ++m) {
      if (m == rank_) continue;
      const std::string what = absl::StrCat(context, ": waiting for ", Peer(m));
      FrameHeader header;
      status = RecvAll(peers_[m].get(), &header, sizeof(header), deadline, what);
      if (!status.ok()) break;
      const uint64_t want = static_cast<uint64_t>(expected(m)) * sizeof(float);
      if (header.magic != kFrameMagic || header.op != static_cast<uint32_t>(op) || header.call != call ||
          header.bytes != want) {
        status = absl::InternalError(absl::StrCat(context, ": ", Peer(m), " sent call ", header.call, " op ",
                                                  header.op, " of ", header.bytes, " bytes; expected call ", call,
                                                  " op ", static_cast<uint32_t>(op), " of ", want,
                                                  " bytes (the members' collectives are out of step)"));
        break;
      }
      (*received)[m].resize(expected(m));
      status = RecvAll(peers_[m].get(), (*received)[m].data(), header.bytes, deadline, what);
    }
    if (!status.ok()) {
      // Unblock the senders: this group cannot be used any more.
      for (int m = 0; m < size(); ++m) {
        if (m != rank_) ::shutdown(peers_[m].get(), SHUT_RDWR);
      }
    }
    for (std::thread& t : senders) t.join();
    if (!status.ok()) return status;
    for (const absl::Status& s : sent) {
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }

  // On an emulated fabric: waits until a message of `bytes` handed over
  // now has passed this member's outgoing interface (behind the messages
  // before it) and then one latency, so that it arrives when the fabric
  // would have delivered it.
  void HoldForFabric(uint64_t bytes) {
    if (!fabric_.enabled()) return;
    const absl::Duration transmission = fabric_.bytes_per_second > 0
                                            ? absl::Seconds(static_cast<double>(bytes) / fabric_.bytes_per_second)
                                            : absl::ZeroDuration();
    const absl::Time passed = outgoing_->Pass(absl::Now(), transmission);
    absl::SleepFor(passed + fabric_.latency - absl::Now());
  }

  absl::Status Check(std::span<float> buffer, const GroupOwnership& owned) const {
    return CheckOwnership(static_cast<int64_t>(buffer.size()), owned, size());
  }

  const int rank_;
  const std::vector<std::string> addresses_;
  std::vector<Fd> peers_;  // [member]; invalid for this member
  const absl::Duration timeout_;
  const LinkSpec fabric_;
  const std::shared_ptr<LinkBucket> outgoing_;  // this member's interface, when the fabric is emulated
  uint64_t calls_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<GroupCollective>> JoinSocketGroup(const std::string& host, int rank, int size,
                                                                 const RendezvousFn& rendezvous,
                                                                 absl::Duration timeout, const LinkSpec& fabric) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("fabric group member ", rank, " of ", size, " is out of range"));
  }
  std::string address;
  absl::StatusOr<Fd> listener = Listen(host, &address);
  if (!listener.ok()) return listener.status();
  absl::StatusOr<std::vector<std::string>> addresses = rendezvous(address);
  if (!addresses.ok()) return addresses.status();
  if (static_cast<int>(addresses->size()) != size) {
    return absl::InternalError(
        absl::StrCat("fabric group rendezvous returned ", addresses->size(), " addresses for ", size, " members"));
  }
  const absl::Time deadline = absl::Now() + timeout;
  const std::string context = absl::StrCat("fabric group member ", rank, " of ", size);
  std::vector<Fd> peers(size);
  // Lower members are dialled; higher ones dial in.
  for (int m = 0; m < rank; ++m) {
    absl::StatusOr<Fd> fd = Connect((*addresses)[m], deadline, absl::StrCat(context, ": member ", m));
    if (!fd.ok()) return fd.status();
    const Hello hello{kHelloMagic, static_cast<uint32_t>(rank), static_cast<uint32_t>(size)};
    if (absl::Status s = SendAll(fd->get(), &hello, sizeof(hello), deadline,
                                 absl::StrCat(context, ": greeting member ", m, " (", (*addresses)[m], ")"));
        !s.ok()) {
      return s;
    }
    peers[m] = std::move(*fd);
  }
  for (int accepted = 0; accepted < size - 1 - rank; ++accepted) {
    std::vector<int> waiting;
    for (int m = rank + 1; m < size; ++m) {
      if (!peers[m].valid()) waiting.push_back(m);
    }
    const std::string what = absl::StrCat(context, ": waiting for member(s) ", absl::StrJoin(waiting, ","),
                                          " to connect to ", address);
    if (absl::Status s = WaitFor(listener->get(), POLLIN, deadline, what); !s.ok()) return s;
    Fd fd(::accept4(listener->get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!fd.valid()) return absl::UnavailableError(absl::StrCat(what, ": accept: ", std::strerror(errno)));
    NoDelay(fd.get());
    Hello hello;
    if (absl::Status s = RecvAll(fd.get(), &hello, sizeof(hello), deadline, what); !s.ok()) return s;
    if (hello.magic != kHelloMagic || hello.size != static_cast<uint32_t>(size) ||
        hello.rank <= static_cast<uint32_t>(rank) || hello.rank >= static_cast<uint32_t>(size) ||
        peers[hello.rank].valid()) {
      return absl::FailedPreconditionError(absl::StrCat(context, ": a connection to ", address,
                                                        " introduced itself as member ", hello.rank, " of ",
                                                        hello.size, ", which does not fit this group"));
    }
    peers[hello.rank] = std::move(fd);
  }
  return std::make_unique<SocketGroupMember>(rank, std::move(*addresses), std::move(peers), timeout, fabric);
}

}  // namespace pshard
