// In-process emulation of a slow link between a trainer and one shard
// server: bandwidth as a token bucket, one-way latency, and jitter. Used by
// the gRPC data path so that comm-bound settings are reproducible on one
// machine without root (loopback has no such limits).
#ifndef PSHARD_TRAINER_CLIENT_TRANSPORT_LINK_LINK_EMULATOR_H_
#define PSHARD_TRAINER_CLIENT_TRANSPORT_LINK_LINK_EMULATOR_H_

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pshard {

/// What a link looks like. The default is an ideal link (no emulation).
struct LinkSpec {
  double bytes_per_second = 0.0;  ///< 0: unlimited
  absl::Duration latency;         ///< one-way
  absl::Duration jitter;          ///< uniform in [0, jitter), added per message
  bool enabled() const { return bytes_per_second > 0.0 || latency > absl::ZeroDuration(); }

  /// Parses tc-style settings: rate "100mbit", "1gbit", "500kbit", "20mbps"
  /// (bytes), "0" or "" (unlimited); delays as durations ("10ms", "1.5ms").
  static absl::StatusOr<LinkSpec> Parse(const std::string& rate, const std::string& latency,
                                        const std::string& jitter);
  std::string ToString() const;
};

/// One direction of one emulated link. Messages share the bandwidth in the
/// order they are admitted. Thread-safe.
class EmulatedLink {
 public:
  EmulatedLink(const LinkSpec& spec, uint64_t seed) : spec_(spec), seed_(seed) {}

  /// Admits a message of `bytes` handed to the link now (or at `not_before`,
  /// whichever is later) and returns when it has fully arrived at the other
  /// end. Without emulation, returns now.
  absl::Time Admit(int64_t bytes, absl::Time not_before = absl::InfinitePast());

 private:
  const LinkSpec spec_;
  const uint64_t seed_;
  absl::Mutex mu_;
  absl::Time free_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  uint64_t messages_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_TRANSPORT_LINK_LINK_EMULATOR_H_
