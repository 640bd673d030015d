// Link rates written the way tc writes them: "100mbit", "1gbit", "500kbit",
// "20mbps" (bytes), "0" or "" for no limit.
#ifndef PSHARD_COMMON_LINK_RATE_H_
#define PSHARD_COMMON_LINK_RATE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace pshard {

/// Bytes per second (0: unlimited); units are case-insensitive.
absl::StatusOr<double> ParseLinkRate(const std::string& text);

/// How a rate that ParseLinkRate accepts is read, in bits and in bytes per
/// second: "100mbit = 100 Mbit/s = 12.5 MB/s". A rate given in a bytes unit
/// (tc's "bps" family) adds a warning that it is 8x what the same digits in
/// bits would be. "no limit" for 0 or "".
absl::StatusOr<std::string> DescribeLinkRate(const std::string& text);

/// What `payload` bytes of a TCP stream occupy on an Ethernet link with a
/// 1500-byte MTU: each segment of up to 1448 bytes (1500 less the IPv4 and
/// TCP headers with timestamps) travels in a frame of 66 bytes more
/// (Ethernet 14, IPv4 20, TCP 32). A link's rate counts frames, so a
/// 100 Mbit/s interface carries about 95.6 Mbit/s of payload.
int64_t EthernetBytes(int64_t payload);

}  // namespace pshard

#endif  // PSHARD_COMMON_LINK_RATE_H_
