// The GPU half of a trainer, the CUDA model and the NCCL fabric group, is a
// plugin (libpshard_gpu.so) that a trainer loads only when it is asked for a
// GPU. So one CUDA build serves CPU trainers and shard servers too, on
// machines without a GPU or without CUDA's libraries, and CPU trainers carry
// none of cuBLAS's and NCCL's static thread-local storage: about 190 KiB in
// every thread, more than the stacks some libraries give their threads
// (civetweb, which serves /metrics, gives 100 KiB).
#ifndef PSHARD_TRAINER_CLIENT_GPU_PLUGIN_H_
#define PSHARD_TRAINER_CLIENT_GPU_PLUGIN_H_

#include <memory>

#include "absl/status/statusor.h"
#include "common/model_spec.h"
#include "trainer_client/group/group_collective.h"
#include "trainer_client/model/unit_model.h"

namespace pshard {

/// What the plugin offers. Its functions are thread-safe where the ones
/// they stand for are (see cuda_unit_model.h and nccl_group.h).
struct GpuPlugin {
  /// The pshard version and a digest of the layout of this struct and the
  /// types it passes: a plugin of another build is refused.
  const char* version;
  int abi;
  /// Usable CUDA devices (0 without a driver or devices).
  int (*device_count)();
  /// Dense bf16 FLOP/s of `device` that MFU is measured against (0: unknown).
  double (*peak_bf16_flops)(int device);
  /// The CUDA unit model on `device`.
  absl::StatusOr<std::unique_ptr<UnitModel>> (*create_model)(const ModelSpec& spec, const UnitModelOptions& options,
                                                             int device);
  /// Joins member `rank` of an NCCL fabric group of `size` on `device`;
  /// null when the plugin was built without NCCL.
  absl::StatusOr<std::unique_ptr<GroupCollective>> (*join_nccl_group)(int rank, int size, int device,
                                                                      const RendezvousFn& rendezvous);
};

/// The value of GpuPlugin::abi for this build: it changes with the size of
/// what crosses the boundary.
constexpr int GpuPluginAbi() {
  return static_cast<int>(sizeof(GpuPlugin) * 131 + sizeof(ModelSpec) * 31 + sizeof(UnitModelOptions) * 7 +
                          sizeof(ModelMemory));
}

/// The symbol libpshard_gpu.so exports: `const GpuPlugin* pshard_gpu_plugin_v1()`.
inline constexpr char kGpuPluginEntry[] = "pshard_gpu_plugin_v1";
/// The plugin's file name.
inline constexpr char kGpuPluginFile[] = "libpshard_gpu.so";

/// Loads the plugin on first use: from the folder of this executable, else
/// through the dynamic linker's search path. Later calls return the same
/// plugin or the same error, which says why it cannot be loaded (a build
/// without CUDA, the library or CUDA's own libraries missing, another
/// build's plugin). Thread-safe.
absl::StatusOr<const GpuPlugin*> LoadGpuPlugin();

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_GPU_PLUGIN_H_
