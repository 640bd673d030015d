// Real shaped links for `pshard local --link_mode=kernel`: each trainer runs
// in its own network namespace, joined to the host's by a veth pair whose
// two ends the kernel's token-bucket filter (tc tbf) shapes to the link
// rate, one per direction: the trainer's network interface, as the
// in-process emulation models it. Needs root (CAP_NET_ADMIN), `ip` and `tc`
// (iproute2). Rate only: Debian's tc has no netem, so there is no delay.
#ifndef PSHARD_TOOLS_KERNEL_LINKS_H_
#define PSHARD_TOOLS_KERNEL_LINKS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pshard {

class KernelLinks {
 public:
  /// Makes one namespace and shaped veth pair per trainer (`rate` in tc's
  /// units, e.g. "20mbit"). Names carry this process's id, so that two
  /// local clusters do not meet. FailedPrecondition when the host cannot
  /// (not root, no iproute2); nothing is left behind on failure. The
  /// commands' output goes to `log`.
  static absl::StatusOr<std::unique_ptr<KernelLinks>> Create(int trainers, const std::string& rate,
                                                             const std::string& log);
  /// Deletes the namespaces (and with them the veth pairs).
  ~KernelLinks();

  /// The namespace trainer `rank` runs in.
  const std::string& TrainerNamespace(int rank) const { return namespaces_[rank]; }
  /// The command line that runs a program in it: `ip netns exec NAME`.
  std::vector<std::string> ExecIn(int rank) const;
  /// The host's address as trainer `rank` reaches it over its link.
  std::string HostAddressFor(int rank) const;
  /// What was set up, in words.
  std::string ToString() const;

 private:
  KernelLinks(std::string rate, std::string log, std::string ip)
      : rate_(std::move(rate)), log_(std::move(log)), ip_(std::move(ip)) {}
  std::string rate_;
  std::string log_;
  std::string ip_;  // the ip executable
  std::vector<std::string> namespaces_;
};

}  // namespace pshard

#endif  // PSHARD_TOOLS_KERNEL_LINKS_H_
