// The trainer's choice of model: the CPU GPT, or the CUDA one where built.
#include "trainer_client/model/unit_model.h"

#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "pshard/config.h"
#include "trainer_client/model/gpt.h"
#if PSHARD_WITH_CUDA
#include "trainer_client/model/cuda/cuda_unit_model.h"
#endif

namespace pshard {
namespace {

class CpuUnitModel final : public UnitModel {
 public:
  explicit CpuUnitModel(CpuGpt<float> model) : model_(std::move(model)) {}

  absl::Status SetBatch(std::span<const int32_t> tokens, std::span<const int32_t> targets) override {
    return model_.SetBatch(tokens, targets);
  }
  absl::Status ForwardUnit(int unit, std::span<const float> weights) override {
    const absl::Time start = absl::Now();
    model_.ForwardUnit(unit, weights);
    timeline_.compute.emplace_back(start, absl::Now());
    return absl::OkStatus();
  }
  absl::Status BackwardUnit(int unit, std::span<const float> weights, std::span<float> grads) override {
    RETURN_IF_ERROR(pending_.Start(unit));
    const absl::Time start = absl::Now();
    model_.BackwardUnit(unit, weights, grads);
    timeline_.compute.emplace_back(start, absl::Now());
    return absl::OkStatus();
  }
  absl::Status FinishBackward(int unit) override { return pending_.Finish(unit); }
  absl::StatusOr<double> Loss() override { return static_cast<double>(model_.loss()); }
  absl::StatusOr<ModelTimeline> TakeTimeline() override { return std::exchange(timeline_, {}); }
  int num_units() const override { return model_.num_units(); }
  ModelMemory Memory() const override { return {.activations = model_.ActivationBytes()}; }
  double FlopsPerMicroBatch() const override { return model_.FlopsPerMicroBatch(); }
  std::string DeviceName() const override { return "cpu"; }
  bool asynchronous() const override { return false; }

 private:
  CpuGpt<float> model_;
  PendingBackwards pending_;
  ModelTimeline timeline_;
};

absl::StatusOr<std::unique_ptr<UnitModel>> CreateCpu(const ModelSpec& spec, const UnitModelOptions& options) {
  ASSIGN_OR_RETURN(CpuGpt<float> model,
                   CpuGpt<float>::Create(spec, options.batch, options.seq_len, options.recompute_blocks));
  return std::make_unique<CpuUnitModel>(std::move(model));
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
  const std::string& device = options.device;
  if (device == "cpu") return CreateCpu(spec, options);
  const absl::StatusOr<int> index = CudaDeviceIndex(device);
  if (!index.ok()) return index.status();
#if PSHARD_WITH_CUDA
  if (device == "auto" && CudaDeviceCount() == 0) return CreateCpu(spec, options);
  return CudaUnitModel::Create(spec, options, *index);
#else
  if (device == "auto") return CreateCpu(spec, options);
  return absl::FailedPreconditionError(absl::StrCat(
      "device \"", device, "\" was asked for but this build has no CUDA (configure with -DPSHARD_WITH_CUDA=ON)"));
#endif
}

}  // namespace pshard
