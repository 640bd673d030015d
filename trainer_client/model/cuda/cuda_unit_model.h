// The trainer's model on a CUDA device: CudaGpt behind the UnitModel
// interface, with the copies on their own streams so that they overlap the
// compute.
//
// Three streams: `upload` copies weights in, `compute` runs the model,
// `download` copies gradients out. Weights go through prefetch depth + 1
// slots (pinned host staging + device buffer): while unit i computes from
// one slot, the host rounds unit i+1 to bf16 into the next slot's staging
// and the upload stream copies it in. Gradients go through two slots
// (device buffers + pinned staging): unit u's gradient is copied out and
// handed to the trainer while unit u-1's backward runs into the other one.
// With several lanes (micro-batches held at once), every lane is a CudaGpt
// sharing lane 0's workspace; a unit's forward and backward run on each
// lane in turn, and the lanes' gradients are summed on the device in the
// reduction tree's order (InOrderTreeSum) within the slot's buffers.
// Only events order the streams; the host waits only for a slot it is
// about to refill and for a gradient it is asked for.
#ifndef PSHARD_TRAINER_CLIENT_MODEL_CUDA_CUDA_UNIT_MODEL_H_
#define PSHARD_TRAINER_CLIENT_MODEL_CUDA_CUDA_UNIT_MODEL_H_

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "common/parallel_for.h"
#include "trainer_client/model/cuda/cuda_gpt.h"
#include "trainer_client/model/unit_model.h"

namespace pshard {

/// Usable CUDA devices (0 when the driver or the devices are missing).
int CudaDeviceCount();

/// The dense bf16 tensor rate of CUDA device `device`, in FLOP/s, that MFU
/// is measured against: the datasheet figure for known data-center parts
/// (H100/H200 SXM 989 TFLOP/s, A100 312, ...), else SMs × clock × the
/// architecture's rate per SM. 0 when the device cannot be queried.
double CudaPeakBf16Flops(int device);

/// Not thread-safe: one caller at a time.
class CudaUnitModel final : public UnitModel {
 public:
  static absl::StatusOr<std::unique_ptr<UnitModel>> Create(const ModelSpec& spec, const UnitModelOptions& options,
                                                           int device);
  ~CudaUnitModel() override;

  absl::Status SetBatch(int lane, std::span<const int32_t> tokens, std::span<const int32_t> targets) override;
  absl::Status ForwardUnit(int unit, std::span<const float> weights) override;
  absl::Status BackwardUnit(int unit, std::span<const float> weights, std::span<float> grads) override;
  absl::Status FinishBackward(int unit) override;
  absl::StatusOr<double> Loss(int lane) override;
  absl::StatusOr<ModelTimeline> TakeTimeline() override;
  int num_units() const override { return lanes_[0]->num_units(); }
  int lanes() const override { return static_cast<int>(lanes_.size()); }
  ModelMemory Memory() const override;
  double FlopsPerMicroBatch() const override { return lanes_[0]->FlopsPerMicroBatch(); }
  std::string DeviceName() const override { return name_; }
  bool asynchronous() const override { return true; }

 private:
  // One unit's weights on their way in.
  struct WeightSlot {
    __nv_bfloat16* device = nullptr;
    uint16_t* staging = nullptr;     // pinned
    cudaEvent_t uploaded = nullptr;  // upload stream, after the copy in
    cudaEvent_t consumed = nullptr;  // compute stream, after the last unit that read it
    int unit = -1;                   // what it holds; -1 none
  };
  // One unit's gradient on its way out: the lanes' partial sums (one
  // buffer with one lane), the total in buffers[0].
  struct GradientSlot {
    std::vector<float*> buffers;
    float* staging = nullptr;          // pinned
    cudaEvent_t computed = nullptr;    // compute stream, after the backward
    cudaEvent_t downloaded = nullptr;  // download stream, after the copy out
    std::span<float> destination;      // the caller's buffer
  };
  // An interval of a stream's work, timed by two events.
  struct TimedSpan {
    cudaEvent_t begin, end;
    bool compute;  // else transfer
  };

  explicit CudaUnitModel(int device) : device_(device), parallel_(kHostThreads) {}
  absl::Status Init(const ModelSpec& spec, const UnitModelOptions& options);
  absl::Status CheckUnit(int unit, std::span<const float> weights) const;
  // The slot holding `unit`'s weights: the last one filled when it already
  // holds the unit (forward and backward of the last unit), else the next
  // one, refilled from `weights`.
  absl::StatusOr<WeightSlot*> Stage(int unit, std::span<const float> weights);
  // Records a span's begin or end on `stream`, from a pool of timing events.
  absl::StatusOr<cudaEvent_t> Mark(cudaStream_t stream);
  absl::Status AddSpan(cudaEvent_t begin, cudaStream_t stream, bool compute);
  // Starts a new timeline: the streams are idle.
  absl::Status Rebase();
  // A host interval of transfer work, from `start` to now.
  void HostTransfer(absl::Time start) { timeline_.transfer.emplace_back(start, absl::Now()); }

  static constexpr int kHostThreads = 8;

  absl::Status CheckLane(int lane) const;

  ModelSpec spec_;
  std::vector<std::unique_ptr<CudaGpt>> lanes_;  // lane 0 owns the shared workspace
  const int device_;
  std::string name_;
  int64_t max_numel_ = 0;
  cudaStream_t upload_ = nullptr, compute_ = nullptr, download_ = nullptr;
  std::vector<WeightSlot> weights_;
  int last_weight_slot_ = -1;
  int last_forward_unit_ = -1;  // the unit of the last call, if a forward
  std::array<GradientSlot, kMaxPendingBackward> gradients_;
  PendingBackwards pending_;
  ParallelFor parallel_;

  // Timing: every event's time is taken against `origin_`, recorded when
  // the streams were idle at host time `origin_time_`.
  cudaEvent_t origin_ = nullptr;
  absl::Time origin_time_;
  std::vector<cudaEvent_t> timing_events_;
  size_t timing_used_ = 0;
  std::vector<TimedSpan> spans_;
  ModelTimeline timeline_;  // host intervals so far
};

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_MODEL_CUDA_CUDA_UNIT_MODEL_H_
