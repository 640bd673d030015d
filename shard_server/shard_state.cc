#include "shard_server/shard_state.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/checksum.h"
#include "common/layout_file.h"
#include "common/status_macros.h"
#include "common/optimizer.h"
#include "common/reduction_tree.h"
#include "common/status_macros.h"

namespace pshard {
namespace {

// Encodings besides fp32 that a shard publishes every version in, at most:
// bf16 and int8 at a few block sizes. Each costs memory for every slice.
constexpr size_t kMaxEncodedFormats = 4;

}  // namespace

bool OneShotWaiter::Fire(absl::Status status) {
  if (fired_.exchange(true)) return false;
  fn_(std::move(status));
  fn_ = nullptr;
  return true;
}

struct ShardState::UnitState {
  // Published model state: written by ApplyStep, read by fetches. The
  // master's storage is shared with the fp32 view of its version.
  mutable absl::Mutex mu;
  std::shared_ptr<std::vector<float>> master = std::make_shared<std::vector<float>>();
  std::vector<float> m, v;
  int64_t version = 0;
  // The published version's bytes: the fp32 view, and one per other
  // encoding that fetches have asked for.
  std::shared_ptr<PublishedSlice> published_fp32;
  std::vector<std::shared_ptr<PublishedSlice>> published_encoded;
  std::vector<std::pair<int64_t, std::shared_ptr<OneShotWaiter>>> waiters;
  std::vector<ElementRun> decay_runs;

  // The reduction of step `reduce_step`, guarded by ShardState::step_mu_.
  // Deterministic mode: per micro-batch slot a tree over trainer ranks, then
  // a tree over slots. Otherwise contributions are added as they arrive.
  int64_t reduce_step = 0;
  std::vector<TreeReducer> rank_trees;  // one per slot
  std::optional<TreeReducer> slot_tree;
  ReductionValues running;                    // non-deterministic sum
  std::vector<std::vector<char>> received;    // [slot][rank]
  int received_count = 0;                     // (slot, rank) pairs covered
  // Once every contribution is in, the step driver takes the sum, averages
  // it and adds up its squares outside the lock (FinishCompleteUnits),
  // while other units still receive. `generation` changes with every reset,
  // so that a reduction finished across a rollback is dropped.
  enum class Reduction { kCollecting, kTaken, kReduced } reduction = Reduction::kCollecting;
  uint64_t generation = 0;
  // The averaged gradient of a complete step and its exact sum of squares:
  // written once reduced, read by FinishReduction and ApplyStep (the step
  // driver's thread). A lone contribution that arrived encoded stays
  // encoded (the mean of one is itself).
  ReductionValues grad;
  SquareSum grad_squares;

  // Makes this version's bytes: the fp32 view of the master, and each of
  // `formats`, reusing the previous version's storage where no fetch still
  // holds it.
  void Publish(const std::vector<WireFormat>& formats) {
    published_fp32 = PublishedSlice::OfMaster(master);
    std::vector<std::shared_ptr<PublishedSlice>> previous = std::move(published_encoded);
    published_encoded.clear();
    for (const WireFormat& format : formats) {
      std::shared_ptr<PublishedSlice> reuse;
      for (auto& p : previous) {
        if (p != nullptr && p->format() == format) reuse = std::move(p);
      }
      published_encoded.push_back(PublishedSlice::Encode(format, *master, std::move(reuse)));
    }
  }
  std::shared_ptr<PublishedSlice> Find(const WireFormat& format) const {
    if (format.encoding() == WireEncoding::kFp32) return published_fp32;
    for (const auto& p : published_encoded) {
      if (p->format() == format) return p;
    }
    return nullptr;
  }
  // Before the master changes: if a fetch still sends the published fp32
  // view from it, the new version gets storage of its own.
  void DetachMasterFromReaders() {
    if (published_fp32 != nullptr && published_fp32.use_count() > 1) {
      master = std::make_shared<std::vector<float>>(*master);
    }
  }
};

ShardState::ShardState(JobConfig job, JobLayout layout, int shard_index)
    : job_(std::move(job)),
      layout_(std::move(layout)),
      shard_index_(shard_index),
      layout_words_(CheckpointLayoutWords(job_.model.model, LayoutFingerprint(job_.model), job_.num_shards,
                                          job_.slice_alignment)),
      layout_json_(FormatLayoutJson(job_.model, /*one_line=*/true)) {}

ShardState::~ShardState() = default;

absl::StatusOr<std::unique_ptr<ShardState>> ShardState::Create(const JobConfig& job, int shard_index,
                                                               const InitialWeights* initial) {
  ASSIGN_OR_RETURN(JobLayout layout, MakeJobLayout(job));
  if (shard_index < 0 || shard_index >= job.num_shards) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard index ", shard_index, " is outside [0, ", job.num_shards, ")"));
  }
  const uint64_t given = initial == nullptr ? 0 : initial->fingerprint();
  if (given != job.init_fingerprint) {
    return absl::InvalidArgumentError(
        job.init_fingerprint == 0
            ? "initial weights were given for a job whose weights come from its layout's rules"
            : absl::StrCat("the job starts from the initial weights ", FingerprintHex(job.init_fingerprint),
                           given == 0 ? ", which were not given" : absl::StrCat(", not ", FingerprintHex(given))));
  }
  std::unique_ptr<ShardState> state(new ShardState(job, std::move(layout), shard_index));
  for (size_t u = 0; u < state->layout_.spec.units.size(); ++u) {
    const SliceRange slice = state->layout_.partitions[u].Slice(shard_index);
    auto unit = std::make_unique<UnitState>();
    unit->master->resize(slice.length);
    if (initial != nullptr) {
      RETURN_IF_ERROR(initial->ReadUnitRange(state->layout_.spec.units[u], slice.begin, *unit->master));
    } else {
      InitializeUnitRange(state->layout_.spec.units[u], job.seed, slice.begin, *unit->master);
    }
    unit->m.assign(slice.length, 0.0f);
    unit->v.assign(slice.length, 0.0f);
    unit->decay_runs = WeightDecayRuns(state->layout_.spec.units[u], slice.begin, slice.length);
    unit->Publish({});
    state->units_.push_back(std::move(unit));
  }
  absl::MutexLock lock(&state->step_mu_);
  for (auto& unit : state->units_) state->ResetReduction(*unit);
  state->step_started_ = absl::Now();
  return state;
}

int64_t ShardState::current_step() const {
  absl::MutexLock lock(&step_mu_);
  return step_;
}

absl::Status ShardState::CheckRejoined(int trainer) const {
  if (trainer < 0 || trainer >= static_cast<int>(must_rejoin_.size()) || !must_rejoin_[trainer]) {
    return absl::OkStatus();
  }
  return absl::AbortedError(absl::StrCat("shard ", shard_index_, " rolled back from step ", rolled_back_from_,
                                         " to step ", step_, " (a shard restarted): trainer ", trainer,
                                         " must rejoin and redo the steps since"));
}

void ShardState::MarkJoined(int rank) {
  absl::MutexLock lock(&step_mu_);
  if (rank >= 0 && rank < static_cast<int>(must_rejoin_.size())) must_rejoin_[rank] = 0;
}

absl::Status ShardState::CheckFetch(int unit, int64_t version, int trainer) const {
  if (unit < 0 || unit >= num_units()) {
    return absl::NotFoundError(absl::StrCat("unknown unit ", unit, ": the model has ", num_units(), " units"));
  }
  {
    absl::MutexLock lock(&step_mu_);
    RETURN_IF_ERROR(CheckRejoined(trainer));
  }
  absl::ReaderMutexLock lock(&units_[unit]->mu);
  if (version < units_[unit]->version) {
    return absl::FailedPreconditionError(absl::StrCat(
        "unit ", unit, " version ", version, " is gone: this shard is at version ",
        units_[unit]->version));
  }
  if (version > units_[unit]->version + kMaxVersionsAhead) {
    return absl::OutOfRangeError(absl::StrCat("unit ", unit, " version ", version, " is more than ",
                                              kMaxVersionsAhead, " ahead of this shard's version ",
                                              units_[unit]->version, ": no trainer waits that far ahead"));
  }
  return absl::OkStatus();
}

void ShardState::WhenPublished(int unit, int64_t version, absl::Time deadline,
                               std::shared_ptr<OneShotWaiter> waiter) {
  absl::Status now_status;
  {
    UnitState& u = *units_[unit];
    absl::MutexLock lock(&u.mu);
    if (version > u.version) {
      u.waiters.emplace_back(version, waiter);
      timer_.Schedule(deadline, [this, unit, version, waiter] {
        waiter->Fire(absl::DeadlineExceededError(absl::StrCat(
            "unit ", unit, " version ", version, " was not published in time: ", DescribeWait())));
      });
      return;
    }
    if (version < u.version) {
      now_status = absl::FailedPreconditionError(absl::StrCat(
          "unit ", unit, " version ", version, " is gone: this shard is at version ", u.version));
    }
  }
  waiter->Fire(now_status);
}

absl::StatusOr<std::shared_ptr<const PublishedSlice>> ShardState::Published(int unit, int64_t version,
                                                                               const WireFormat& format,
                                                                               bool adds_format) {
  UnitState& u = *units_[unit];
  {
    absl::ReaderMutexLock lock(&u.mu);
    if (u.version != version) {
      return absl::FailedPreconditionError(
          absl::StrCat("unit ", unit, " is at version ", u.version, ", not ", version));
    }
    if (std::shared_ptr<PublishedSlice> p = u.Find(format)) return std::shared_ptr<const PublishedSlice>(p);
    if (!adds_format) return std::shared_ptr<const PublishedSlice>(PublishedSlice::Encode(format, *u.master, nullptr));
  }
  // The first fetch in this format: encode the current version now, and
  // every later one at publish.
  {
    absl::MutexLock lock(&formats_mu_);
    if (std::find(formats_.begin(), formats_.end(), format) == formats_.end()) {
      if (formats_.size() >= kMaxEncodedFormats) {
        std::vector<std::string> names;
        for (const WireFormat& f : formats_) names.push_back(f.ToString());
        return absl::ResourceExhaustedError(absl::StrCat(
            "this shard already publishes every version in ", kMaxEncodedFormats, " encodings besides fp32 (",
            absl::StrJoin(names, ", "), "); ", format.ToString(), " would be one more"));
      }
      formats_.push_back(format);
    }
  }
  absl::MutexLock lock(&u.mu);
  if (u.version != version) {
    return absl::FailedPreconditionError(absl::StrCat("unit ", unit, " is at version ", u.version, ", not ", version));
  }
  std::shared_ptr<PublishedSlice> p = u.Find(format);
  if (p == nullptr) {
    p = PublishedSlice::Encode(format, *u.master, nullptr);
    u.published_encoded.push_back(p);
  }
  return std::shared_ptr<const PublishedSlice>(p);
}

std::vector<WireFormat> ShardState::FormatsInUse() const {
  absl::MutexLock lock(&formats_mu_);
  return formats_;
}

absl::Status ShardState::CheckPush(const ContributionId& id) const {
  if (id.unit < 0 || id.unit >= num_units()) {
    return absl::NotFoundError(absl::StrCat("unknown unit ", id.unit, ": the model has ", num_units(), " units"));
  }
  if (id.trainer < 0 || id.trainer >= job_.num_trainers) {
    return absl::InvalidArgumentError(absl::StrCat("trainer rank ", id.trainer, " is outside [0, ",
                                                   job_.num_trainers, ")"));
  }
  if (!IsReductionTreeNode(job_.num_trainers, id.trainer, id.rank_count)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a contribution of trainers [", id.trainer, ", ", id.trainer + id.rank_count,
        ") is not a fabric group the reduction can take (groups must be aligned, e.g. powers of two)"));
  }
  if (id.micro < 0 || id.micro >= job_.reduction_slots()) {
    return absl::InvalidArgumentError(absl::StrCat("micro-batch ", id.micro, " is outside [0, ",
                                                   job_.reduction_slots(), ")"));
  }
  absl::MutexLock lock(&step_mu_);
  RETURN_IF_ERROR(CheckRejoined(id.trainer));
  const int64_t at = units_[id.unit]->reduce_step;
  if (id.step < at) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", id.step, " of unit ", id.unit, " is already applied; this shard is at step ", at));
  }
  if (id.step > at) {
    return absl::OutOfRangeError(absl::StrCat("step ", id.step, " of unit ", id.unit,
                                              " is in the future; this shard is at step ", at));
  }
  return absl::OkStatus();
}

void ShardState::DeclareGradientFormat(int rank, std::optional<WireFormat> format) {
  absl::MutexLock lock(&declared_mu_);
  if (format) {
    declared_grads_.insert_or_assign(rank, *format);
  } else {
    declared_grads_.erase(rank);
  }
}

absl::Status ShardState::CheckPushFormat(const ContributionId& id, const WireFormat& format) const {
  absl::MutexLock lock(&declared_mu_);
  auto it = declared_grads_.find(id.trainer);
  if (it == declared_grads_.end() || it->second == format) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "trainer ", id.trainer, " joined pushing ", it->second.ToString(), " gradients; this push of unit ", id.unit,
      " is ", format.ToString(), " (restart the trainer to change its --grad_encoding or --quant_block)"));
}

absl::StatusOr<PushDisposition> ShardState::Contribute(const ContributionId& id, ReductionValues values,
                                                       bool reported_non_finite) {
  RETURN_IF_ERROR(CheckPush(id));
  UnitState& u = *units_[id.unit];
  if (static_cast<int64_t>(values.size()) != slice_length(id.unit)) {
    return absl::InvalidArgumentError(absl::StrCat("gradient of unit ", id.unit, " has ", values.size(),
                                                   " elements; the slice has ", slice_length(id.unit)));
  }
  if (values.encoded()) {
    if (absl::Status s = CheckScales(values.format(), values.bytes().data(), values.size()); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("push of unit ", id.unit, ": ", s.message(), "; nothing applied"));
    }
  }
  const bool finite = !reported_non_finite && values.AllFinite();
  absl::MutexLock lock(&step_mu_);
  RETURN_IF_ERROR(CheckRejoined(id.trainer));  // rolled back since the check
  if (u.reduce_step != id.step) {  // moved on between the check and the lock
    return absl::FailedPreconditionError(
        absl::StrCat("step ", id.step, " of unit ", id.unit, " is already applied"));
  }
  std::vector<char>& received = u.received[id.micro];
  const int covered = static_cast<int>(
      std::count(received.begin() + id.trainer, received.begin() + id.trainer + id.rank_count, 1));
  if (covered == id.rank_count) return PushDisposition::kDuplicate;
  if (covered > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "contribution of trainers [", id.trainer, ", ", id.trainer + id.rank_count, ") for micro-batch ",
        id.micro, " overlaps contributions already received"));
  }
  if (!finite) {
    // Policy: the contribution counts (so the step completes) but its values
    // are dropped, and every shard skips this step's update.
    if (!non_finite_) non_finite_source_ = absl::StrCat("trainer ", id.trainer, ", unit ", id.unit);
    non_finite_ = true;
    values.Zero();
  }
  if (job_.deterministic) {
    TreeReducer& ranks = u.rank_trees[id.micro];
    RETURN_IF_ERROR(ranks.Add(id.trainer, id.rank_count, std::move(values)));
    if (ranks.complete()) RETURN_IF_ERROR(u.slot_tree->Add(id.micro, 1, ranks.TakeTotalValues()));
  } else if (u.received_count == 0) {
    u.running = std::move(values);
  } else {
    u.running.Add(values);
  }
  std::fill(received.begin() + id.trainer, received.begin() + id.trainer + id.rank_count, 1);
  u.received_count += id.rank_count;
  if (u.received_count == job_.num_trainers * job_.reduction_slots()) ++units_complete_;
  return finite ? PushDisposition::kAccepted : PushDisposition::kAcceptedNonFinite;
}

void ShardState::ResetReduction(UnitState& u) {
  const int slots = job_.reduction_slots();
  u.rank_trees.assign(slots, TreeReducer(job_.num_trainers));
  u.slot_tree.emplace(slots);
  u.running = ReductionValues();
  u.received.assign(slots, std::vector<char>(job_.num_trainers, 0));
  u.received_count = 0;
  u.reduction = UnitState::Reduction::kCollecting;
  u.grad = ReductionValues();
  u.grad_squares = SquareSum();
  ++u.generation;
}

bool ShardState::AllContributed() const { return units_complete_ == num_units(); }

bool ShardState::UnitComplete(const UnitState& u) const {
  return u.received_count == job_.num_trainers * job_.reduction_slots();
}

bool ShardState::AllReduced() const {
  return std::all_of(units_.begin(), units_.end(),
                     [](const auto& u) { return u->reduction == UnitState::Reduction::kReduced; });
}

bool ShardState::AllReducedOrOneToTake() const {
  return AllReduced() || std::any_of(units_.begin(), units_.end(), [this](const auto& u) {
           return u->reduction == UnitState::Reduction::kCollecting && UnitComplete(*u);
         });
}

void ShardState::FinishCompleteUnits() {
  // The mean over every micro-batch of every trainer.
  const float contributions = static_cast<float>(job_.num_trainers) * static_cast<float>(job_.micro_batches);
  for (auto& unit : units_) {
    UnitState& u = *unit;
    ReductionValues sum;
    uint64_t generation = 0;
    {
      absl::MutexLock lock(&step_mu_);
      if (u.reduction != UnitState::Reduction::kCollecting || !UnitComplete(u)) continue;
      sum = job_.deterministic ? u.slot_tree->TakeTotalValues() : std::move(u.running);
      u.reduction = UnitState::Reduction::kTaken;
      generation = u.generation;
    }
    if (contributions != 1.0f) {  // g / 1 is g: a lone contribution may stay encoded
      sum.Decode();
      for (float& g : sum.mutable_floats()) g = g / contributions;
    }
    SquareSum squares;
    AddSquares(sum, &squares);
    absl::MutexLock lock(&step_mu_);
    if (u.generation != generation) continue;  // reset meanwhile (a rollback)
    u.grad = std::move(sum);
    u.grad_squares = std::move(squares);
    u.reduction = UnitState::Reduction::kReduced;
  }
}

absl::Status ShardState::AwaitContributions(absl::Time deadline) {
  // Each unit is averaged and its squares summed as soon as its last
  // contribution is in, while the others still arrive: the step then
  // waits on the last unit's reduction only, not on every unit's.
  while (true) {
    {
      absl::MutexLock lock(&step_mu_);
      if (!step_mu_.AwaitWithDeadline(absl::Condition(this, &ShardState::AllReducedOrOneToTake), deadline)) break;
      if (AllReduced()) return absl::OkStatus();
    }
    FinishCompleteUnits();
  }
  std::string what = DescribeWait();
  return absl::DeadlineExceededError(what);
}

StepNorm ShardState::FinishReduction() {
  absl::MutexLock lock(&step_mu_);
  StepNorm norm;
  norm.non_finite = non_finite_;
  norm.non_finite_source = non_finite_source_;
  for (auto& u : units_) norm.sum_of_squares.Add(u->grad_squares);
  return norm;
}

StepOutcome ShardState::ApplyStep(const StepNorm& agreed) {
  const bool skip = agreed.non_finite || !std::isfinite(agreed.total());
  const double norm = std::sqrt(agreed.total());
  int64_t step;
  int64_t update_count;
  {
    // Close the step before any unit opens the next one: a push for step + 1
    // may arrive as soon as its unit is published, and what it records (a
    // non-finite contribution) must not be reset below it.
    absl::MutexLock lock(&step_mu_);
    step = step_;
    update_count = applied_updates_ + 1;
    step_ = step + 1;
    step_started_ = absl::Now();
    non_finite_ = false;
    non_finite_source_.clear();
    last_grad_norm_ = norm;
    if (skip) {
      ++skipped_steps_;
    } else {
      ++applied_updates_;
    }
  }
  AdamWStep adam;
  adam.lr = LearningRateAt(job_.optimizer, step);
  adam.count = update_count;
  adam.grad_scale = static_cast<float>(ClipCoefficient(job_.optimizer.grad_clip, norm));
  AdamWNorms norms;
  for (auto& unit : units_) {
    UnitState& u = *unit;
    std::vector<std::shared_ptr<OneShotWaiter>> ready;
    {
      absl::MutexLock unit_lock(&u.mu);
      if (!skip) {
        u.DetachMasterFromReaders();
        // An encoded gradient is decoded for this unit only, for the update.
        u.grad.Decode();
        AdamWUpdate(job_.optimizer, adam, *u.master, u.m, u.v, u.grad.floats(), u.decay_runs, &norms);
        u.grad = ReductionValues();  // before publishing: the new encodings need room
        u.Publish(FormatsInUse());
      }
      {
        // Open the next step's reduction before anyone can fetch version
        // step + 1 and push for it.
        absl::MutexLock step_lock(&step_mu_);
        ResetReduction(u);
        u.reduce_step = step + 1;
        --units_complete_;
      }
      u.version = step + 1;
      auto keep = std::partition(u.waiters.begin(), u.waiters.end(),
                                 [&](const auto& w) { return w.first > u.version; });
      for (auto it = keep; it != u.waiters.end(); ++it) ready.push_back(std::move(it->second));
      u.waiters.erase(keep, u.waiters.end());
    }
    for (auto& w : ready) w->Fire(absl::OkStatus());
  }
  return StepOutcome{step, skip, norm, adam.lr, norms.update_sum_of_squares, norms.weight_sum_of_squares};
}

absl::StatusOr<Checkpoint> ShardState::Snapshot() const {
  Checkpoint snapshot;
  CheckpointHeader& header = snapshot.header;
  header.layout = LayoutDescription();
  header.layout_json = layout_json_;
  header.slice_alignment = job_.slice_alignment;
  header.schedule_end = job_.optimizer.total_steps;
  header.shard_index = shard_index_;
  header.num_shards = job_.num_shards;
  {
    absl::MutexLock lock(&step_mu_);
    header.step = step_;
    header.applied_updates = applied_updates_;
    header.skipped_steps = skipped_steps_;
  }
  // Readers only: fetches go on while the state is copied.
  for (const auto& unit : units_) {
    absl::ReaderMutexLock lock(&unit->mu);
    if (unit->version != header.step) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint at step ", header.step, ": a unit is at version ",
                                                        unit->version, " (a step is being applied)"));
    }
    snapshot.units.push_back(CheckpointUnit{*unit->master, unit->m, unit->v});
  }
  return snapshot;
}

absl::StatusOr<std::string> ShardState::SaveCheckpoint(const std::string& dir, int keep,
                                                       int64_t protected_step) const {
  ASSIGN_OR_RETURN(const Checkpoint snapshot, Snapshot());
  ASSIGN_OR_RETURN(std::string path, WriteCheckpointFile(dir, snapshot));
  PruneCheckpoints(dir, shard_index_, job_.num_shards, keep, {&protected_step, 1}, snapshot.header.step);
  return path;
}

absl::Status ShardState::CheckCheckpoint(const Checkpoint& checkpoint) const {
  const CheckpointHeader& h = checkpoint.header;
  if (h.shard_index != shard_index_ || h.num_shards != job_.num_shards) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint ", checkpoint.path, " belongs to shard ",
                                                      h.shard_index, " of ", h.num_shards, ", not shard ",
                                                      shard_index_, " of ", job_.num_shards));
  }
  if (h.layout != LayoutDescription()) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint ", checkpoint.path, " holds a model of ", h.layout,
                                                      "; this server runs ", LayoutDescription()));
  }
  if (checkpoint.units.size() != units_.size()) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint ", checkpoint.path, " has ",
                                                      checkpoint.units.size(), " units; the model has ",
                                                      units_.size()));
  }
  for (size_t u = 0; u < units_.size(); ++u) {
    if (static_cast<int64_t>(checkpoint.units[u].master.size()) != slice_length(static_cast<int>(u))) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint ", checkpoint.path, ": unit ", u, " has ",
                                                        checkpoint.units[u].master.size(), " elements, expected ",
                                                        slice_length(static_cast<int>(u))));
    }
  }
  if (h.step < 0 || h.applied_updates < 0 || h.skipped_steps < 0 || h.applied_updates + h.skipped_steps > h.step) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint ", checkpoint.path, ": inconsistent counts (step ",
                                                      h.step, ", ", h.applied_updates, " updates, ",
                                                      h.skipped_steps, " skipped)"));
  }
  return absl::OkStatus();
}

std::vector<std::shared_ptr<OneShotWaiter>> ShardState::InstallCheckpoint(Checkpoint checkpoint) {
  const CheckpointHeader& h = checkpoint.header;
  const std::vector<WireFormat> formats = FormatsInUse();
  std::vector<std::shared_ptr<OneShotWaiter>> waiting;
  // Every unit's lock, then the step lock (the order ApplyStep takes them
  // in): no push or fetch sees a mix of the old step and the restored one.
  std::vector<std::unique_ptr<absl::MutexLock>> unit_locks;
  for (auto& unit : units_) unit_locks.push_back(std::make_unique<absl::MutexLock>(&unit->mu));
  absl::MutexLock step_lock(&step_mu_);
  for (size_t u = 0; u < units_.size(); ++u) {
    UnitState& unit = *units_[u];
    unit.master = std::make_shared<std::vector<float>>(std::move(checkpoint.units[u].master));
    unit.m = std::move(checkpoint.units[u].m);
    unit.v = std::move(checkpoint.units[u].v);
    unit.version = h.step;
    for (auto& [version, waiter] : unit.waiters) waiting.push_back(std::move(waiter));
    unit.waiters.clear();
    ResetReduction(unit);
    unit.reduce_step = h.step;
    unit.Publish(formats);
  }
  step_ = h.step;
  units_complete_ = 0;
  non_finite_ = false;
  non_finite_source_.clear();
  step_started_ = absl::Now();
  applied_updates_ = h.applied_updates;
  skipped_steps_ = h.skipped_steps;
  return waiting;
}

absl::Status ShardState::RestoreCheckpoint(Checkpoint checkpoint) {
  RETURN_IF_ERROR(CheckCheckpoint(checkpoint));
  {
    absl::MutexLock step_lock(&step_mu_);
    if (step_ != 0 || units_complete_ != 0) {
      return absl::FailedPreconditionError("a checkpoint can only be restored before training starts");
    }
  }
  InstallCheckpoint(std::move(checkpoint));  // before serving: nobody waits
  return absl::OkStatus();
}

absl::Status ShardState::RollBack(Checkpoint checkpoint, int asked_by) {
  RETURN_IF_ERROR(CheckCheckpoint(checkpoint));
  const int64_t from = current_step();
  const int64_t to = checkpoint.header.step;
  if (to > from) {
    return absl::FailedPreconditionError(absl::StrCat("shard ", shard_index_, " is at step ", from,
                                                      ": it cannot roll back to the later step ", to));
  }
  const std::string path = checkpoint.path;
  const std::vector<std::shared_ptr<OneShotWaiter>> waiting = InstallCheckpoint(std::move(checkpoint));
  {
    absl::MutexLock lock(&step_mu_);
    must_rejoin_.assign(job_.num_trainers, 1);
    if (asked_by >= 0 && asked_by < job_.num_trainers) must_rejoin_[asked_by] = 0;
    rolled_back_from_ = from;
  }
  for (const auto& waiter : waiting) {
    waiter->Fire(absl::AbortedError(absl::StrCat("shard ", shard_index_, " rolled back from step ", from,
                                                 " to step ", to, " (", path,
                                                 "): a shard restarted; rejoin and redo the steps since")));
  }
  return absl::OkStatus();
}

std::pair<int64_t, std::vector<float>> ShardState::ReadMaster(int unit) const {
  const UnitState& u = *units_[unit];
  absl::ReaderMutexLock lock(&u.mu);
  return {u.version, *u.master};
}

std::pair<int64_t, std::vector<float>> ShardState::ReadMaster(int unit, int64_t offset, int64_t count) const {
  const UnitState& u = *units_[unit];
  absl::ReaderMutexLock lock(&u.mu);
  const auto size = static_cast<int64_t>(u.master->size());
  const int64_t begin = std::clamp<int64_t>(offset, 0, size);
  const int64_t end = std::clamp<int64_t>(begin + std::max<int64_t>(count, 0), begin, size);
  return {u.version, std::vector<float>(u.master->begin() + begin, u.master->begin() + end)};
}

std::vector<int> ShardState::MissingTrainers() const {
  absl::MutexLock lock(&step_mu_);
  std::vector<int> missing;
  for (int t = 0; t < job_.num_trainers; ++t) {
    bool all = true;
    for (int unit = 0; unit < num_units() && all; ++unit) {
      for (const std::vector<char>& slot : units_[unit]->received) all = all && slot[t];
    }
    if (!all) missing.push_back(t);
  }
  return missing;
}

std::string ShardState::DescribeWait() const {
  int64_t step = 0, seconds = 0;
  std::map<int, std::vector<int>> missing;  // trainer -> units
  {
    absl::MutexLock lock(&step_mu_);
    step = step_;
    seconds = absl::ToInt64Seconds(absl::Now() - step_started_);
    for (int unit = 0; unit < num_units(); ++unit) {
      for (int t = 0; t < job_.num_trainers; ++t) {
        for (const std::vector<char>& slot : units_[unit]->received) {
          if (!slot[t]) {
            missing[t].push_back(unit);
            break;
          }
        }
      }
    }
  }
  if (missing.empty()) {
    const std::string whom = norm_wait_ ? norm_wait_(step) : std::string();
    return absl::StrCat("shard ", shard_index_, ", step ", step,
                        ": all gradients received; agreeing on the global gradient norm with the "
                        "other shards for ", seconds, " s", whom.empty() ? "" : absl::StrCat(" (", whom, ")"));
  }
  std::vector<std::string> parts;
  for (const auto& [trainer, units] : missing) {
    parts.push_back(absl::StrCat("trainer ", trainer, " (units ", absl::StrJoin(units, ","), ")"));
  }
  return absl::StrCat("shard ", shard_index_, ", step ", step, ": no gradient from ",
                      absl::StrJoin(parts, ", "), " for ", seconds, " s");
}

ShardState::Counters ShardState::counters() const {
  Counters c;
  int64_t elements = 0;
  for (const auto& u : units_) {
    absl::ReaderMutexLock lock(&u->mu);
    elements += static_cast<int64_t>(u->master->size());
    for (const auto& p : u->published_encoded) c.published_bytes += p->extra_bytes();
  }
  c.master_bytes = elements * static_cast<int64_t>(sizeof(float));
  c.moment_bytes = c.master_bytes;
  c.gradient_bytes = c.master_bytes;
  c.state_bytes = c.master_bytes + 2 * c.moment_bytes + c.gradient_bytes + c.published_bytes;
  absl::MutexLock lock(&step_mu_);
  c.applied_updates = applied_updates_;
  c.skipped_steps = skipped_steps_;
  c.last_grad_norm = last_grad_norm_;
  return c;
}

}  // namespace pshard
