#include "common/link_rate.h"

#include <cctype>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace pshard {

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
  struct Unit {
    const char* name;
    double bytes_per_second;
  };
  static constexpr Unit kUnits[] = {{"bit", 1.0 / 8}, {"kbit", 1e3 / 8}, {"mbit", 1e6 / 8}, {"gbit", 1e9 / 8},
                                    {"bps", 1.0},     {"kbps", 1e3},     {"mbps", 1e6},     {"gbps", 1e9}};
  for (const Unit& u : kUnits) {
    if (unit == u.name) return value * u.bytes_per_second;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "link rate '", raw, "': unknown unit '", unit, "' (use bit, kbit, mbit, gbit, or bps, kbps, mbps, gbps)"));
}

}  // namespace pshard
