#include "tools/weights_main.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "common/host_port.h"
#include "common/layout_file.h"
#include "common/security/flags.h"
#include "common/status_macros.h"
#include "tools/weights.h"
#include "trainer_client/model/gpt_spec.h"
#include "trainer_client/model/sampler.h"

ABSL_DECLARE_FLAG(int, layers);
ABSL_DECLARE_FLAG(int, d_model);
ABSL_DECLARE_FLAG(int, heads);
ABSL_DECLARE_FLAG(int, context);
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_DECLARE_FLAG(absl::Duration, timeout);

ABSL_FLAG(std::string, from, "",
          "export, sample: a checkpoint folder, a .safetensors file pshard export wrote, or the gRPC address "
          "(host:port) of a running job's shard server; "
          "reshard: the checkpoint folder to read");
ABSL_FLAG(std::string, to, "",
          "layout: the layout file to write (empty: standard output); export: the .safetensors file to write; "
          "reshard: the new checkpoint folder (absent or empty)");
ABSL_FLAG(int, from_shards, 0, "export, reshard, sample: read the checkpoints of this many shards (0: the folder's only count)");
ABSL_FLAG(int, num_shards, 0, "reshard: write checkpoints for this many shard servers");
ABSL_FLAG(int64_t, step, -1, "export, reshard, sample: the checkpoint of this step (-1: the newest complete one)");
ABSL_FLAG(std::string, dtype, "fp32", "export: the tensors' type, fp32 or bf16 (rounded to nearest even)");
ABSL_FLAG(std::string, prompt, "\n", "sample: the text to continue (bytes are tokens)");
ABSL_FLAG(int, tokens, 200, "sample: tokens to generate");
ABSL_FLAG(double, temperature, 0.8, "sample: > 0 draws from the model's distribution sharpened (< 1) or flattened (> 1); 0: the most likely token");
ABSL_FLAG(int, top_k, 0, "sample: draw among the k most likely tokens (0: all)");
ABSL_FLAG(std::string, logprobs, "",
          "sample: also write each generated token's log-probability under the model (before --temperature and "
          "--top_k) to this file, one line per token: position, token, log-probability (tab-separated)");

namespace pshard {
namespace {

int Fail(const char* command, const absl::Status& status) {
  std::fprintf(stderr, "pshard %s: %s\n", command, std::string(status.message()).c_str());
  return absl::IsInvalidArgument(status) ? 2 : 1;
}

int Usage(const char* command, const std::string& what) {
  std::fprintf(stderr, "pshard %s: %s\n", command, what.c_str());
  return 2;
}

// The weights --from names: a checkpoint folder, an exported file, or a
// server of a job.
absl::StatusOr<JobWeights> WeightsFrom(const std::string& from) {
  std::error_code ec;
  if (std::filesystem::is_directory(from, ec)) {
    return WeightsFromCheckpoints(from, absl::GetFlag(FLAGS_from_shards), absl::GetFlag(FLAGS_step));
  }
  if (std::filesystem::is_regular_file(from, ec)) {
    if (absl::GetFlag(FLAGS_step) >= 0 || absl::GetFlag(FLAGS_from_shards) > 0) {
      return absl::InvalidArgumentError("--step and --from_shards choose among checkpoints; a file holds one step");
    }
    return WeightsFromFile(from);
  }
  if (!ParseHostPort(from).ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--from=", from, " is neither a checkpoint folder, a file `pshard export` wrote, nor a server's host:port"));
  }
  if (absl::GetFlag(FLAGS_step) >= 0 || absl::GetFlag(FLAGS_from_shards) > 0) {
    return absl::InvalidArgumentError(
        "--step and --from_shards choose among checkpoints; a running job gives the weights it is at");
  }
  ASSIGN_OR_RETURN(std::shared_ptr<const ClientSecurity> security,
                   ClientSecurity::Create(SecurityOptionsFromFlags(), Role::kReader));
  return WeightsFromServers(from, std::move(security), std::max(absl::GetFlag(FLAGS_timeout), absl::Seconds(30)));
}

}  // namespace

int RunLayoutCommand() {
  GptConfig gpt;
  gpt.num_layers = absl::GetFlag(FLAGS_layers);
  gpt.d_model = absl::GetFlag(FLAGS_d_model);
  gpt.num_heads = absl::GetFlag(FLAGS_heads);
  gpt.context = absl::GetFlag(FLAGS_context);
  absl::StatusOr<ModelSpec> spec = MakeGptSpec(gpt);
  if (!spec.ok()) return Fail("layout", spec.status());
  const std::string text = FormatLayoutJson(*spec);
  const std::string to = absl::GetFlag(FLAGS_to);
  if (to.empty()) {
    std::fputs(text.c_str(), stdout);
    return 0;
  }
  std::ofstream out(to);
  out << text;
  out.close();
  if (!out) return Fail("layout", absl::InternalError(absl::StrCat("cannot write ", to)));
  std::fprintf(stderr, "pshard layout: %s (%lld parameters, fingerprint %s) written to %s\n", spec->model.c_str(),
               static_cast<long long>(spec->TotalParameters()), FingerprintHex(LayoutFingerprint(*spec)).c_str(),
               to.c_str());
  return 0;
}

int RunExportCommand() {
  const std::string from = absl::GetFlag(FLAGS_from);
  const std::string to = absl::GetFlag(FLAGS_to);
  if (from.empty() || to.empty()) {
    return Usage("export", "give --from=CHECKPOINT_DIR or --from=HOST:PORT, and --to=FILE.safetensors");
  }
  const std::string dtype_name = absl::GetFlag(FLAGS_dtype);
  if (dtype_name != "fp32" && dtype_name != "bf16") return Usage("export", "--dtype is fp32 or bf16");
  const SafetensorsDtype dtype = dtype_name == "bf16" ? SafetensorsDtype::kBF16 : SafetensorsDtype::kF32;
  absl::StatusOr<JobWeights> weights = WeightsFrom(from);
  if (!weights.ok()) return Fail("export", weights.status());
  if (absl::Status s = WriteWeightsFile(*weights, dtype, to); !s.ok()) return Fail("export", s);
  std::printf("pshard export: %s at step %lld (%lld parameters, %d tensors, %s) written to %s\n",
              weights->layout.model.c_str(), static_cast<long long>(weights->step),
              static_cast<long long>(weights->layout.TotalParameters()), weights->layout.num_tensors(),
              dtype_name.c_str(), to.c_str());
  return 0;
}

int RunReshardCommand() {
  const std::string from = absl::GetFlag(FLAGS_from);
  const std::string to = absl::GetFlag(FLAGS_to);
  const int n = absl::GetFlag(FLAGS_num_shards);
  if (from.empty() || to.empty() || n < 1) {
    return Usage("reshard", "give --from=CHECKPOINT_DIR, --to=NEW_DIR and --num_shards=N (>= 1)");
  }
  if (absl::Status s = ReshardCheckpoints(from, absl::GetFlag(FLAGS_from_shards), absl::GetFlag(FLAGS_step), to, n);
      !s.ok()) {
    return Fail("reshard", s);
  }
  std::printf("pshard reshard: %s now holds the checkpoint for %d shard servers; start them with "
              "--checkpoint_dir=%s --num_shards=%d\n",
              to.c_str(), n, to.c_str(), n);
  return 0;
}

int RunSampleCommand() {
  const std::string from = absl::GetFlag(FLAGS_from);
  if (from.empty()) return Usage("sample", "give --from=CHECKPOINT_DIR, --from=FILE.safetensors or --from=HOST:PORT");
  const std::string prompt = absl::GetFlag(FLAGS_prompt);
  if (prompt.empty()) return Usage("sample", "--prompt must hold at least one byte");
  absl::StatusOr<JobWeights> weights = WeightsFrom(from);
  if (!weights.ok()) return Fail("sample", weights.status());
  std::vector<int32_t> tokens;
  for (unsigned char c : prompt) tokens.push_back(c);
  SampleOptions options;
  options.tokens = absl::GetFlag(FLAGS_tokens);
  options.temperature = absl::GetFlag(FLAGS_temperature);
  options.top_k = absl::GetFlag(FLAGS_top_k);
  options.seed = absl::GetFlag(FLAGS_seed);
  std::vector<double> logprobs;
  absl::StatusOr<std::vector<int32_t>> text = SampleGpt(weights->layout, weights->units, tokens, options, &logprobs);
  if (!text.ok()) return Fail("sample", text.status());
  if (const std::string path = absl::GetFlag(FLAGS_logprobs); !path.empty()) {
    std::ofstream out(path);
    for (size_t i = 0; i < logprobs.size(); ++i) {
      out << absl::StrFormat("%d\t%d\t%.9g\n", tokens.size() + i, (*text)[tokens.size() + i], logprobs[i]);
    }
    out.close();
    if (!out) return Fail("sample", absl::InternalError(absl::StrCat("cannot write ", path)));
  }
  std::string out;
  for (int32_t t : *text) {
    if (t > 255) {
      return Fail("sample", absl::InvalidArgumentError(absl::StrCat(
                                "token ", t, " is not a byte: pshard sample prints byte-level models (vocab 256)")));
    }
    out.push_back(static_cast<char>(t));
  }
  std::fwrite(out.data(), 1, out.size(), stdout);
  std::fputc('\n', stdout);
  std::fprintf(stderr, "pshard sample: %d tokens from %s at step %lld (temperature %g, top_k %d, seed %llu)\n",
               options.tokens, weights->layout.model.c_str(), static_cast<long long>(weights->step),
               options.temperature, options.top_k, static_cast<unsigned long long>(options.seed));
  return 0;
}

}  // namespace pshard
