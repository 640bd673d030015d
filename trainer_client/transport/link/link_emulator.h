// In-process emulation of slow links, the way a cloud VM's network is slow:
// each node has one network interface per direction, a token bucket that
// every connection of the node shares (or, as an option, one per
// connection), and each message pays a one-way latency (and jitter) on top.
//
// The emulation wraps any transport (gRPC or UCX) at message granularity: a
// fetch's request reaches the server one latency after it is issued, the
// slice's bytes pass the server node's outgoing bucket and the trainer
// node's incoming bucket, and the slice is delivered one latency after the
// slower of the two has passed it; a push's bytes pass the trainer's
// outgoing and the server's incoming bucket before the server sees them,
// and its answer comes back a latency later. Buckets of nodes that other
// processes share (the servers', a node of a trainer and a server) live in
// small files mapped by every process of the job (LinkBucket::Shared).
#ifndef PSHARD_TRAINER_CLIENT_TRANSPORT_LINK_LINK_EMULATOR_H_
#define PSHARD_TRAINER_CLIENT_TRANSPORT_LINK_LINK_EMULATOR_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/deadline_timer.h"
#include "trainer_client/transport/transport.h"

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

/// One direction of one interface: the moment its last admitted byte has
/// passed. Thread-safe, and process-safe for shared buckets (a lock-free
/// 64-bit word in a mapped file).
class LinkBucket {
 public:
  /// A bucket of this process only.
  static std::shared_ptr<LinkBucket> InProcess();
  /// Slot `slot` (0 or 1) of the bucket file `path`, created if missing;
  /// every process that maps the same file and slot shares the bucket.
  static absl::StatusOr<std::shared_ptr<LinkBucket>> Shared(const std::string& path, int slot);
  ~LinkBucket();
  LinkBucket(const LinkBucket&) = delete;
  LinkBucket& operator=(const LinkBucket&) = delete;

  /// Admits a message that needs `transmission` of the interface, handed
  /// over at `ready`: it starts when the bucket is free (or at `ready`) and
  /// the returned time is when its last byte has passed.
  absl::Time Pass(absl::Time ready, absl::Duration transmission);

 private:
  LinkBucket(std::atomic<int64_t>* free_at, void* mapping, size_t mapping_bytes)
      : free_at_(free_at), mapping_(mapping), mapping_bytes_(mapping_bytes) {}
  std::atomic<int64_t> own_{0};  // free_at_ of an in-process bucket
  std::atomic<int64_t>* free_at_;  // nanoseconds since the Unix epoch
  void* const mapping_;
  const size_t mapping_bytes_;
};

/// The buckets one trainer-server connection passes, per direction. Empty
/// lists: that direction is unshaped apart from the latency.
struct LinkPath {
  std::vector<std::shared_ptr<LinkBucket>> down;  ///< server -> trainer
  std::vector<std::shared_ptr<LinkBucket>> up;    ///< trainer -> server
};

/// A transport over an emulated link: same results as `inner`, delivered
/// when the link would have delivered them. Thread-safe.
class EmulatedTransport final : public Transport {
 public:
  /// `timer` (not owned) delivers the delays and outlives the transport's
  /// transfers.
  EmulatedTransport(std::unique_ptr<Transport> inner, LinkSpec spec, LinkPath path, DeadlineTimer* timer,
                    uint64_t seed);

  std::string name() const override { return inner_->name(); }
  std::string description() const override { return inner_->description(); }
  void Fetch(const FetchArgs& args, float* dest, TransferDone done) override;
  void Push(const PushArgs& args, std::shared_ptr<const std::vector<float>> grads, TransferDone done) override;

 private:
  // When `bytes` handed over at `ready` have passed every bucket of `path`,
  // plus the latency and this message's jitter.
  absl::Time Arrival(const std::vector<std::shared_ptr<LinkBucket>>& path, absl::Time ready, int64_t bytes);
  // Runs `f` at `when` (now if it has passed).
  void At(absl::Time when, std::function<void()> f);

  const std::unique_ptr<Transport> inner_;
  const LinkSpec spec_;
  const LinkPath path_;
  DeadlineTimer* const timer_;
  const uint64_t seed_;
  std::atomic<uint64_t> messages_{0};
};

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_TRANSPORT_LINK_LINK_EMULATOR_H_
