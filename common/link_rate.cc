#include "common/link_rate.h"

#include <cctype>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pshard {

namespace {

struct Unit {
  const char* name;
  double bytes_per_second;
};
constexpr Unit kUnits[] = {{"bit", 1.0 / 8}, {"kbit", 1e3 / 8}, {"mbit", 1e6 / 8}, {"gbit", 1e9 / 8},
                           {"bps", 1.0},     {"kbps", 1e3},     {"mbps", 1e6},     {"gbps", 1e9}};

// "12.5 M" style: the value scaled to k, M or G.
std::string Scaled(double value, const char* unit) {
  const char* prefix = "";
  if (value >= 1e9) {
    value /= 1e9;
    prefix = "G";
  } else if (value >= 1e6) {
    value /= 1e6;
    prefix = "M";
  } else if (value >= 1e3) {
    value /= 1e3;
    prefix = "k";
  }
  return absl::StrFormat("%.4g %s%s", value, prefix, unit);
}

}  // namespace

absl::StatusOr<double> ParseLinkRate(const std::string& raw) {
  const std::string text = absl::AsciiStrToLower(absl::StripAsciiWhitespace(raw));
  if (text.empty() || text == "0") return 0.0;
  size_t split = 0;
  while (split < text.size() && (std::isdigit(static_cast<unsigned char>(text[split])) || text[split] == '.')) {
    ++split;
  }
  double value = 0.0;
  if (split == 0 || !absl::SimpleAtod(text.substr(0, split), &value) || value < 0) {
    return absl::InvalidArgumentError(absl::StrCat("link rate '", raw, "' is not a number with a unit"));
  }
  const std::string unit = text.substr(split);
  for (const Unit& u : kUnits) {
    if (unit == u.name) return value * u.bytes_per_second;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "link rate '", raw, "': unknown unit '", unit, "' (use bit, kbit, mbit, gbit, or bps, kbps, mbps, gbps)"));
}

absl::StatusOr<std::string> DescribeLinkRate(const std::string& raw) {
  absl::StatusOr<double> bytes_per_second = ParseLinkRate(raw);
  if (!bytes_per_second.ok()) return bytes_per_second.status();
  if (*bytes_per_second == 0.0) return std::string("no limit");
  const std::string text = absl::AsciiStrToLower(absl::StripAsciiWhitespace(raw));
  const bool in_bytes = absl::EndsWith(text, "bps");
  std::string out = absl::StrCat(absl::StripAsciiWhitespace(raw), " = ", Scaled(*bytes_per_second * 8, "bit/s"),
                                 " = ", Scaled(*bytes_per_second, "B/s"));
  if (in_bytes) {
    const std::string digits = text.substr(0, text.size() - 3);
    absl::StrAppend(&out, " (note: \"bps\" units count bytes per second, as tc's do: 8x ", digits,
                    "bit; for bits per second write ", digits, "bit)");
  }
  return out;
}

int64_t EthernetBytes(int64_t payload) {
  constexpr int64_t kSegment = 1448, kFrameOverhead = 66;
  if (payload <= 0) return 0;
  return payload + kFrameOverhead * ((payload + kSegment - 1) / kSegment);
}

}  // namespace pshard
