// The entry point of libpshard_gpu.so (see gpu_plugin.h): the CUDA model and,
// in NCCL builds, the NCCL fabric group.
#include "pshard/config.h"
#include "pshard/cuda_config.h"
#include "trainer_client/gpu_plugin.h"
#include "trainer_client/model/cuda/cuda_unit_model.h"
#if PSHARD_WITH_NCCL
#include "trainer_client/group/nccl/nccl_group.h"
#endif

namespace pshard {
namespace {

const GpuPlugin& Plugin() {
  static const GpuPlugin plugin = {
      PSHARD_VERSION,
      GpuPluginAbi(),
      &CudaDeviceCount,
      &CudaPeakBf16Flops,
      &CudaUnitModel::Create,
#if PSHARD_WITH_NCCL
      &JoinNcclGroup,
#else
      nullptr,
#endif
  };
  return plugin;
}

}  // namespace
}  // namespace pshard

extern "C" __attribute__((visibility("default"))) const pshard::GpuPlugin* pshard_gpu_plugin_v1() {
  return &pshard::Plugin();
}
