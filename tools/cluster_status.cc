#include "tools/cluster_status.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/host_port.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "proto/rpc_util.h"
#include "proto/shard.grpc.pb.h"

namespace pshard {
namespace {

absl::Status ErrnoError(absl::string_view call, const std::string& address, int err) {
  return absl::UnavailableError(absl::StrCat(call, " ", address, ": ", std::strerror(err)));
}

// Undoes the format's escapes (\\, \n, and \" in label values).
std::string Unescape(absl::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 1 < s.size()) {
      const char next = s[++i];
      out.push_back(next == 'n' ? '\n' : next);
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

// Parses `{k="v",...}` at the start of `*rest`, consuming it.
absl::Status ParseLabels(absl::string_view* rest, metrics::Labels* labels) {
  rest->remove_prefix(1);  // '{'
  while (true) {
    *rest = absl::StripLeadingAsciiWhitespace(*rest);
    if (absl::ConsumePrefix(rest, "}")) return absl::OkStatus();
    const size_t eq = rest->find('=');
    if (eq == absl::string_view::npos || eq + 1 >= rest->size() || (*rest)[eq + 1] != '"') {
      return absl::InvalidArgumentError("expected label=\"value\"");
    }
    const std::string key(absl::StripAsciiWhitespace(rest->substr(0, eq)));
    size_t end = eq + 2;
    while (end < rest->size() && (*rest)[end] != '"') end += (*rest)[end] == '\\' ? 2 : 1;
    if (end >= rest->size()) return absl::InvalidArgumentError("unterminated label value");
    (*labels)[key] = Unescape(rest->substr(eq + 2, end - eq - 2));
    rest->remove_prefix(end + 1);
    absl::ConsumePrefix(rest, ",");
  }
}

absl::Status ParseSampleLine(absl::string_view line, MetricsText::Sample* sample) {
  const size_t name_end = line.find_first_of("{ \t");
  if (name_end == 0 || name_end == absl::string_view::npos) return absl::InvalidArgumentError("expected a sample");
  sample->name = std::string(line.substr(0, name_end));
  absl::string_view rest = line.substr(name_end);
  if (rest.front() == '{') RETURN_IF_ERROR(ParseLabels(&rest, &sample->labels));
  std::vector<absl::string_view> fields = absl::StrSplit(rest, absl::ByAnyChar(" \t"), absl::SkipEmpty());
  if (fields.empty() || fields.size() > 2) return absl::InvalidArgumentError("expected a value (and a timestamp)");
  if (fields[0] == "+Inf" || fields[0] == "-Inf" || fields[0] == "NaN") {
    sample->value = fields[0] == "NaN" ? NAN : (fields[0][0] == '-' ? -INFINITY : INFINITY);
  } else if (!absl::SimpleAtod(fields[0], &sample->value)) {
    return absl::InvalidArgumentError(absl::StrCat("bad value '", fields[0], "'"));
  }
  return absl::OkStatus();
}

// A whole-exchange deadline as the milliseconds left for one poll().
int MillisLeft(absl::Time deadline) {
  return static_cast<int>(std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now())));
}

absl::Status WaitFor(int fd, short events, absl::Time deadline, const std::string& address, absl::string_view what) {
  pollfd p{fd, events, 0};
  while (true) {
    const int n = poll(&p, 1, MillisLeft(deadline));
    if (n > 0) return absl::OkStatus();
    if (n == 0) return absl::DeadlineExceededError(absl::StrCat(what, " ", address, ": timed out"));
    if (errno != EINTR) return ErrnoError("poll", address, errno);
  }
}

absl::StatusOr<int> Connect(const std::string& address, absl::Time deadline) {
  absl::StatusOr<HostPort> parsed = ParseHostPort(address);
  if (!parsed.ok()) return parsed.status();
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(parsed->host.c_str(), absl::StrCat(parsed->port).c_str(), &hints, &found); rc != 0) {
    return absl::UnavailableError(absl::StrCat("getaddrinfo ", address, ": ", gai_strerror(rc)));
  }
  const int fd = socket(found->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    freeaddrinfo(found);
    return ErrnoError("socket", address, errno);
  }
  const int rc = connect(fd, found->ai_addr, found->ai_addrlen);
  freeaddrinfo(found);
  absl::Status status;
  if (rc != 0 && errno != EINPROGRESS) {
    status = ErrnoError("connect", address, errno);
  } else if (rc != 0) {
    status = WaitFor(fd, POLLOUT, deadline, address, "connect");
    int err = 0;
    socklen_t len = sizeof(err);
    if (status.ok() && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err != 0) {
      status = ErrnoError("connect", address, err);
    }
  }
  if (!status.ok()) {
    close(fd);
    return status;
  }
  return fd;
}

absl::StatusOr<std::string> Exchange(int fd, const std::string& address, const std::string& request,
                                     absl::Time deadline) {
  for (size_t sent = 0; sent < request.size();) {
    RETURN_IF_ERROR(WaitFor(fd, POLLOUT, deadline, address, "send to"));
    const ssize_t n = send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno != EAGAIN && errno != EINTR) return ErrnoError("send", address, errno);
    if (n > 0) sent += static_cast<size_t>(n);
  }
  std::string response;
  char buf[16384];
  while (true) {
    RETURN_IF_ERROR(WaitFor(fd, POLLIN, deadline, address, "read from"));
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n == 0) return response;
    if (n < 0 && errno != EAGAIN && errno != EINTR) return ErrnoError("recv", address, errno);
    if (n > 0) response.append(buf, static_cast<size_t>(n));
  }
}

ShardServerStatus QueryServer(const std::string& address, absl::Duration timeout, const ClientSecurity* security) {
  ShardServerStatus s;
  s.address = address;
  auto stub = v1::ShardService::NewStub(security != nullptr
                                            ? security->NewChannel(address)
                                            : grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  v1::StatusResponse response;
  s.error = FromGrpcStatus(stub->GetStatus(&context, v1::StatusRequest(), &response));
  if (!s.error.ok()) return s;
  s.shard = response.shard_index();
  s.step = response.current_step();
  s.state_bytes = response.state_bytes();
  s.applied_updates = response.applied_updates();
  s.skipped_steps = response.skipped_steps();
  s.waiting_for = response.waiting_for();
  s.metrics_address = response.metrics_address();
  for (const v1::JoinedTrainer& t : response.joined_trainers()) s.joined_trainers[t.rank()] = t.metrics_address();
  s.shard_addresses.assign(response.shard_addresses().begin(), response.shard_addresses().end());
  s.coordinator_address = response.coordinator_address();
  return s;
}

// Runs fn(0..n-1) on one thread each and waits for all.
template <typename Fn>
void ForEachInParallel(size_t n, Fn fn) {
  std::vector<std::thread> threads;
  for (size_t i = 0; i < n; ++i) threads.emplace_back(fn, i);
  for (auto& t : threads) t.join();
}

// Table rows as aligned text: columns padded to their widest cell, two spaces apart.
std::string AlignedTable(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> widths;
  for (const auto& row : rows) {
    widths.resize(std::max(widths.size(), row.size()));
    for (size_t c = 0; c < row.size(); ++c) widths[c] = std::max(widths[c], row[c].size());
  }
  std::string out;
  for (const auto& row : rows) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c) {
      absl::StrAppend(&line, row[c], c + 1 < row.size() ? std::string(widths[c] - row[c].size() + 2, ' ') : "");
    }
    absl::StrAppend(&out, absl::StripTrailingAsciiWhitespace(line), "\n");
  }
  return out;
}

}  // namespace

absl::StatusOr<MetricsText> ParseMetricsText(absl::string_view text) {
  MetricsText page;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    if (line.front() == '#') {
      std::vector<absl::string_view> parts = absl::StrSplit(line, absl::MaxSplits(' ', 3));
      if (parts.size() >= 3 && (parts[1] == "HELP" || parts[1] == "TYPE")) {
        const std::string body = parts.size() == 4 ? std::string(parts[3]) : std::string();
        if (parts[1] == "HELP") {
          page.help[std::string(parts[2])] = Unescape(body);
        } else {
          page.type[std::string(parts[2])] = body;
        }
      }
      continue;
    }
    MetricsText::Sample sample;
    if (absl::Status s = ParseSampleLine(line, &sample); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("metrics line ", line_number, ": ", s.message(), ": ", line));
    }
    page.samples.push_back(std::move(sample));
  }
  return page;
}

absl::StatusOr<double> SampleValue(const MetricsText& page, absl::string_view name, const metrics::Labels& labels) {
  const MetricsText::Sample* match = nullptr;
  for (const MetricsText::Sample& s : page.samples) {
    if (s.name != name) continue;
    const bool has_all = std::all_of(labels.begin(), labels.end(), [&](const auto& kv) {
      auto it = s.labels.find(kv.first);
      return it != s.labels.end() && it->second == kv.second;
    });
    if (!has_all) continue;
    if (match != nullptr) {
      return absl::FailedPreconditionError(absl::StrCat("several samples of ", name, " match"));
    }
    match = &s;
  }
  if (match == nullptr) return absl::NotFoundError(absl::StrCat("no sample ", name));
  return match->value;
}

absl::StatusOr<std::string> HttpGet(const std::string& address, const std::string& path, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  ASSIGN_OR_RETURN(const int fd, Connect(address, deadline));
  absl::StatusOr<std::string> response = Exchange(
      fd, address, absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: ", address, "\r\nConnection: close\r\n\r\n"),
      deadline);
  close(fd);
  if (!response.ok()) return response.status();
  const size_t header_end = response->find("\r\n\r\n");
  const std::string status_line = response->substr(0, response->find("\r\n"));
  std::vector<absl::string_view> words = absl::StrSplit(status_line, absl::MaxSplits(' ', 2));
  if (header_end == std::string::npos || words.size() < 2 || !absl::StartsWith(words[0], "HTTP/")) {
    return absl::InternalError(absl::StrCat("GET http://", address, path, ": not an HTTP response"));
  }
  if (words[1] != "200") {
    return absl::UnavailableError(absl::StrCat("GET http://", address, path, ": ", status_line));
  }
  return response->substr(header_end + 4);
}

bool ClusterStatus::Healthy() const {
  return std::all_of(servers.begin(), servers.end(), [](const auto& s) { return s.error.ok(); }) &&
         std::all_of(trainers.begin(), trainers.end(), [](const auto& t) { return t.error.ok(); });
}

absl::Status ReadTrainerStatus(const MetricsText& page, TrainerStatus* status) {
  ASSIGN_OR_RETURN(const double step, SampleValue(page, "pshard_trainer_step"));
  ASSIGN_OR_RETURN(const double tokens, SampleValue(page, "pshard_trainer_tokens_total"));
  ASSIGN_OR_RETURN(const double wall, SampleValue(page, "pshard_trainer_step_seconds_sum"));
  ASSIGN_OR_RETURN(const double exposed,
                   SampleValue(page, "pshard_trainer_phase_seconds_total", {{"phase", "comm_exposed"}}));
  ASSIGN_OR_RETURN(status->loss, SampleValue(page, "pshard_trainer_loss"));
  ASSIGN_OR_RETURN(status->grad_norm, SampleValue(page, "pshard_trainer_grad_norm"));
  status->step = static_cast<int64_t>(step);
  status->tokens_per_second = wall > 0 ? tokens / wall : 0.0;
  status->comm_exposed_fraction = wall > 0 ? exposed / wall : 0.0;
  status->settings.clear();
  for (const MetricsText::Sample& sample : page.samples) {
    if (sample.name != "pshard_trainer_config_info") continue;
    std::vector<std::string> words;
    for (const auto& [key, value] : sample.labels) {
      if (key != "rank") words.push_back(absl::StrCat(key, "=", value));
    }
    status->settings = absl::StrJoin(words, " ");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> DiscoverShardAddresses(const std::string& address,
                                                                absl::Duration timeout,
                                                                const ClientSecurity* security) {
  ShardServerStatus first = QueryServer(address, timeout, security);
  RETURN_IF_ERROR(first.error);
  std::string coordinator = address;
  ShardServerStatus zero = std::move(first);
  if (zero.shard != 0) {
    coordinator = zero.coordinator_address;
    const int asked = zero.shard;
    zero = QueryServer(coordinator, timeout, security);
    if (!zero.error.ok()) {
      return absl::Status(zero.error.code(), absl::StrCat(address, " is shard ", asked, "; its shard 0 at ",
                                                          coordinator, " did not answer: ", zero.error.message()));
    }
  }
  std::vector<std::string> addresses = zero.shard_addresses;
  if (addresses.empty()) return absl::InternalError(absl::StrCat(coordinator, " (shard 0) lists no shards"));
  addresses[0] = coordinator;  // as reachable from here
  std::vector<int> unknown;
  for (size_t s = 0; s < addresses.size(); ++s) {
    if (addresses[s].empty()) unknown.push_back(static_cast<int>(s));
  }
  if (!unknown.empty()) {
    return absl::UnavailableError(absl::StrCat(
        "shard 0 (", coordinator, ") does not know where shard(s) ", absl::StrJoin(unknown, ", "),
        " serve yet (each tells it at start); give every address with --servers=host:port,..."));
  }
  return addresses;
}

ClusterStatus QueryClusterStatus(const std::vector<std::string>& servers, absl::Duration timeout,
                                 const ClientSecurity* security) {
  ClusterStatus status;
  status.servers.resize(servers.size());
  ForEachInParallel(servers.size(), [&](size_t i) { status.servers[i] = QueryServer(servers[i], timeout, security); });
  // Every trainer joins every server: the first endpoint a server knows wins.
  std::map<int, std::string> endpoints;
  for (const ShardServerStatus& s : status.servers) {
    for (const auto& [rank, address] : s.joined_trainers) {
      if (endpoints[rank].empty()) endpoints[rank] = address;
    }
  }
  for (const auto& [rank, address] : endpoints) {
    status.trainers.push_back(TrainerStatus{.rank = rank, .metrics_address = address});
  }
  ForEachInParallel(status.trainers.size(), [&](size_t i) {
    TrainerStatus& t = status.trainers[i];
    if (t.metrics_address.empty()) {
      t.error = absl::NotFoundError("the trainer reported no metrics endpoint");
      return;
    }
    absl::StatusOr<std::string> body = HttpGet(t.metrics_address, "/metrics", timeout);
    absl::StatusOr<MetricsText> page = body.ok() ? ParseMetricsText(*body) : body.status();
    t.error = page.ok() ? ReadTrainerStatus(*page, &t) : page.status();
  });
  return status;
}

std::string FormatClusterStatus(const ClusterStatus& status) {
  std::vector<std::vector<std::string>> servers = {
      {"shard", "address", "state", "step", "state MiB", "applied", "skipped", "metrics", "waiting for"}};
  for (const ShardServerStatus& s : status.servers) {
    if (!s.error.ok()) {
      servers.push_back({"?", s.address, "DOWN", "-", "-", "-", "-", "-", s.error.ToString()});
      continue;
    }
    servers.push_back({absl::StrCat(s.shard), s.address, "UP", absl::StrCat(s.step),
                       absl::StrFormat("%.1f", static_cast<double>(s.state_bytes) / 1048576.0),
                       absl::StrCat(s.applied_updates), absl::StrCat(s.skipped_steps),
                       s.metrics_address.empty() ? "-" : s.metrics_address, s.waiting_for});
  }
  std::string out = AlignedTable(servers);
  if (status.trainers.empty()) return absl::StrCat(out, "\nno trainer has joined a server that answered\n");
  std::vector<std::vector<std::string>> trainers = {
      {"rank", "state", "metrics", "step", "tok/s", "comm %", "loss", "grad norm", "error"}};
  for (const TrainerStatus& t : status.trainers) {
    const std::string metrics = t.metrics_address.empty() ? "-" : t.metrics_address;
    if (!t.error.ok()) {
      trainers.push_back({absl::StrCat(t.rank), "DOWN", metrics, "-", "-", "-", "-", "-", t.error.ToString()});
      continue;
    }
    trainers.push_back({absl::StrCat(t.rank), "UP", metrics, absl::StrCat(t.step),
                        absl::StrFormat("%.0f", t.tokens_per_second),
                        absl::StrFormat("%.1f", 100.0 * t.comm_exposed_fraction), absl::StrFormat("%.3f", t.loss),
                        absl::StrFormat("%.3f", t.grad_norm), ""});
  }
  absl::StrAppend(&out, "\n", AlignedTable(trainers));
  bool first = true;
  for (const TrainerStatus& t : status.trainers) {
    if (t.settings.empty()) continue;
    absl::StrAppend(&out, first ? "\n" : "", "trainer ", t.rank, " settings: ", t.settings, "\n");
    first = false;
  }
  return out;
}

}  // namespace pshard
