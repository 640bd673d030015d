// What a trainer computes with: the GPT run unit by unit, on the CPU
// (CpuGpt) or on a CUDA device (CudaUnitModel). The trainer hands each unit
// its fp32 weights as fetched and takes back the unit's fp32 gradient; where
// the arithmetic happens, and in which precision, is the model's business.
//
// Calls may return before their work is done, so that the trainer can wait
// for the next unit's fetch (and the model copy it to its device) while the
// current unit computes, and push one unit's gradient while the next unit's
// backward runs. The CPU model does all its work inside each call.
#ifndef PSHARD_TRAINER_CLIENT_MODEL_UNIT_MODEL_H_
#define PSHARD_TRAINER_CLIENT_MODEL_UNIT_MODEL_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/model_spec.h"

namespace pshard {

/// Where a model's time went between two TakeTimeline calls, as intervals
/// of the host clock (absl::Now).
struct ModelTimeline {
  using Interval = std::pair<absl::Time, absl::Time>;
  std::vector<Interval> compute;  ///< the model computing (on its device)
  /// Weights or gradients moving between host and device, or the host
  /// preparing them (bf16 rounding into staging buffers): communication.
  std::vector<Interval> transfer;
};

/// Memory a model holds, in bytes.
struct ModelMemory {
  int64_t activations = 0;  ///< activations (of every lane) and gradient scratch, where the model computes
  int64_t weights = 0;      ///< device buffers for units' weights ((prefetch depth + 1) units)
  int64_t gradients = 0;    ///< device buffers for units' gradients
  int64_t device = 0;       ///< all the model holds on its device; 0 for the CPU model
};

/// A model holds one micro-batch, or several at once ("lanes",
/// UnitModelOptions::lanes): then each unit's weights, handed over once,
/// serve every lane, and its gradient comes back summed over the lanes.
class UnitModel {
 public:
  /// Backward calls that may be started and not finished at one time.
  static constexpr int kMaxPendingBackward = 2;

  virtual ~UnitModel() = default;

  /// Sets lane `lane`'s micro-batch (batch*seq_len tokens and next-token
  /// targets). Waits for the model's earlier work.
  virtual absl::Status SetBatch(int lane, std::span<const int32_t> tokens, std::span<const int32_t> targets) = 0;
  /// Starts the forward of `unit` (0..K-1 in order) on every lane with its
  /// flat fp32 weights. `weights` may be released once this returns.
  virtual absl::Status ForwardUnit(int unit, std::span<const float> weights) = 0;
  /// Starts the backward of `unit` (K-1..0 after a full forward) on every
  /// lane with the same weights. The gradient of each lane's mean loss,
  /// summed over the lanes in the reduction tree's order
  /// (common/reduction_tree.h, leaf i = lane i), goes to `grads` (the unit's
  /// numel elements; padding after them is left alone), which the caller
  /// keeps valid and does not read until FinishBackward(unit) returns. At
  /// most kMaxPendingBackward backwards are started and not finished.
  virtual absl::Status BackwardUnit(int unit, std::span<const float> weights, std::span<float> grads) = 0;
  /// Waits until the gradient of the oldest unfinished backward, which must
  /// be `unit`'s, is in its `grads`.
  virtual absl::Status FinishBackward(int unit) = 0;
  /// Mean cross-entropy of lane `lane` in the last full forward, in nats
  /// (waits for it).
  virtual absl::StatusOr<double> Loss(int lane) = 0;
  /// Waits for all work started and returns the timeline since the last
  /// call (or since the model was made), forgetting it.
  virtual absl::StatusOr<ModelTimeline> TakeTimeline() = 0;

  virtual int num_units() const = 0;
  virtual int lanes() const = 0;
  virtual ModelMemory Memory() const = 0;
  /// Model FLOPs of one forward + backward of one lane's micro-batch (for MFU).
  virtual double FlopsPerMicroBatch() const = 0;
  /// "cpu", or the CUDA device ("cuda:0 NVIDIA H200").
  virtual std::string DeviceName() const = 0;
  /// Whether calls return before their work is done (so that keeping
  /// several backwards unfinished pays).
  virtual bool asynchronous() const = 0;
};

/// The rule BackwardUnit and FinishBackward keep, for models to share:
/// backwards finish in the order they started, at most
/// UnitModel::kMaxPendingBackward at a time.
class PendingBackwards {
 public:
  /// FailedPrecondition when kMaxPendingBackward are already unfinished.
  absl::Status Start(int unit) {
    if (size() >= UnitModel::kMaxPendingBackward) {
      return absl::FailedPreconditionError(absl::StrCat("backward of unit ", unit, " started while ", size(),
                                                        " are unfinished (at most ",
                                                        UnitModel::kMaxPendingBackward, ")"));
    }
    units_.push_back(unit);
    ++started_;
    return absl::OkStatus();
  }
  /// FailedPrecondition unless `unit`'s is the oldest unfinished backward.
  absl::Status Finish(int unit) {
    if (units_.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("finishing the backward of unit ", unit, ", which was not started"));
    }
    if (units_.front() != unit) {
      return absl::FailedPreconditionError(
          absl::StrCat("finishing the backward of unit ", unit, " before unit ", units_.front()));
    }
    units_.pop_front();
    return absl::OkStatus();
  }
  int size() const { return static_cast<int>(units_.size()); }
  /// Slot (0..kMaxPendingBackward-1) of the i-th unfinished backward, oldest
  /// first: backwards take slots in turn.
  int slot(int i) const { return static_cast<int>((started_ - units_.size() + i) % UnitModel::kMaxPendingBackward); }

 private:
  std::deque<int> units_;
  uint64_t started_ = 0;
};

struct UnitModelOptions {
  int batch = 8;    ///< sequences per micro-batch
  int seq_len = 64;
  /// Micro-batches held at once: activations for each, one pass of weights.
  int lanes = 1;
  /// The CUDA model's attention: "auto", "fused" or "materialized" (see
  /// CudaAttention); the CPU model has one kind and ignores it.
  std::string attention = "auto";
  /// Keep only each block's input between forward and backward and
  /// recompute the rest in backward.
  bool recompute_blocks = false;
  /// "cpu", "cuda" or "cuda:N" (CUDA device 0 or N; an error in builds
  /// without PSHARD_WITH_CUDA or without that device), or "auto" (CUDA when
  /// this build has it and a device is present, else the CPU).
  std::string device = "cpu";
  /// Units the trainer fetches ahead of the one computing: a device model
  /// keeps prefetch_depth + 1 units of weights on its device so that the
  /// next ones can be copied in while one computes.
  int prefetch_depth = 1;
};

/// The CUDA device a device name means: 0 for "cuda" (and "auto"), N for
/// "cuda:N"; InvalidArgument for anything else but "cpu".
absl::StatusOr<int> CudaDeviceIndex(const std::string& device);

/// The trainer's model, as `options` say.
absl::StatusOr<std::unique_ptr<UnitModel>> CreateUnitModel(const ModelSpec& spec, const UnitModelOptions& options);

/// Makes a model for a layout: CreateUnitModel (the GPT), or a model of
/// another kind.
using UnitModelFactory =
    std::function<absl::StatusOr<std::unique_ptr<UnitModel>>(const ModelSpec&, const UnitModelOptions&)>;

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_MODEL_UNIT_MODEL_H_
