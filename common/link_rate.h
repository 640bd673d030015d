// Link rates written the way tc writes them: "100mbit", "1gbit", "500kbit",
// "20mbps" (bytes), "0" or "" for no limit.
#ifndef PSHARD_COMMON_LINK_RATE_H_
#define PSHARD_COMMON_LINK_RATE_H_

#include <string>

#include "absl/status/statusor.h"

namespace pshard {

/// Bytes per second (0: unlimited); units are case-insensitive.
absl::StatusOr<double> ParseLinkRate(const std::string& text);

}  // namespace pshard

#endif  // PSHARD_COMMON_LINK_RATE_H_
