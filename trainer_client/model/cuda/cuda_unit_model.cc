#include "trainer_client/model/cuda/cuda_unit_model.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "common/status_macros.h"
#include "trainer_client/model/cuda/cuda_check.h"

namespace pshard {

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return count;
}

absl::StatusOr<std::unique_ptr<UnitModel>> CudaUnitModel::Create(const ModelSpec& spec, int batch, int seq_len,
                                                                  int device) {
  if (CudaDeviceCount() <= device) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device ", device, " is not present (", CudaDeviceCount(), " usable devices)"));
  }
  std::unique_ptr<CudaUnitModel> m(new CudaUnitModel());
  m->spec_ = spec;
  m->device_ = device;
  ASSIGN_OR_RETURN(m->model_, CudaGpt::Create(spec, batch, seq_len, device));
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  cudaDeviceProp prop{};
  CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  m->name_ = absl::StrCat("cuda:", device, " ", prop.name);
  for (const UnitSpec& unit : spec.units) m->max_numel_ = std::max(m->max_numel_, unit.numel);
  const size_t n = static_cast<size_t>(m->max_numel_);
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&m->stream_, cudaStreamNonBlocking));
  CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&m->device_weights_), n * sizeof(__nv_bfloat16)));
  CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&m->device_grads_), n * sizeof(float)));
  CUDA_RETURN_IF_ERROR(cudaMallocHost(reinterpret_cast<void**>(&m->host_weights_), n * sizeof(uint16_t)));
  CUDA_RETURN_IF_ERROR(cudaMallocHost(reinterpret_cast<void**>(&m->host_grads_), n * sizeof(float)));
  return std::unique_ptr<UnitModel>(std::move(m));
}

CudaUnitModel::~CudaUnitModel() {
  // Errors cannot be reported from here; the buffers go with the context.
  cudaSetDevice(device_);
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  cudaFree(device_weights_);
  cudaFree(device_grads_);
  cudaFreeHost(host_weights_);
  cudaFreeHost(host_grads_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

int64_t CudaUnitModel::DeviceBytes() const {
  return model_->ActivationBytes() + max_numel_ * static_cast<int64_t>(sizeof(__nv_bfloat16) + sizeof(float));
}

absl::Status CudaUnitModel::SetBatch(std::span<const int32_t> tokens, std::span<const int32_t> targets) {
  return model_->SetBatch(tokens, targets);
}

absl::Status CudaUnitModel::Upload(int unit, std::span<const float> weights) {
  if (unit < 0 || unit >= num_units()) return absl::InvalidArgumentError(absl::StrCat("unknown unit ", unit));
  const int64_t numel = spec_.units[unit].numel;
  if (static_cast<int64_t>(weights.size()) < numel) {
    return absl::InvalidArgumentError(
        absl::StrCat("unit ", unit, ": ", weights.size(), " weights for ", numel, " parameters"));
  }
  // The previous call's copy out of the staging buffer is done: every call
  // ends by waiting for its stream.
  EncodeBf16(weights.first(numel), std::span<uint16_t>(host_weights_, numel));
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(device_weights_, host_weights_, numel * sizeof(uint16_t),
                                       cudaMemcpyHostToDevice, stream_));
  return absl::OkStatus();
}

absl::Status CudaUnitModel::ForwardUnit(int unit, std::span<const float> weights) {
  RETURN_IF_ERROR(Upload(unit, weights));
  RETURN_IF_ERROR(model_->ForwardUnit(unit, device_weights_, stream_));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::Status CudaUnitModel::BackwardUnit(int unit, std::span<const float> weights, std::span<float> grads) {
  const int64_t numel = spec_.units[unit].numel;
  if (static_cast<int64_t>(grads.size()) < numel) {
    return absl::InvalidArgumentError(
        absl::StrCat("unit ", unit, ": room for ", grads.size(), " gradients, ", numel, " needed"));
  }
  RETURN_IF_ERROR(Upload(unit, weights));
  RETURN_IF_ERROR(model_->BackwardUnit(unit, device_weights_, device_grads_, stream_));
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host_grads_, device_grads_, numel * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  std::memcpy(grads.data(), host_grads_, numel * sizeof(float));
  return absl::OkStatus();
}

absl::StatusOr<double> CudaUnitModel::Loss() {
  ASSIGN_OR_RETURN(float loss, model_->Loss(stream_));
  return static_cast<double>(loss);
}

}  // namespace pshard
