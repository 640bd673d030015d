// The model state one shard server owns: for every unit, its slice of the
// fp32 master weights, AdamW m and v, the gradient being reduced for the
// current step, and the published version: its bytes in every wire encoding
// in use with their checksums (PublishedSlice), made once at publish and
// sent from by every fetch; plus the step barrier that says which
// contributions the current step still needs.
#ifndef PSHARD_SHARD_SERVER_SHARD_STATE_H_
#define PSHARD_SHARD_SERVER_SHARD_STATE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/deadline_timer.h"
#include "common/initial_weights.h"
#include "common/job_config.h"
#include "common/reduction_values.h"
#include "common/square_sum.h"
#include "common/wire_encoding.h"
#include "shard_server/checkpoint.h"
#include "shard_server/published_slice.h"

namespace pshard {

/// Identifies one contribution: the gradient slice of `unit` for `step`,
/// micro-batch `micro`, summed over trainers [trainer, trainer + rank_count).
struct ContributionId {
  int trainer = 0;
  int rank_count = 1;
  int micro = 0;
  int64_t step = 0;
  int unit = 0;
};

/// What became of a pushed contribution.
enum class PushDisposition { kAccepted, kDuplicate, kAcceptedNonFinite };

/// What applying a step did.
struct StepOutcome {
  int64_t step = 0;
  bool skipped = false;  ///< non-finite gradient: no update
  double grad_norm = 0.0;
  double learning_rate = 0.0;
  double update_sum_of_squares = 0.0;  ///< over this shard's slices
  double weight_sum_of_squares = 0.0;
};

/// The global agreement on one step's gradient.
struct StepNorm {
  /// Of the averaged gradient: a shard's slices (partial) or every
  /// shard's (agreed). Exact, so the agreed total is the same bits over
  /// any number of shards.
  SquareSum sum_of_squares;
  bool non_finite = false;
  std::string non_finite_source;  ///< where this shard saw one (local, not agreed)
  /// Partial: the steps whose checkpoint this shard holds on disk, sorted;
  /// agreed: the steps every shard holds.
  std::vector<int64_t> checkpoint_steps;

  /// The sum rounded to a double: what clipping uses.
  double total() const { return sum_of_squares.ToDouble(); }
};

/// A callback that runs at most once, whichever of publish, deadline or
/// cancellation comes first. Thread-safe.
class OneShotWaiter {
 public:
  explicit OneShotWaiter(std::function<void(absl::Status)> fn) : fn_(std::move(fn)) {}
  /// Runs the callback with `status` unless it already ran; true if it ran now.
  bool Fire(absl::Status status);

 private:
  std::atomic<bool> fired_{false};
  std::function<void(absl::Status)> fn_;
};

/// Owns one shard's model state. All methods are thread-safe.
/// How far ahead of a unit's version a fetch may wait: a trainer fetches
/// at most the step after the one the servers are closing.
inline constexpr int64_t kMaxVersionsAhead = 2;

class ShardState {
 public:
  /// Initialises every owned slice from the job's seed (independent of N),
  /// or from `initial` (not kept), which a job with an initial-weights
  /// file needs: its fingerprint must be the job's.
  static absl::StatusOr<std::unique_ptr<ShardState>> Create(const JobConfig& job, int shard_index,
                                                            const InitialWeights* initial = nullptr);
  ~ShardState();

  const JobConfig& job() const { return job_; }
  const JobLayout& layout() const { return layout_; }
  int shard_index() const { return shard_index_; }
  int num_units() const { return static_cast<int>(units_.size()); }
  int64_t slice_length(int unit) const { return layout_.partitions[unit].slice_length; }
  /// The step whose contributions are being reduced (= the version trainers fetch).
  int64_t current_step() const;

  // ---- fetch side ----
  /// Checks a fetch request: unit exists, version not already gone, and
  /// `trainer` (-1: a tool) has rejoined since the last rollback.
  absl::Status CheckFetch(int unit, int64_t version, int trainer = -1) const;
  /// Calls `waiter` with OK once `unit` is at `version` (at once if it is),
  /// with FailedPrecondition if the unit has moved past it, or with
  /// DeadlineExceeded naming what the server waits for at `deadline`.
  void WhenPublished(int unit, int64_t version, absl::Time deadline,
                     std::shared_ptr<OneShotWaiter> waiter);
  /// The unit's slice at `version` (its current one) in `format`, to send
  /// from: hold it while sending, the bytes stay valid and unchanged.
  /// FailedPrecondition if the unit is at another version. The first
  /// request of a format encodes the current version; from then on every
  /// version is encoded in it once, at publish. A shard publishes a few
  /// formats at most (ResourceExhausted beyond). With `adds_format` false
  /// (a reader's fetch) a format not published already is encoded for this
  /// request alone: a reader neither adds publishing work nor takes a
  /// trainer's place among the formats.
  absl::StatusOr<std::shared_ptr<const PublishedSlice>> Published(int unit, int64_t version,
                                                                  const WireFormat& format, bool adds_format = true);

  // ---- push side ----
  /// Validates a push's identity before any data is read.
  absl::Status CheckPush(const ContributionId& id) const;
  /// Trainer `rank` joined: it knows the step the shard is at (after a
  /// rollback, its fetches and pushes are refused until it does).
  void MarkJoined(int rank);
  /// Records how trainer `rank` said at its join that it pushes gradients
  /// (nullopt: it did not say; any format is then taken).
  void DeclareGradientFormat(int rank, std::optional<WireFormat> format);
  /// FailedPrecondition when the contribution's first rank declared another
  /// gradient format than `format`.
  absl::Status CheckPushFormat(const ContributionId& id, const WireFormat& format) const;
  /// Adds one complete gradient slice to the step's reduction, exactly once
  /// per contribution: a repeat is a duplicate, a partial overlap with what
  /// arrived is refused. A slice may stay in its wire encoding until it is
  /// added to another (ReductionValues: the sums are fp32 all the same).
  /// Quantized values are refused (InvalidArgument, nothing changes) when a
  /// block's scale is not finite or negative. `reported_non_finite`: the
  /// trainer saw a non-finite gradient that its encoding cannot carry.
  absl::StatusOr<PushDisposition> Contribute(const ContributionId& id, ReductionValues values,
                                             bool reported_non_finite = false);
  absl::StatusOr<PushDisposition> Contribute(const ContributionId& id, std::vector<float> values) {
    return Contribute(id, ReductionValues(std::move(values)));
  }

  // ---- the step (called by the step driver) ----
  /// Blocks until every contribution of the current step is in, or until
  /// `deadline` (returns DeadlineExceeded describing what is missing).
  absl::Status AwaitContributions(absl::Time deadline);
  /// This shard's exact sum of squares of the averaged gradients (each unit
  /// is averaged by AwaitContributions once its gradients are in; call it
  /// after that returned OK) and whether a non-finite contribution was seen.
  StepNorm FinishReduction();
  /// Applies AdamW with the agreed norm (or skips the update when it is not
  /// finite), publishes version step+1 unit by unit, and opens the next step.
  StepOutcome ApplyStep(const StepNorm& agreed);

  /// Fp32 master slice of a unit and its version (for tests and tools).
  std::pair<int64_t, std::vector<float>> ReadMaster(int unit) const;
  /// Elements [offset, offset + count) of it (clamped to the slice), and
  /// the version they are of.
  std::pair<int64_t, std::vector<float>> ReadMaster(int unit, int64_t offset, int64_t count) const;
  /// What the current step still waits for, in words.
  std::string DescribeWait() const;
  /// Words on whom the norm agreement of step `step` waits (e.g. "no partial
  /// norm yet from shard(s) 1"), added to DescribeWait once every gradient
  /// is in; empty when nothing more is known. Set before serving.
  void SetNormWaitDescription(std::function<std::string(int64_t step)> describe) {
    norm_wait_ = std::move(describe);
  }
  /// The trainers from which some unit of the current step has no
  /// contribution yet, ascending.
  std::vector<int> MissingTrainers() const;

  // ---- checkpoints (call between steps: from the step driver, or before
  // serving / after it stopped) ----
  /// The partition this shard's slices belong to, in words
  /// (CheckpointLayoutWords); a checkpoint restores only onto the same.
  const std::string& LayoutDescription() const { return layout_words_; }
  /// Writes this shard's master slices and moments at the current step into
  /// `dir`, keeping the newest `keep` checkpoints and `protected_step` (see
  /// WriteCheckpoint); returns the file's path.
  absl::StatusOr<std::string> SaveCheckpoint(const std::string& dir, int keep, int64_t protected_step = -1) const;
  /// A copy of this shard's state at the current step, to write elsewhere
  /// (WriteCheckpoint) while training goes on.
  absl::StatusOr<Checkpoint> Snapshot() const;
  /// Replaces the state with a checkpoint's (same shard, shard count and
  /// layout, or an error that names what differs and changes nothing).
  absl::Status RestoreCheckpoint(Checkpoint checkpoint);
  /// While serving, between steps (the step driver stopped): replaces the
  /// state with this shard's checkpoint of an earlier (or the current)
  /// step and reopens that step's reduction. Fetches waiting for a later
  /// version end with Aborted; pushes for the undone steps are refused as
  /// future steps until the job gets there again. Errors change nothing.
  /// Every trainer but `asked_by` must rejoin (MarkJoined) before its
  /// next fetch or push is served: Aborted until then.
  absl::Status RollBack(Checkpoint checkpoint, int asked_by = -1);

  struct Counters {
    int64_t applied_updates = 0;
    int64_t skipped_steps = 0;
    double last_grad_norm = 0.0;
    int64_t state_bytes = 0;     ///< all of the below
    int64_t master_bytes = 0;    ///< fp32 master slices
    int64_t moment_bytes = 0;    ///< each of Adam's m and v
    int64_t gradient_bytes = 0;  ///< the averaged gradient a complete step reduces to
    int64_t published_bytes = 0;  ///< the encoded views of the published version (bf16: 2 B/element)
  };
  Counters counters() const;

 private:
  struct UnitState;
  ShardState(JobConfig job, JobLayout layout, int shard_index);
  /// Fresh reduction state for the next step of `unit`.
  void ResetReduction(UnitState& unit) ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_);
  bool AllContributed() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_);
  bool UnitComplete(const UnitState& unit) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_);
  bool AllReduced() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_);
  bool AllReducedOrOneToTake() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_);
  // Averages each unit whose contributions are all in and sums its squares.
  void FinishCompleteUnits() ABSL_LOCKS_EXCLUDED(step_mu_);
  /// Whether `checkpoint` fits this shard (shard, layout, sizes, counts).
  absl::Status CheckCheckpoint(const Checkpoint& checkpoint) const;
  /// Puts a checked checkpoint's state in place and returns the fetches
  /// that waited for versions of the state it replaced.
  std::vector<std::shared_ptr<OneShotWaiter>> InstallCheckpoint(Checkpoint checkpoint);

  const JobConfig job_;
  const JobLayout layout_;
  const int shard_index_;
  const std::string layout_words_;
  const std::string layout_json_;  // one line, stored in checkpoints
  std::vector<std::unique_ptr<UnitState>> units_;
  /// Formats besides fp32 that fetches have asked for: published for every version.
  std::vector<WireFormat> FormatsInUse() const;
  mutable absl::Mutex declared_mu_;
  std::map<int, WireFormat> declared_grads_ ABSL_GUARDED_BY(declared_mu_);  // by rank
  mutable absl::Mutex formats_mu_;
  std::vector<WireFormat> formats_ ABSL_GUARDED_BY(formats_mu_);

  std::function<std::string(int64_t step)> norm_wait_;
  mutable absl::Mutex step_mu_;
  int64_t step_ ABSL_GUARDED_BY(step_mu_) = 0;
  int units_complete_ ABSL_GUARDED_BY(step_mu_) = 0;
  bool non_finite_ ABSL_GUARDED_BY(step_mu_) = false;
  std::string non_finite_source_ ABSL_GUARDED_BY(step_mu_);
  absl::Time step_started_ ABSL_GUARDED_BY(step_mu_);
  int64_t applied_updates_ ABSL_GUARDED_BY(step_mu_) = 0;
  int64_t skipped_steps_ ABSL_GUARDED_BY(step_mu_) = 0;
  double last_grad_norm_ ABSL_GUARDED_BY(step_mu_) = 0.0;
  // By rank: rolled back since the trainer last joined.
  std::vector<char> must_rejoin_ ABSL_GUARDED_BY(step_mu_);
  int64_t rolled_back_from_ ABSL_GUARDED_BY(step_mu_) = 0;
  /// Aborted when `trainer` has not rejoined since the last rollback.
  absl::Status CheckRejoined(int trainer) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_);

  DeadlineTimer timer_;
};

}  // namespace pshard

#endif  // PSHARD_SHARD_SERVER_SHARD_STATE_H_
