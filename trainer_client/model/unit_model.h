// What a trainer computes with: the GPT run unit by unit, on the CPU
// (CpuGpt) or on a CUDA device (CudaUnitModel). The trainer hands each unit
// its fp32 weights as fetched and takes back the unit's fp32 gradient; where
// the arithmetic happens, and in which precision, is the model's business.
#ifndef PSHARD_TRAINER_CLIENT_MODEL_UNIT_MODEL_H_
#define PSHARD_TRAINER_CLIENT_MODEL_UNIT_MODEL_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model_spec.h"

namespace pshard {

class UnitModel {
 public:
  virtual ~UnitModel() = default;

  /// Sets the micro-batch (batch*seq_len tokens and next-token targets).
  virtual absl::Status SetBatch(std::span<const int32_t> tokens, std::span<const int32_t> targets) = 0;
  /// Forward of `unit` (0..K-1 in order) with its flat fp32 weights.
  virtual absl::Status ForwardUnit(int unit, std::span<const float> weights) = 0;
  /// Backward of `unit` (K-1..0 after a full forward) with the same weights;
  /// writes the gradient of the mean loss into `grads` (the unit's numel
  /// elements; padding after them is left alone).
  virtual absl::Status BackwardUnit(int unit, std::span<const float> weights, std::span<float> grads) = 0;
  /// Mean cross-entropy of the last full forward, in nats.
  virtual absl::StatusOr<double> Loss() = 0;

  virtual int num_units() const = 0;
  /// Memory held for activations and gradient scratch (on the device).
  virtual int64_t ActivationBytes() const = 0;
  /// Device memory held in all: activations plus the unit buffers the model
  /// keeps there (0 for the CPU model, whose weights are the trainer's).
  virtual int64_t DeviceBytes() const = 0;
  /// Model FLOPs of one forward + backward of a micro-batch (for MFU).
  virtual double FlopsPerMicroBatch() const = 0;
  /// "cpu", or the CUDA device ("cuda:0 NVIDIA H200").
  virtual std::string DeviceName() const = 0;
};

/// The CUDA device a device name means: 0 for "cuda" (and "auto"), N for
/// "cuda:N"; InvalidArgument for anything else but "cpu".
absl::StatusOr<int> CudaDeviceIndex(const std::string& device);

/// The trainer's model on `device`: "cpu", "cuda" or "cuda:N" (CUDA device 0
/// or N; an error in builds without PSHARD_WITH_CUDA or without that
/// device), or "auto"
/// (CUDA when this build has it and a device is present, else the CPU).
/// `recompute_blocks` is the CPU model's activation recomputation.
absl::StatusOr<std::unique_ptr<UnitModel>> CreateUnitModel(const ModelSpec& spec, int batch, int seq_len,
                                                           bool recompute_blocks, const std::string& device);

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_MODEL_UNIT_MODEL_H_
