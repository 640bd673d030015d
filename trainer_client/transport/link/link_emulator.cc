#include "trainer_client/transport/link/link_emulator.h"

#include <algorithm>
#include <cctype>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/link_rate.h"
#include "common/rng.h"

namespace pshard {
namespace {

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
  absl::StatusOr<double> r = ParseLinkRate(rate);
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
