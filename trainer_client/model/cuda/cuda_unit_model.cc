#include "trainer_client/model/cuda/cuda_unit_model.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "common/reduction_tree.h"
#include "common/status_macros.h"
#include "trainer_client/model/cuda/cuda_check.h"
#include "trainer_client/model/cuda/kernels.h"

namespace pshard {
namespace {

// Elements per host chunk: large enough that splitting a unit across
// threads costs nothing next to the copy.
constexpr int64_t kHostGrain = int64_t{1} << 18;

}  // namespace

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return count;
}

double CudaPeakBf16Flops(int device) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    return 0.0;
  }
  // Datasheet dense rates (no sparsity), the more specific names first.
  struct Part {
    const char* name;
    double tflops;
  };
  static constexpr Part kParts[] = {{"H100 PCIe", 756}, {"H100 NVL", 835}, {"H100", 989}, {"H200", 989},
                                    {"B200", 2250},     {"A100", 312},     {"A800", 312}, {"L40S", 362},
                                    {"L40", 181},       {"L4", 121}};
  const std::string name = prop.name;
  for (const Part& part : kParts) {
    if (name.find(part.name) != std::string::npos) return part.tflops * 1e12;
  }
  // Dense bf16 FLOP per SM per clock: Hopper 4096, A100 2048, others 1024.
  const double per_sm = prop.major >= 9 ? 4096.0 : (prop.major == 8 && prop.minor == 0 ? 2048.0 : 1024.0);
  int clock_khz = 0;
  if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device) != cudaSuccess) {
    cudaGetLastError();
    return 0.0;
  }
  return per_sm * prop.multiProcessorCount * clock_khz * 1e3;
}

absl::StatusOr<std::unique_ptr<UnitModel>> CudaUnitModel::Create(const ModelSpec& spec,
                                                                  const UnitModelOptions& options, int device) {
  if (CudaDeviceCount() <= device) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device ", device, " is not present (", CudaDeviceCount(), " usable devices)"));
  }
  if (options.prefetch_depth < 0) {
    return absl::InvalidArgumentError(absl::StrCat("prefetch depth ", options.prefetch_depth, " < 0"));
  }
  std::unique_ptr<CudaUnitModel> m(new CudaUnitModel(device));
  RETURN_IF_ERROR(m->Init(spec, options));
  return std::unique_ptr<UnitModel>(std::move(m));
}

absl::Status CudaUnitModel::Init(const ModelSpec& spec, const UnitModelOptions& options) {
  spec_ = spec;
  CudaGptOptions gpt;
  gpt.batch = options.batch;
  gpt.seq_len = options.seq_len;
  gpt.device = device_;
  gpt.recompute_blocks = options.recompute_blocks;
  ASSIGN_OR_RETURN(gpt.attention, ParseCudaAttention(options.attention));
  for (int m = 0; m < options.lanes; ++m) {
    ASSIGN_OR_RETURN(std::unique_ptr<CudaGpt> lane,
                     CudaGpt::Create(spec, gpt, m == 0 ? nullptr : lanes_[0].get()));
    lanes_.push_back(std::move(lane));
  }
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  cudaDeviceProp prop{};
  CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device_));
  name_ = absl::StrCat("cuda:", device_, " ", prop.name,
                       lanes_[0]->fused_attention() ? " (fused attention)" : " (materialized attention)");
  for (const UnitSpec& unit : spec.units) max_numel_ = std::max(max_numel_, unit.numel);
  const size_t n = static_cast<size_t>(max_numel_);
  for (cudaStream_t* stream : {&upload_, &compute_, &download_}) {
    CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(stream, cudaStreamNonBlocking));
  }
  weights_.resize(options.prefetch_depth + 1);
  for (WeightSlot& w : weights_) {
    CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&w.device), n * sizeof(__nv_bfloat16)));
    CUDA_RETURN_IF_ERROR(cudaMallocHost(reinterpret_cast<void**>(&w.staging), n * sizeof(uint16_t)));
    CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&w.uploaded, cudaEventDisableTiming));
    CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&w.consumed, cudaEventDisableTiming));
  }
  for (GradientSlot& g : gradients_) {
    g.buffers.assign(InOrderTreeSum::SlotsNeeded(options.lanes), nullptr);
    for (float*& buffer : g.buffers) {
      CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&buffer), n * sizeof(float)));
    }
    CUDA_RETURN_IF_ERROR(cudaMallocHost(reinterpret_cast<void**>(&g.staging), n * sizeof(float)));
    CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&g.computed, cudaEventDisableTiming));
    CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&g.downloaded, cudaEventDisableTiming));
  }
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&origin_));
  return Rebase();
}

CudaUnitModel::~CudaUnitModel() {
  // Errors cannot be reported from here; each release is attempted anyway.
  cudaSetDevice(device_);
  for (cudaStream_t stream : {upload_, compute_, download_}) {
    if (stream != nullptr) cudaStreamSynchronize(stream);
  }
  for (WeightSlot& w : weights_) {
    cudaFree(w.device);
    cudaFreeHost(w.staging);
    if (w.uploaded != nullptr) cudaEventDestroy(w.uploaded);
    if (w.consumed != nullptr) cudaEventDestroy(w.consumed);
  }
  for (GradientSlot& g : gradients_) {
    for (float* buffer : g.buffers) cudaFree(buffer);
    cudaFreeHost(g.staging);
    if (g.computed != nullptr) cudaEventDestroy(g.computed);
    if (g.downloaded != nullptr) cudaEventDestroy(g.downloaded);
  }
  for (cudaEvent_t e : timing_events_) cudaEventDestroy(e);
  if (origin_ != nullptr) cudaEventDestroy(origin_);
  for (cudaStream_t stream : {upload_, compute_, download_}) {
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
}

ModelMemory CudaUnitModel::Memory() const {
  ModelMemory m;
  for (const auto& lane : lanes_) m.activations += lane->ActivationBytes();
  m.weights = static_cast<int64_t>(weights_.size()) * max_numel_ * static_cast<int64_t>(sizeof(__nv_bfloat16));
  m.gradients = static_cast<int64_t>(gradients_.size() * gradients_[0].buffers.size()) * max_numel_ *
                static_cast<int64_t>(sizeof(float));
  m.device = m.activations + m.weights + m.gradients;
  return m;
}

absl::Status CudaUnitModel::CheckLane(int lane) const {
  if (lane < 0 || lane >= lanes()) {
    return absl::InvalidArgumentError(absl::StrCat("lane ", lane, " of a model with ", lanes(), " lanes"));
  }
  return absl::OkStatus();
}

absl::Status CudaUnitModel::SetBatch(int lane, std::span<const int32_t> tokens,
                                     std::span<const int32_t> targets) {
  RETURN_IF_ERROR(CheckLane(lane));
  last_forward_unit_ = -1;
  return lanes_[lane]->SetBatch(tokens, targets);
}

absl::Status CudaUnitModel::CheckUnit(int unit, std::span<const float> weights) const {
  if (unit < 0 || unit >= num_units()) return absl::InvalidArgumentError(absl::StrCat("unknown unit ", unit));
  const int64_t numel = spec_.units[unit].numel;
  if (static_cast<int64_t>(weights.size()) < numel) {
    return absl::InvalidArgumentError(
        absl::StrCat("unit ", unit, ": ", weights.size(), " weights for ", numel, " parameters"));
  }
  return absl::OkStatus();
}

absl::StatusOr<CudaUnitModel::WeightSlot*> CudaUnitModel::Stage(int unit, std::span<const float> weights) {
  const int index = (last_weight_slot_ + 1) % static_cast<int>(weights_.size());
  WeightSlot& slot = weights_[index];
  slot.unit = -1;  // until refilled
  const absl::Time start = absl::Now();
  // The staging buffer's previous copy in must be done before it is
  // overwritten (with depth + 1 slots that copy is long finished unless the
  // device is far behind).
  CUDA_RETURN_IF_ERROR(cudaEventSynchronize(slot.uploaded));
  const int64_t numel = spec_.units[unit].numel;
  parallel_.Run(numel, kHostGrain, [&](int64_t begin, int64_t end) {
    EncodeBf16(weights.subspan(begin, end - begin), std::span<uint16_t>(slot.staging + begin, end - begin));
  });
  HostTransfer(start);
  // The device buffer is free once the compute that read it is done.
  CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(upload_, slot.consumed, 0));
  ASSIGN_OR_RETURN(cudaEvent_t begin, Mark(upload_));
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(slot.device, slot.staging, numel * sizeof(uint16_t), cudaMemcpyHostToDevice, upload_));
  RETURN_IF_ERROR(AddSpan(begin, upload_, /*compute=*/false));
  CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.uploaded, upload_));
  CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute_, slot.uploaded, 0));
  slot.unit = unit;
  last_weight_slot_ = index;
  return &slot;
}

absl::Status CudaUnitModel::ForwardUnit(int unit, std::span<const float> weights) {
  RETURN_IF_ERROR(CheckUnit(unit, weights));
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));  // events are made on the current device
  last_forward_unit_ = -1;
  ASSIGN_OR_RETURN(WeightSlot * slot, Stage(unit, weights));
  ASSIGN_OR_RETURN(cudaEvent_t begin, Mark(compute_));
  for (const auto& lane : lanes_) RETURN_IF_ERROR(lane->ForwardUnit(unit, slot->device, compute_));
  RETURN_IF_ERROR(AddSpan(begin, compute_, /*compute=*/true));
  CUDA_RETURN_IF_ERROR(cudaEventRecord(slot->consumed, compute_));
  last_forward_unit_ = unit;
  return absl::OkStatus();
}

absl::Status CudaUnitModel::BackwardUnit(int unit, std::span<const float> weights, std::span<float> grads) {
  RETURN_IF_ERROR(CheckUnit(unit, weights));
  const int64_t numel = spec_.units[unit].numel;
  if (static_cast<int64_t>(grads.size()) < numel) {
    return absl::InvalidArgumentError(
        absl::StrCat("unit ", unit, ": room for ", grads.size(), " gradients, ", numel, " needed"));
  }
  // The unit forwarded last (the head) is still in its slot: its backward
  // runs from there, without a second copy.
  const bool resident = last_forward_unit_ == unit && weights_[last_weight_slot_].unit == unit;
  last_forward_unit_ = -1;
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));  // events are made on the current device
  RETURN_IF_ERROR(pending_.Start(unit));
  GradientSlot& g = gradients_[pending_.slot(pending_.size() - 1)];
  WeightSlot* slot = nullptr;
  if (resident) {
    slot = &weights_[last_weight_slot_];
  } else {
    ASSIGN_OR_RETURN(slot, Stage(unit, weights));
  }
  // The gradient buffer is free once its previous copy out is done.
  CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute_, g.downloaded, 0));
  ASSIGN_OR_RETURN(cudaEvent_t begin, Mark(compute_));
  InOrderTreeSum sum(lanes());
  for (const auto& lane : lanes_) {
    RETURN_IF_ERROR(lane->BackwardUnit(unit, slot->device, g.buffers[sum.NextSlot()], compute_));
    for (int s : sum.AddLeaf()) {
      CUDA_RETURN_IF_ERROR(internal::AddInPlace(g.buffers[s - 1], g.buffers[s], numel, compute_));
    }
  }
  RETURN_IF_ERROR(AddSpan(begin, compute_, /*compute=*/true));
  CUDA_RETURN_IF_ERROR(cudaEventRecord(slot->consumed, compute_));
  CUDA_RETURN_IF_ERROR(cudaEventRecord(g.computed, compute_));
  // Copy out on its own stream, while the next unit's backward computes.
  CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(download_, g.computed, 0));
  ASSIGN_OR_RETURN(begin, Mark(download_));
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(g.staging, g.buffers[0], numel * sizeof(float), cudaMemcpyDeviceToHost, download_));
  RETURN_IF_ERROR(AddSpan(begin, download_, /*compute=*/false));
  CUDA_RETURN_IF_ERROR(cudaEventRecord(g.downloaded, download_));
  g.destination = grads.first(numel);
  return absl::OkStatus();
}

absl::Status CudaUnitModel::FinishBackward(int unit) {
  const int index = pending_.size() > 0 ? pending_.slot(0) : 0;
  RETURN_IF_ERROR(pending_.Finish(unit));
  GradientSlot& g = gradients_[index];
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  const absl::Time start = absl::Now();
  CUDA_RETURN_IF_ERROR(cudaEventSynchronize(g.downloaded));
  const std::span<float> out = std::exchange(g.destination, {});
  parallel_.Run(static_cast<int64_t>(out.size()), kHostGrain, [&](int64_t begin, int64_t end) {
    std::memcpy(out.data() + begin, g.staging + begin, (end - begin) * sizeof(float));
  });
  HostTransfer(start);
  return absl::OkStatus();
}

absl::StatusOr<double> CudaUnitModel::Loss(int lane) {
  RETURN_IF_ERROR(CheckLane(lane));
  ASSIGN_OR_RETURN(float loss, lanes_[lane]->Loss(compute_));
  return static_cast<double>(loss);
}

// ---------------------------------------------------------------- timeline

absl::StatusOr<cudaEvent_t> CudaUnitModel::Mark(cudaStream_t stream) {
  if (timing_used_ == timing_events_.size()) {
    cudaEvent_t event = nullptr;
    CUDA_RETURN_IF_ERROR(cudaEventCreate(&event));
    timing_events_.push_back(event);
  }
  cudaEvent_t event = timing_events_[timing_used_++];
  CUDA_RETURN_IF_ERROR(cudaEventRecord(event, stream));
  return event;
}

absl::Status CudaUnitModel::AddSpan(cudaEvent_t begin, cudaStream_t stream, bool compute) {
  ASSIGN_OR_RETURN(cudaEvent_t end, Mark(stream));
  spans_.push_back({begin, end, compute});
  return absl::OkStatus();
}

absl::Status CudaUnitModel::Rebase() {
  const absl::Time before = absl::Now();
  CUDA_RETURN_IF_ERROR(cudaEventRecord(origin_, compute_));
  CUDA_RETURN_IF_ERROR(cudaEventSynchronize(origin_));
  // The streams are idle, so the event passed as soon as it was recorded.
  origin_time_ = before + (absl::Now() - before) / 2;
  timing_used_ = 0;
  spans_.clear();
  return absl::OkStatus();
}

absl::StatusOr<ModelTimeline> CudaUnitModel::TakeTimeline() {
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  for (cudaStream_t stream : {upload_, compute_, download_}) CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  ModelTimeline out = std::exchange(timeline_, {});
  for (const TimedSpan& span : spans_) {
    float begin_ms = 0, end_ms = 0;
    CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&begin_ms, origin_, span.begin));
    CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&end_ms, origin_, span.end));
    (span.compute ? out.compute : out.transfer)
        .emplace_back(origin_time_ + absl::Microseconds(1000.0 * begin_ms),
                      origin_time_ + absl::Microseconds(1000.0 * end_ms));
  }
  RETURN_IF_ERROR(Rebase());
  return out;
}

}  // namespace pshard
