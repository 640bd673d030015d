// The trainer's choice of model: the CPU GPT, or the CUDA one where built.
#include "trainer_client/model/unit_model.h"

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
    model_.ForwardUnit(unit, weights);
    return absl::OkStatus();
  }
  absl::Status BackwardUnit(int unit, std::span<const float> weights, std::span<float> grads) override {
    model_.BackwardUnit(unit, weights, grads);
    return absl::OkStatus();
  }
  absl::StatusOr<double> Loss() override { return static_cast<double>(model_.loss()); }
  int num_units() const override { return model_.num_units(); }
  int64_t ActivationBytes() const override { return model_.ActivationBytes(); }
  int64_t DeviceBytes() const override { return 0; }
  double FlopsPerMicroBatch() const override { return model_.FlopsPerMicroBatch(); }
  std::string DeviceName() const override { return "cpu"; }

 private:
  CpuGpt<float> model_;
};

absl::StatusOr<std::unique_ptr<UnitModel>> CreateCpu(const ModelSpec& spec, int batch, int seq_len,
                                                     bool recompute_blocks) {
  ASSIGN_OR_RETURN(CpuGpt<float> model, CpuGpt<float>::Create(spec, batch, seq_len, recompute_blocks));
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

absl::StatusOr<std::unique_ptr<UnitModel>> CreateUnitModel(const ModelSpec& spec, int batch, int seq_len,
                                                           bool recompute_blocks, const std::string& device) {
  if (device == "cpu") return CreateCpu(spec, batch, seq_len, recompute_blocks);
  const absl::StatusOr<int> index = CudaDeviceIndex(device);
  if (!index.ok()) return index.status();
#if PSHARD_WITH_CUDA
  if (device == "auto" && CudaDeviceCount() == 0) return CreateCpu(spec, batch, seq_len, recompute_blocks);
  if (recompute_blocks) {
    return absl::UnimplementedError("activation recomputation exists in the CPU model only");
  }
  return CudaUnitModel::Create(spec, batch, seq_len, *index);
#else
  if (device == "auto") return CreateCpu(spec, batch, seq_len, recompute_blocks);
  return absl::FailedPreconditionError(absl::StrCat(
      "device \"", device, "\" was asked for but this build has no CUDA (configure with -DPSHARD_WITH_CUDA=ON)"));
#endif
}

}  // namespace pshard
