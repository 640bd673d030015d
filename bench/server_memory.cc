// Shard server resident memory for a ~100M-parameter GPT over N servers,
// against the 16 bytes per parameter / N that mixed-precision AdamW state
// costs (goal: ratio <= 1.1). Starts a real pshard-server process.
#include <signal.h>
#include <stdlib.h>

#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "bench/bench_util.h"
#include "common/model_spec.h"
#include "common/partition.h"
#include "tools/process.h"

ABSL_FLAG(std::string, bin_dir, PSHARD_BIN_DIR, "folder of pshard-server");
ABSL_FLAG(int, servers, 4, "N: the model is sharded over this many servers");
ABSL_FLAG(int, layers, 14, "transformer blocks");
ABSL_FLAG(int, d_model, 768, "model width");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int n = absl::GetFlag(FLAGS_servers);
  pshard::GptConfig config{.num_layers = absl::GetFlag(FLAGS_layers), .d_model = absl::GetFlag(FLAGS_d_model),
                           .num_heads = 12, .context = 1024, .vocab = 256};
  auto spec = pshard::MakeGptSpec(config);
  if (!spec.ok()) return pshard::bench::Fail(spec.status());
  const double params = static_cast<double>(spec->TotalParameters());

  char tmpl[] = "/tmp/pshard-mem-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::string port_file = dir + "/port";
  // Shard 0 of N: its state is allocated and initialised before it serves.
  auto server = pshard::ChildProcess::Spawn(
      {absl::GetFlag(FLAGS_bin_dir) + "/pshard-server", "--shard_index=0", absl::StrCat("--num_shards=", n),
       "--num_trainers=1", absl::StrCat("--layers=", config.num_layers), absl::StrCat("--d_model=", config.d_model),
       "--heads=12", "--context=1024", absl::StrCat("--port_file=", port_file)},
      dir + "/server.log");
  if (!server.ok()) return pshard::bench::Fail(server.status());
  auto port = pshard::WaitForPortFile(port_file, *server, absl::Seconds(120));
  if (!port.ok()) return pshard::bench::Fail(port.status());
  absl::SleepFor(absl::Milliseconds(500));
  auto mem = pshard::bench::ReadProcessMemory(server->pid());
  server->Signal(SIGTERM);
  server->WaitUntil(absl::Now() + absl::Seconds(10));
  if (!mem.ok()) return pshard::bench::Fail(mem.status());

  const double expected = 16.0 * params / n;
  std::printf("shard server memory: GPT %d layers x %d (%.1fM parameters), shard 0 of %d\n", config.num_layers,
              config.d_model, params / 1e6, n);
  std::printf("  resident      : %.1f MiB (peak %.1f MiB)\n", mem->rss / 1048576.0, mem->peak_rss / 1048576.0);
  std::printf("  16 * P / N    : %.1f MiB\n", expected / 1048576.0);
  std::printf("  ratio         : %.3f (peak %.3f; goal <= 1.10)\n", mem->rss / expected, mem->peak_rss / expected);
  return 0;
}
