#include "tools/kernel_links.h"

#include <unistd.h>

#include <signal.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/link_rate.h"
#include "common/status_macros.h"
#include "tools/process.h"

namespace pshard {
namespace {

// Runs a command of iproute2 to its end (10 s at most); its output goes
// to `log`.
absl::Status Run(const std::vector<std::string>& argv, const std::string& log) {
  ASSIGN_OR_RETURN(ChildProcess child, ChildProcess::Spawn(argv, log));
  const std::optional<int> code = child.WaitUntil(absl::Now() + absl::Seconds(10));
  if (!code) {
    child.Signal(SIGKILL);
    return absl::DeadlineExceededError(absl::StrCat("'", absl::StrJoin(argv, " "), "' did not finish within 10 s"));
  }
  if (*code != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("'", absl::StrJoin(argv, " "), "' failed with code ", *code,
                     " (the kernel link mode needs root and iproute2's ip and tc; see ", log, ")"));
  }
  return absl::OkStatus();
}

// Where iproute2's `name` is (posix_spawn does not search PATH).
absl::StatusOr<std::string> Which(const std::string& name) {
  for (const char* dir : {"/usr/sbin/", "/sbin/", "/usr/bin/", "/bin/"}) {
    const std::string path = dir + name;
    if (access(path.c_str(), X_OK) == 0) return path;
  }
  return absl::FailedPreconditionError(
      absl::StrCat("the kernel link mode needs iproute2's ", name, " (Debian package iproute2)"));
}

// Subnet 10.213.R.0/24 per trainer: the host's end is .1, the trainer's .2.
std::string Address(int rank, int host) { return absl::StrCat("10.213.", rank, ".", host); }

}  // namespace

absl::StatusOr<std::unique_ptr<KernelLinks>> KernelLinks::Create(int trainers, const std::string& rate,
                                                                  const std::string& log) {
  if (trainers < 1 || trainers > 250) {
    return absl::InvalidArgumentError(absl::StrCat("the kernel link mode takes 1 to 250 trainers, not ", trainers));
  }
  ASSIGN_OR_RETURN(const double bytes_per_second, ParseLinkRate(rate));
  if (!(bytes_per_second > 0)) {
    return absl::InvalidArgumentError("the kernel link mode shapes a rate: give --link_rate");
  }
  ASSIGN_OR_RETURN(const std::string ip, Which("ip"));
  ASSIGN_OR_RETURN(const std::string tc, Which("tc"));
  std::unique_ptr<KernelLinks> links(new KernelLinks(rate, log, ip));
  // A bucket of about 4 ms of the rate (at least 16 KiB, tbf's usual
  // minimum for a 1500-byte MTU), queueing at most 100 ms before dropping.
  const int64_t burst = std::max<int64_t>(65536, static_cast<int64_t>(bytes_per_second * 0.010));
  for (int r = 0; r < trainers; ++r) {
    const std::string id = absl::StrCat(getpid(), "t", r);
    const std::string ns = absl::StrCat("pshard-", id);
    const std::string host_end = absl::StrCat("ps", id, "h"), trainer_end = absl::StrCat("ps", id, "n");
    RETURN_IF_ERROR(Run({ip, "netns", "add", ns}, log));
    links->namespaces_.push_back(ns);  // deleted by the destructor from here on
    for (const std::vector<std::string>& command : std::vector<std::vector<std::string>>{
             {ip, "link", "add", host_end, "type", "veth", "peer", "name", trainer_end, "netns", ns},
             {ip, "addr", "add", Address(r, 1) + "/24", "dev", host_end},
             {ip, "link", "set", host_end, "up"},
             {ip, "-n", ns, "addr", "add", Address(r, 2) + "/24", "dev", trainer_end},
             {ip, "-n", ns, "link", "set", trainer_end, "up"},
             {ip, "-n", ns, "link", "set", "lo", "up"},
             // Server -> trainer leaves the host's end; trainer -> server the trainer's.
             {tc, "qdisc", "add", "dev", host_end, "root", "tbf", "rate", rate, "burst", absl::StrCat(burst),
              "latency", "1s"},
             {ip, "netns", "exec", ns, tc, "qdisc", "add", "dev", trainer_end, "root", "tbf", "rate", rate,
              "burst", absl::StrCat(burst), "latency", "1s"},
         }) {
      RETURN_IF_ERROR(Run(command, log));
    }
  }
  return links;
}

KernelLinks::~KernelLinks() {
  for (const std::string& ns : namespaces_) {
    if (!Run({ip_, "netns", "del", ns}, log_).ok()) {
      std::fprintf(stderr, "pshard: could not delete network namespace %s (ip netns del %s)\n", ns.c_str(), ns.c_str());
    }
  }
}

std::string KernelLinks::HostAddressFor(int rank) const { return Address(rank, 1); }

std::vector<std::string> KernelLinks::ExecIn(int rank) const { return {ip_, "netns", "exec", namespaces_[rank]}; }

std::string KernelLinks::ToString() const {
  return absl::StrCat(namespaces_.size(), " trainer namespaces, each behind a veth pair shaped to ", rate_,
                      " per direction by tc tbf (10.213.R.2 -> host 10.213.R.1)");
}

}  // namespace pshard
