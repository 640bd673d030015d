// A trainer's connection to every shard server of a job: join over gRPC (the
// control plane), then move data over each link's transport (gRPC or UCX):
// fetch a whole unit (its N slices concurrently, into one buffer), push a
// unit's gradient (its N slices concurrently, each to its owner).
#ifndef PSHARD_TRAINER_CLIENT_SHARD_CLIENT_H_
#define PSHARD_TRAINER_CLIENT_SHARD_CLIENT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/deadline_timer.h"
#include "common/job_config.h"
#include "common/wire_encoding.h"
#include "common/security/security.h"
#include "trainer_client/transport/link/link_emulator.h"
#include "trainer_client/transport/transport.h"

namespace pshard {

class UcxContext;  // trainer_client/transport/ucx/ucx_transport.h, in builds with UCX

/// Recycles unit-sized buffers so that fetching a unit, or computing and
/// pushing its gradient, does not allocate and page-fault a fresh buffer
/// every time (and that the kernel reads pushed gradients from pages it
/// has seen: on some VMs its first read of each page through a socket
/// costs more than the copy). Thread-safe.
class BufferPool {
 public:
  explicit BufferPool(size_t max_free) : max_free_(max_free) {}
  /// A buffer of exactly `n` elements; contents unspecified.
  std::vector<float> Take(size_t n);
  void Give(std::vector<float> buffer);

 private:
  const size_t max_free_;
  absl::Mutex mu_;
  std::vector<std::vector<float>> free_ ABSL_GUARDED_BY(mu_);
};

/// One asynchronous unit transfer (a fetch or a push across all shards).
/// The first part that fails cancels the others, so that the transfer ends
/// with that failure at once instead of when the slowest part gives up.
/// Thread-safe; Wait() may be called from any thread, more than once.
class UnitTransfer {
 public:
  /// `pool`, if given, gets values() back when the transfer is destroyed.
  UnitTransfer(int parts, std::shared_ptr<BufferPool> pool = nullptr);
  ~UnitTransfer();
  /// Blocks until every shard's part is done; the first error, if any.
  absl::Status Wait();
  /// Ends the parts still in flight (with Cancelled, unless another error
  /// came first).
  void Cancel() { cancel_->Cancel(); }
  /// What the transports register their parts' cancellation with.
  const std::shared_ptr<CancelScope>& cancel_scope() const { return cancel_; }
  bool done() const;
  /// The unit's elements (fetch only): padded length, valid after Wait().
  std::vector<float>& values() { return values_; }
  /// When the transfer started and finished (finish valid after Wait()).
  absl::Time started() const { return started_; }
  absl::Time finished() const;
  int64_t wire_bytes() const;
  /// The encoded elements (and block scales) of the parts that succeeded,
  /// without framing: what docs/levers.md's formulas count.
  int64_t payload_bytes() const;

  // Called by the per-shard reactors: a part moved `wire_bytes`, of which
  // `payload_bytes` are its slice's encoding (counted only if it succeeded).
  void PartDone(absl::Status status, int64_t wire_bytes, int64_t payload_bytes = 0);

 private:
  friend class ShardClient;
  mutable absl::Mutex mu_;
  int remaining_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  int64_t wire_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t payload_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time finished_ ABSL_GUARDED_BY(mu_);
  const absl::Time started_;
  std::vector<float> values_;
  std::shared_ptr<BufferPool> pool_;
  const std::shared_ptr<CancelScope> cancel_ = std::make_shared<CancelScope>();
};

/// Whether a step that failed with `status` may succeed after the trainer
/// rejoins: a server went away or restarted (Unavailable, Cancelled, a
/// deadline), rolled back (Aborted, steps out of range), or a transfer was
/// damaged (DataLoss). A refusal of what the trainer is or asks for
/// (arguments, credentials, limits) is not.
bool IsRecoverableFailure(const absl::Status& status);

class ShardClient {
 public:
  struct Options {
    std::vector<std::string> server_addresses;  ///< all N servers, any order
    int trainer_rank = 0;                       ///< -1 for tools that only read
    /// Server address -> the session token it gave this trainer at its last
    /// join (sessions() of the client this one replaces): retired there.
    absl::flat_hash_map<std::string, uint64_t> previous_sessions;
    WireEncodings encodings;  ///< of fetched weights and of pushed gradients
    /// Quantized gradients (int8, int4): add each slice's quantization
    /// residual of the last push to the next gradient of the same slice.
    bool error_feedback = true;
    absl::Duration join_timeout = absl::Seconds(30);  ///< servers may still be starting
    /// A server name that does not resolve for this long ends the join.
    absl::Duration join_resolve_grace = absl::Minutes(1);
    /// While joining, a line every this often names the servers waited for
    /// and why; they go to `join_log` (empty: stderr).
    absl::Duration join_log_every = absl::Seconds(5);
    std::function<void(const std::string&)> join_log;
    absl::Duration rpc_timeout = absl::Seconds(120);  ///< deadline of each fetch or push
    int64_t chunk_bytes = 1 << 20;                   ///< push chunk size
    LinkSpec link;  ///< emulated link to every server (default: none)
    /// How the emulated link's rate is shared: "node" (one bucket per node
    /// and direction, shared by every connection of the node, as a VM's
    /// network interface is) or "connection" (each connection its own).
    std::string link_scope = "node";
    /// The folder of the job's bucket files, shared by its processes
    /// (LinkBucket::Shared). Empty: this trainer's buckets live in this
    /// process, and the servers' interfaces are not shaped.
    std::string link_dir;
    /// This trainer's node and each server's node by address (emulation
    /// only; a server on this trainer's node is reached unshaped). Default:
    /// "trainer-<rank>" and "server-<shard>", every process on its own node.
    std::string node;
    std::map<std::string, std::string> node_by_address;
    /// The emulated link to a server on this node (a topology's link with
    /// a rate or delay), in place of `link`: its own buckets, shared by the
    /// node pair's connections, one per direction.
    std::map<std::string, LinkSpec> link_to_node;
    std::string metrics_address;  ///< this trainer's /metrics endpoint, told to the servers
    /// Data path of each link: "grpc"; "ucx" (every server must offer UCX,
    /// this build must have it, and UCX must start, or Connect fails); or
    /// "auto": UCX to each server that offers it when this build has UCX,
    /// gRPC otherwise. If UCX cannot start here,
    /// "auto" warns once on stderr and uses gRPC for every link.
    std::string transport = "auto";
    /// Per-server overrides of `transport`, keyed by address (a route plan).
    std::map<std::string, std::string> transport_by_address;
    /// The credentials of every channel to the servers (null: plaintext,
    /// no token).
    std::shared_ptr<const ClientSecurity> security;
    /// A trainer rejoining after a fault: when the servers are at
    /// different steps (one restarted from its newest checkpoint), ask
    /// those ahead to roll back to the lowest step (the RollBack RPC), and
    /// join there. Without it, different steps fail the join.
    bool roll_back_to_common_step = false;
  };

  /// Joins every server, checks that they run the same job and together
  /// cover shards 0..N-1, and derives the layout.
  static absl::StatusOr<std::unique_ptr<ShardClient>> Connect(Options options);
  /// Cancels the transfers still in flight and waits for them to end.
  ~ShardClient();

  const JobConfig& job() const { return job_; }
  const JobLayout& layout() const { return layout_; }
  /// The step the servers were at when this client joined.
  int64_t joined_step() const { return joined_step_; }
  /// Server address -> the session token it gave at this join.
  absl::flat_hash_map<std::string, uint64_t> sessions() const;
  const Options& options() const { return options_; }
  /// The data path to `shard` ("grpc", "ucx"): its metrics label.
  std::string transport_name(int shard) const;
  /// What carries the link to `shard`, for logs (e.g. which UCX transports).
  std::string transport_description(int shard) const;
  /// Each shard's address in shard order.
  std::vector<std::string> shard_addresses() const;

  /// Starts fetching `unit` at `version` into one buffer of the unit's
  /// padded length, from every shard or only from `shards` (the rest of the
  /// buffer is then left for a fabric group to fill). The checksum of every
  /// slice is verified.
  std::shared_ptr<UnitTransfer> StartFetch(int unit, int64_t version,
                                           const std::optional<std::vector<int>>& shards = std::nullopt);

  /// What a push contributes, beyond its unit and step.
  struct PushOptions {
    int micro_batch = 0;          ///< which micro-batch (0 when accumulating on the trainer)
    int first_rank = -1;          ///< first trainer summed in (-1: this client's rank)
    int rank_count = 1;           ///< trainers summed in: first_rank .. first_rank + rank_count - 1 (a fabric group)
    std::optional<std::vector<int>> shards;  ///< shards to push to; unset: all
  };
  /// A buffer for `unit`'s gradient: its padded length, zeros, reused
  /// from an earlier fetch or push where one is free (StartPush gives the
  /// gradient back once every shard has it).
  std::vector<float> GradientBuffer(int unit);

  /// Starts pushing the gradient of `unit` for `step`: `grads` has the
  /// unit's padded length (padding zero); slice s goes to shard s. With
  /// quantized gradients and error feedback, each pushed slice first gets
  /// the residual its last push left (what quantization took off it), and
  /// leaves its own; a slice that is not finite leaves a zero residual.
  std::shared_ptr<UnitTransfer> StartPush(int unit, int64_t step, std::vector<float> grads,
                                          const PushOptions& push);
  std::shared_ptr<UnitTransfer> StartPush(int unit, int64_t step, std::vector<float> grads) {
    return StartPush(unit, step, std::move(grads), PushOptions());
  }

  /// Host memory the error-feedback residuals take (0 without them).
  int64_t residual_bytes() const;

  /// The error-feedback residual of `unit` (its padded length) for this
  /// trainer's part of the slices that other members of its fabric group
  /// push (ReduceScatterGradients): empty without error feedback or without
  /// quantized gradients. Those slices' elements are the caller's alone
  /// (StartPush touches the slices it pushes); valid as long as this client.
  std::span<float> GroupResidual(int unit);

  /// Reads a unit's fp32 master weights from every shard (unpadded).
  /// With `version`, waits (up to the RPC deadline) until the unit is
  /// published at that version and fails if a shard has moved past it.
  absl::StatusOr<std::vector<float>> ReadMasterUnit(int unit, std::optional<int64_t> version = std::nullopt);

  /// Meets the other members of `group` at shard 0 (the Rendezvous RPC):
  /// posts `payload` as `member` of `size` and returns every member's, in
  /// member order; waits at most `timeout`.
  absl::StatusOr<std::vector<std::string>> Rendezvous(const std::string& group, int member, int size,
                                                     const std::string& payload, absl::Duration timeout);

 private:
  struct Shard;
  explicit ShardClient(Options options);

  /// Picks and creates each shard's data path (after every join).
  absl::Status CreateTransports();
  std::string PreferredTransport(const std::string& address) const;
  /// Wraps shard `s`'s transport in the emulated link (when there is one)
  /// between this trainer's node and the server's.
  absl::Status EmulateLink(int s);
  /// Slot `slot` of the bucket file `name`: a node's (slot 0 what it
  /// sends, 1 what it receives) or a node pair's (slot 0 from the first
  /// name to the second). Without a shared folder, `local` buckets live in
  /// this process and the rest are null.
  absl::StatusOr<std::shared_ptr<LinkBucket>> Bucket(const std::string& name, int slot, bool local);
  std::string TrainerNode() const;

  Options options_;
  std::unique_ptr<UcxContext> ucx_;  // null without UCX links; outlives shards_
  JobConfig job_;
  JobLayout layout_;
  int64_t joined_step_ = 0;
  std::vector<std::unique_ptr<Shard>> shards_;  // indexed by shard index
  std::shared_ptr<BufferPool> pool_;
  // Error feedback: per unit, the residual of every slice (padded length;
  // empty until the unit's first quantized push).
  mutable absl::Mutex residual_mu_;
  std::vector<std::vector<float>> residuals_ ABSL_GUARDED_BY(residual_mu_);
  std::map<std::string, std::shared_ptr<LinkBucket>> buckets_;  // "name/slot"; while creating transports
  // Transfers started, to cancel and drain at destruction (ended ones are
  // dropped as new ones start).
  void Track(const std::shared_ptr<UnitTransfer>& transfer);
  absl::Mutex live_mu_;
  std::vector<std::weak_ptr<UnitTransfer>> live_ ABSL_GUARDED_BY(live_mu_);
  DeadlineTimer timer_;  // delivers emulated-link delays
};

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_SHARD_CLIENT_H_
