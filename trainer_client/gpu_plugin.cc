#include "trainer_client/gpu_plugin.h"

#include <dlfcn.h>
#include <unistd.h>

#include <climits>
#include <string>

#include "absl/strings/str_cat.h"
#include "pshard/config.h"
#include "pshard/cuda_config.h"

namespace pshard {
namespace {

#if PSHARD_WITH_CUDA
// The folder of the running executable ("" if unknown).
std::string ExecutableDir() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "";
  const std::string path(buf, static_cast<size_t>(n));
  return path.substr(0, path.rfind('/'));
}
#endif

absl::StatusOr<const GpuPlugin*> Load() {
#if PSHARD_WITH_CUDA
  const std::string beside = absl::StrCat(ExecutableDir(), "/", kGpuPluginFile);
  void* handle = dlopen(beside.c_str(), RTLD_NOW | RTLD_LOCAL);
  std::string why;
  if (handle == nullptr) {
    why = dlerror();
    handle = dlopen(kGpuPluginFile, RTLD_NOW | RTLD_LOCAL);
  }
  if (handle == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("cannot load the GPU plugin: ", why, "; and through the "
                                                      "library path: ", dlerror()));
  }
  using Entry = const GpuPlugin* (*)();
  const auto entry = reinterpret_cast<Entry>(dlsym(handle, kGpuPluginEntry));
  if (entry == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("the GPU plugin ", kGpuPluginFile, " has no entry point ", kGpuPluginEntry));
  }
  const GpuPlugin* plugin = entry();
  if (plugin == nullptr || std::string(plugin->version) != PSHARD_VERSION || plugin->abi != GpuPluginAbi()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the GPU plugin ", kGpuPluginFile, " belongs to another build of pshard (version ",
        plugin == nullptr ? "?" : plugin->version, ", interface ", plugin == nullptr ? 0 : plugin->abi,
        "; this trainer: ", PSHARD_VERSION, ", ", GpuPluginAbi(), "): install the two from one build"));
  }
  return plugin;  // stays loaded for the life of the process
#else
  return absl::FailedPreconditionError("this build has no CUDA (configure with -DPSHARD_WITH_CUDA=ON)");
#endif
}

}  // namespace

absl::StatusOr<const GpuPlugin*> LoadGpuPlugin() {
  static const absl::StatusOr<const GpuPlugin*>* const loaded = new absl::StatusOr<const GpuPlugin*>(Load());
  return *loaded;
}

}  // namespace pshard
