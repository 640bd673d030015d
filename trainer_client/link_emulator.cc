#include "trainer_client/link_emulator.h"

#include <algorithm>
#include <cctype>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/rng.h"

namespace pshard {
namespace {

absl::StatusOr<double> ParseRate(const std::string& text) {
  if (text.empty() || text == "0") return 0.0;
  size_t split = 0;
  while (split < text.size() && (std::isdigit(static_cast<unsigned char>(text[split])) || text[split] == '.')) {
    ++split;
  }
  double value = 0.0;
  if (split == 0 || !absl::SimpleAtod(text.substr(0, split), &value) || value < 0) {
    return absl::InvalidArgumentError(absl::StrCat("link rate '", text, "' is not a number with a unit"));
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
      "link rate '", text, "': unknown unit '", unit, "' (use bit, kbit, mbit, gbit, or bps, kbps, mbps, gbps)"));
}

absl::StatusOr<absl::Duration> ParseDelay(const std::string& what, const std::string& text) {
  if (text.empty() || text == "0") return absl::ZeroDuration();
  absl::Duration d;
  if (!absl::ParseDuration(text, &d) || d < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("link ", what, " '", text, "' is not a duration such as 10ms"));
  }
  return d;
}

}  // namespace

absl::StatusOr<LinkSpec> LinkSpec::Parse(const std::string& rate, const std::string& latency,
                                         const std::string& jitter) {
  LinkSpec spec;
  absl::StatusOr<double> r = ParseRate(rate);
  if (!r.ok()) return r.status();
  spec.bytes_per_second = *r;
  absl::StatusOr<absl::Duration> l = ParseDelay("delay", latency);
  if (!l.ok()) return l.status();
  spec.latency = *l;
  absl::StatusOr<absl::Duration> j = ParseDelay("jitter", jitter);
  if (!j.ok()) return j.status();
  spec.jitter = *j;
  return spec;
}

std::string LinkSpec::ToString() const {
  if (!enabled()) return "unshaped";
  const std::string rate =
      bytes_per_second > 0 ? absl::StrFormat("%.1f Mbit/s", bytes_per_second * 8 / 1e6) : std::string("unlimited");
  return absl::StrCat(rate, ", ", absl::FormatDuration(latency), " latency, ", absl::FormatDuration(jitter),
                      " jitter");
}

absl::Time EmulatedLink::Admit(int64_t bytes, absl::Time not_before) {
  const absl::Time now = absl::Now();
  if (!spec_.enabled()) return now;
  absl::MutexLock lock(&mu_);
  absl::Time start = std::max({now, not_before, free_at_});
  if (spec_.bytes_per_second > 0.0) {
    free_at_ = start + absl::Seconds(static_cast<double>(bytes) / spec_.bytes_per_second);
  } else {
    free_at_ = start;
  }
  absl::Duration jitter;
  if (spec_.jitter > absl::ZeroDuration()) jitter = spec_.jitter * UniformAt(seed_, 0, messages_++);
  return free_at_ + spec_.latency + jitter;
}

}  // namespace pshard
