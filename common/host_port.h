// "host:port" addresses as the command lines, the environment and the port
// files give them, checked in one place.
#ifndef PSHARD_COMMON_HOST_PORT_H_
#define PSHARD_COMMON_HOST_PORT_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pshard {

struct HostPort {
  std::string host;  // as given, IPv6 without its brackets
  int port = 0;
};

/// Parses "host:port" or "[v6]:port": a non-empty host and a port of decimal
/// digits in [min_port, 65535]. The error quotes the address and says what a
/// valid one is.
absl::StatusOr<HostPort> ParseHostPort(absl::string_view address, int min_port = 1);

/// A comma-separated list of addresses ("a:1,b:2"), each checked as
/// ParseHostPort does; `what` names the list in the error ("--servers").
/// An empty list is an error.
absl::StatusOr<std::vector<std::string>> ParseAddressList(absl::string_view list, absl::string_view what);

}  // namespace pshard

#endif  // PSHARD_COMMON_HOST_PORT_H_
