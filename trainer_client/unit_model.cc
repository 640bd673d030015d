// The trainer's choice of model: the CPU GPT, or the CUDA one from the GPU
// plugin.
#include "trainer_client/model/unit_model.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/reduction_tree.h"
#include "common/status_macros.h"
#include "trainer_client/gpu_plugin.h"
#include "trainer_client/model/gpt.h"

namespace pshard {
namespace {

class CpuUnitModel final : public UnitModel {
 public:
  CpuUnitModel(const ModelSpec& spec, std::vector<CpuGpt<float>> lanes) : lanes_(std::move(lanes)) {
    for (const UnitSpec& unit : spec.units) unit_numel_.push_back(unit.numel);
  }

  absl::Status SetBatch(int lane, std::span<const int32_t> tokens, std::span<const int32_t> targets) override {
    RETURN_IF_ERROR(CheckLane(lane));
    return lanes_[lane].SetBatch(tokens, targets);
  }
  absl::Status ForwardUnit(int unit, std::span<const float> weights) override {
    RETURN_IF_ERROR(CheckUnit(unit));
    const absl::Time start = absl::Now();
    for (CpuGpt<float>& lane : lanes_) lane.ForwardUnit(unit, weights);
    timeline_.compute.emplace_back(start, absl::Now());
    return absl::OkStatus();
  }
  absl::Status BackwardUnit(int unit, std::span<const float> weights, std::span<float> grads) override {
    RETURN_IF_ERROR(CheckUnit(unit));
    RETURN_IF_ERROR(pending_.Start(unit));
    const absl::Time start = absl::Now();
    if (lanes_.size() == 1) {
      lanes_[0].BackwardUnit(unit, weights, grads);
    } else {
      const size_t numel = static_cast<size_t>(unit_numel_[unit]);
      TreeReducer sum(lanes());
      for (int m = 0; m < lanes(); ++m) {
        std::vector<float> lane_grads(numel);
        lanes_[m].BackwardUnit(unit, weights, lane_grads);
        RETURN_IF_ERROR(sum.Add(m, 1, std::move(lane_grads)));
      }
      const std::vector<float> total = sum.TakeTotal();
      std::copy(total.begin(), total.end(), grads.begin());
    }
    timeline_.compute.emplace_back(start, absl::Now());
    return absl::OkStatus();
  }
  absl::Status FinishBackward(int unit) override { return pending_.Finish(unit); }
  absl::StatusOr<double> Loss(int lane) override {
    RETURN_IF_ERROR(CheckLane(lane));
    return static_cast<double>(lanes_[lane].loss());
  }
  absl::StatusOr<ModelTimeline> TakeTimeline() override { return std::exchange(timeline_, {}); }
  int num_units() const override { return lanes_[0].num_units(); }
  int lanes() const override { return static_cast<int>(lanes_.size()); }
  ModelMemory Memory() const override {
    ModelMemory m;
    for (const CpuGpt<float>& lane : lanes_) m.activations += lane.ActivationBytes();
    return m;
  }
  double FlopsPerMicroBatch() const override { return lanes_[0].FlopsPerMicroBatch(); }
  std::string DeviceName() const override { return "cpu"; }
  bool asynchronous() const override { return false; }

 private:
  absl::Status CheckUnit(int unit) const {
    if (unit < 0 || unit >= num_units()) return absl::InvalidArgumentError(absl::StrCat("unknown unit ", unit));
    return absl::OkStatus();
  }
  absl::Status CheckLane(int lane) const {
    if (lane < 0 || lane >= lanes()) {
      return absl::InvalidArgumentError(absl::StrCat("lane ", lane, " of a model with ", lanes(), " lanes"));
    }
    return absl::OkStatus();
  }

  std::vector<CpuGpt<float>> lanes_;
  std::vector<int64_t> unit_numel_;
  PendingBackwards pending_;
  ModelTimeline timeline_;
};

absl::StatusOr<std::unique_ptr<UnitModel>> CreateCpu(const ModelSpec& spec, const UnitModelOptions& options) {
  std::vector<CpuGpt<float>> lanes;
  for (int m = 0; m < options.lanes; ++m) {
    ASSIGN_OR_RETURN(CpuGpt<float> lane,
                     CpuGpt<float>::Create(spec, options.batch, options.seq_len, options.recompute_blocks));
    lanes.push_back(std::move(lane));
  }
  return std::make_unique<CpuUnitModel>(spec, std::move(lanes));
}

}  // namespace

absl::StatusOr<int> CudaDeviceIndex(const std::string& device) {
  if (device == "cuda" || device == "auto") return 0;
  int index = 0;
  if (device.rfind("cuda:", 0) == 0) {
    if (!absl::SimpleAtoi(device.substr(5), &index) || index < 0) {
      return absl::InvalidArgumentError(absl::StrCat("device \"", device, "\": expected cuda:N with N >= 0"));
    }
    return index;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown device \"", device, "\"; expected cpu, cuda, cuda:N or auto"));
}

absl::StatusOr<std::unique_ptr<UnitModel>> CreateUnitModel(const ModelSpec& spec, const UnitModelOptions& options) {
  if (options.lanes < 1) return absl::InvalidArgumentError(absl::StrCat("a model needs >= 1 lanes, not ", options.lanes));
  if (options.attention != "auto" && options.attention != "fused" && options.attention != "materialized") {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown attention \"", options.attention, "\"; expected auto, fused or materialized"));
  }
  const std::string& device = options.device;
  if (device == "cpu") return CreateCpu(spec, options);
  const absl::StatusOr<int> index = CudaDeviceIndex(device);
  if (!index.ok()) return index.status();
  const absl::StatusOr<const GpuPlugin*> gpu = LoadGpuPlugin();
  if (device == "auto" && (!gpu.ok() || (*gpu)->device_count() == 0)) return CreateCpu(spec, options);
  if (!gpu.ok()) {
    return absl::Status(gpu.status().code(),
                        absl::StrCat("device \"", device, "\" was asked for but ", gpu.status().message()));
  }
  return (*gpu)->create_model(spec, options, *index);
}

}  // namespace pshard
