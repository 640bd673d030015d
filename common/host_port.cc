#include "common/host_port.h"

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace pshard {

absl::StatusOr<HostPort> ParseHostPort(absl::string_view address, int min_port) {
  auto invalid = [&] {
    return absl::InvalidArgumentError(absl::StrCat("\"", address, "\" is not host:port (a host name, IPv4 or [IPv6] ",
                                                   "address; a port in ", min_port, "..65535)"));
  };
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos || colon == 0) return invalid();
  const absl::string_view digits = address.substr(colon + 1);
  int port = 0;
  // At most 5 digits, so that SimpleAtoi cannot wrap and "0065535" is not a port.
  if (digits.empty() || digits.size() > 5 || !absl::c_all_of(digits, absl::ascii_isdigit) ||
      !absl::SimpleAtoi(digits, &port) || port < min_port || port > 65535) {
    return invalid();
  }
  absl::string_view host = address.substr(0, colon);
  if (host.front() == '[') {
    if (host.size() < 3 || host.back() != ']') return invalid();
    host = host.substr(1, host.size() - 2);
  } else if (host.find(':') != absl::string_view::npos) {
    return invalid();  // an IPv6 address needs its brackets
  }
  return HostPort{std::string(host), port};
}

absl::StatusOr<std::vector<std::string>> ParseAddressList(absl::string_view list, absl::string_view what) {
  std::vector<std::string> addresses = absl::StrSplit(list, ',', absl::SkipWhitespace());
  if (addresses.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is empty; give host:port[,host:port...]"));
  }
  for (std::string& address : addresses) {
    address = std::string(absl::StripAsciiWhitespace(address));
    if (absl::Status s = ParseHostPort(address).status(); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", s.message()));
    }
  }
  return addresses;
}

}  // namespace pshard
