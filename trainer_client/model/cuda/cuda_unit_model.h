// The trainer's model on a CUDA device: CudaGpt behind the UnitModel
// interface. Each unit's fp32 weights are rounded to bf16 into pinned host
// memory and copied to the device; each gradient comes back through pinned
// memory. Every call waits for its own work (transfers overlap the network
// on the trainer's other threads, not yet the device's own compute).
#ifndef PSHARD_TRAINER_CLIENT_MODEL_CUDA_CUDA_UNIT_MODEL_H_
#define PSHARD_TRAINER_CLIENT_MODEL_CUDA_CUDA_UNIT_MODEL_H_

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <memory>
#include <string>

#include "trainer_client/model/cuda/cuda_gpt.h"
#include "trainer_client/model/unit_model.h"

namespace pshard {

/// Usable CUDA devices (0 when the driver or the devices are missing).
int CudaDeviceCount();

class CudaUnitModel final : public UnitModel {
 public:
  static absl::StatusOr<std::unique_ptr<UnitModel>> Create(const ModelSpec& spec, int batch, int seq_len,
                                                           int device);
  ~CudaUnitModel() override;

  absl::Status SetBatch(std::span<const int32_t> tokens, std::span<const int32_t> targets) override;
  absl::Status ForwardUnit(int unit, std::span<const float> weights) override;
  absl::Status BackwardUnit(int unit, std::span<const float> weights, std::span<float> grads) override;
  absl::StatusOr<double> Loss() override;
  int num_units() const override { return model_->num_units(); }
  int64_t ActivationBytes() const override { return model_->ActivationBytes(); }
  int64_t DeviceBytes() const override;
  double FlopsPerMicroBatch() const override { return model_->FlopsPerMicroBatch(); }
  std::string DeviceName() const override { return name_; }

 private:
  CudaUnitModel() = default;
  // Rounds `weights` (the unit's numel elements) to bf16 and copies them to
  // the device buffer.
  absl::Status Upload(int unit, std::span<const float> weights);

  ModelSpec spec_;
  std::unique_ptr<CudaGpt> model_;
  int device_ = 0;
  std::string name_;
  cudaStream_t stream_ = nullptr;
  int64_t max_numel_ = 0;
  __nv_bfloat16* device_weights_ = nullptr;  // [max_numel_]
  float* device_grads_ = nullptr;            // [max_numel_]
  uint16_t* host_weights_ = nullptr;         // pinned, [max_numel_]
  float* host_grads_ = nullptr;              // pinned, [max_numel_]
};

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_MODEL_CUDA_CUDA_UNIT_MODEL_H_
