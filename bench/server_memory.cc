// Shard server resident memory for a ~100M-parameter GPT over N servers,
// against the 16 bytes per parameter / N that mixed-precision AdamW state
// costs (goal: ratio <= 1.1). Starts N real pshard-server processes, reads
// shard 0's memory at rest, then trains two steps with one trainer and
// reads its peak (which includes the gradient reduction's buffers). With
// --init_from, every server starts from a safetensors file of the whole
// model, and the peak at rest is the loading's: a server reads the file a
// piece at a time and keeps only its slices, so it stays near 16 * P / N
// (a loader that held the file would add 4 to 12 bytes * P on every shard).
#include <stdlib.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "trainer_client/model/gpt_spec.h"
#include "bench/bench_util.h"
#include "common/model_spec.h"
#include "common/safetensors.h"
#include "tools/process.h"

ABSL_FLAG(std::string, bin_dir, PSHARD_BIN_DIR, "folder of pshard-server and pshard-trainer");
ABSL_FLAG(int, servers, 4, "N: the model is sharded over this many servers");
ABSL_FLAG(int, layers, 14, "transformer blocks");
ABSL_FLAG(int, d_model, 768, "model width");
ABSL_FLAG(int, train_steps, 2, "steps trained before reading the peak (0: only at rest)");
ABSL_FLAG(bool, init_from, false, "start every server from a safetensors file of the whole model (--init_from)");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int n = absl::GetFlag(FLAGS_servers);
  const std::string bin = absl::GetFlag(FLAGS_bin_dir);
  pshard::GptConfig config{.num_layers = absl::GetFlag(FLAGS_layers), .d_model = absl::GetFlag(FLAGS_d_model),
                           .num_heads = 12, .context = 1024, .vocab = 256};
  auto spec = pshard::MakeGptSpec(config);
  if (!spec.ok()) return pshard::bench::Fail(spec.status());
  const double params = static_cast<double>(spec->TotalParameters());

  char tmpl[] = "/tmp/pshard-mem-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  std::string init_file;
  if (absl::GetFlag(FLAGS_init_from)) {
    // Values do not matter here, sizes do: every tensor of the layout, fp32.
    init_file = dir + "/init.safetensors";
    std::vector<std::vector<float>> values;
    std::vector<pshard::SafetensorsTensorView> views;
    for (const pshard::UnitSpec& unit : spec->units) {
      for (const pshard::TensorSpec& t : unit.tensors) {
        values.emplace_back(t.numel, 0.01f * static_cast<float>(views.size() % 7));
        views.push_back({t.name, pshard::SafetensorsDtype::kF32, t.shape,
                         {reinterpret_cast<const uint8_t*>(values.back().data()), values.back().size() * sizeof(float)}});
      }
    }
    if (absl::Status s = pshard::WriteSafetensors(init_file, views, {}); !s.ok()) return pshard::bench::Fail(s);
  }
  std::vector<std::string> server_args = {"--num_trainers=1", absl::StrCat("--layers=", config.num_layers),
                                          absl::StrCat("--d_model=", config.d_model), "--heads=12",
                                          "--context=1024"};
  if (!init_file.empty()) server_args.push_back(absl::StrCat("--init_from=", init_file));
  absl::StatusOr<pshard::bench::ServerProcesses> servers =
      pshard::bench::StartServerProcesses(bin, n, server_args, dir);
  if (!servers.ok()) return pshard::bench::Fail(servers.status());
  const std::vector<std::string>& addresses = servers->addresses;
  absl::SleepFor(absl::Milliseconds(500));
  auto at_rest = pshard::bench::ReadProcessMemory(servers->children[0].pid());

  absl::StatusOr<pshard::bench::ProcessMemory> peak = at_rest;
  if (const int steps = absl::GetFlag(FLAGS_train_steps); steps > 0 && at_rest.ok()) {
    auto trainer = pshard::ChildProcess::Spawn(
        {bin + "/pshard-trainer", absl::StrCat("--servers=", absl::StrJoin(addresses, ",")), "--rank=0",
         absl::StrCat("--steps=", steps), "--batch=1", "--seq_len=64", "--log_every=0", "--metrics_address="},
        dir + "/trainer.log");
    std::optional<int> code = trainer.ok() ? trainer->WaitUntil(absl::Now() + absl::Minutes(10)) : std::nullopt;
    if (!code || *code != 0) {
      servers->Stop();
      std::fprintf(stderr, "training failed; see %s/trainer.log\n", dir.c_str());
      return 1;
    }
    peak = pshard::bench::ReadProcessMemory(servers->children[0].pid());
  }
  servers->Stop();
  if (!init_file.empty()) std::remove(init_file.c_str());
  if (!at_rest.ok()) return pshard::bench::Fail(at_rest.status());
  if (!peak.ok()) return pshard::bench::Fail(peak.status());

  const double expected = 16.0 * params / n;
  std::printf("shard server memory: GPT %d layers x %d (%.1fM parameters), shard 0 of %d\n", config.num_layers,
              config.d_model, params / 1e6, n);
  std::printf("  16 * P / N          : %.1f MiB\n", expected / 1048576.0);
  std::printf("  resident at rest    : %.1f MiB, ratio %.3f\n", at_rest->rss / 1048576.0, at_rest->rss / expected);
  if (!init_file.empty()) {
    std::printf("  peak while starting from --init_from (a %.1f MiB file): %.1f MiB, ratio %.3f (goal <= 1.10)\n",
                4.0 * params / 1048576.0, at_rest->peak_rss / 1048576.0, at_rest->peak_rss / expected);
  }
  std::printf("  peak while training : %.1f MiB, ratio %.3f (goal <= 1.10)\n", peak->peak_rss / 1048576.0,
              peak->peak_rss / expected);
  return 0;
}
