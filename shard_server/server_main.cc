// pshard-server: one shard server of a job.
#include <cstdio>
#include <fstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/flags/usage.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/signals.h"
#include "common/security/flags.h"
#include "shard_server/server.h"
#include "common/layout_file.h"
#include "trainer_client/model/gpt_spec.h"
#include "common/memory_policy.h"

ABSL_FLAG(std::string, address, "127.0.0.1:0", "host:port to listen on (port 0: any free port)");
ABSL_FLAG(std::string, port_file, "",
          "once serving, write the gRPC port (line 1), the metrics port (line 2, 0: none) and the step it "
          "serves from (line 3: the restored checkpoint's, 0 when it started fresh) to this file");
ABSL_FLAG(std::string, metrics_address, "127.0.0.1:0",
          "host:port of the Prometheus /metrics endpoint (port 0: any free port; empty: off)");
ABSL_FLAG(int, shard_index, 0, "this server's shard, 0..num_shards-1");
ABSL_FLAG(int, num_shards, 1, "N: shard servers in the job");
ABSL_FLAG(int, num_trainers, 1, "M: trainers whose gradients are reduced each step");
ABSL_FLAG(std::string, coordinator, "", "host:port of shard 0 (required on other shards)");
ABSL_FLAG(std::string, advertise_address, "",
          "host:port others reach this server at, told to shard 0 so that `pshard status` given one server "
          "finds the rest (default: the address shard 0 sees this server's calls from, and its port)");
ABSL_FLAG(std::string, layout, "",
          "the job's layout: a JSON file of units of named tensors (`pshard layout` writes a GPT's; the PyTorch "
          "bridge writes a module's); empty: the GPT of --layers, --d_model, --heads, --context and --vocab");
ABSL_FLAG(std::string, init_from, "",
          "start the job from these weights (a .safetensors file holding exactly the layout's tensors, F32 or "
          "BF16) instead of the layout's initialisation rules; every server of the job must be given the same "
          "file, and a checkpoint to resume from still wins");
ABSL_FLAG(int, layers, 4, "transformer blocks");
ABSL_FLAG(int, d_model, 128, "model width");
ABSL_FLAG(int, heads, 4, "attention heads");
ABSL_FLAG(int, context, 64, "maximum sequence length");
ABSL_FLAG(int, vocab, 256, "vocabulary size (256: bytes)");
ABSL_FLAG(uint64_t, seed, 1234, "initialisation seed");
ABSL_FLAG(double, lr, 1e-3, "peak learning rate");
ABSL_FLAG(double, min_lr, 1e-4, "final learning rate of the cosine decay");
ABSL_FLAG(int64_t, warmup_steps, 20, "linear warm-up steps");
ABSL_FLAG(int64_t, total_steps, 0, "end of the cosine decay (0: constant after warm-up)");
ABSL_FLAG(double, beta1, 0.9, "AdamW beta1");
ABSL_FLAG(double, beta2, 0.95, "AdamW beta2");
ABSL_FLAG(double, eps, 1e-8, "AdamW epsilon");
ABSL_FLAG(double, weight_decay, 0.1, "decoupled weight decay (matrices only)");
ABSL_FLAG(double, grad_clip, 1.0, "global gradient-norm clip (0: off)");
ABSL_FLAG(bool, deterministic, true, "sum contributions in the canonical tree order (bit-reproducible)");
ABSL_FLAG(int, micro_batches, 1, "micro-batches per trainer per step (gradient accumulation)");
ABSL_FLAG(bool, accumulate_on_trainer, false,
          "trainers sum their micro-batches and push once per step (lean traffic) instead of pushing each "
          "(lean memory)");
ABSL_FLAG(int64_t, slice_alignment, 64, "slice alignment in elements");
ABSL_FLAG(absl::Duration, fetch_wait_limit, absl::Seconds(120), "longest a fetch waits for a version");
ABSL_FLAG(absl::Duration, step_timeout, absl::Seconds(60),
          "how long a step waits before reporting what it misses");
ABSL_FLAG(bool, ucx, true,
          "also serve fetches and pushes over UCX (when built with UCX); trainers choose per link");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "folder for this shard's checkpoints; the newest there is restored at start (empty: none)");
ABSL_FLAG(int64_t, checkpoint_every, 0, "write a checkpoint every this many steps (0: only at shutdown)");
ABSL_FLAG(int, checkpoint_keep, 2, "checkpoints kept per shard");
ABSL_FLAG(std::string, on_checkpoint_failure, "stop",
          "a checkpoint that cannot be written (full disk, folder deleted): stop (exit 3) or continue "
          "(logged and counted in pshard_server_checkpoint_failures_total)");
ABSL_FLAG(int64_t, resume_step, -1, "restore this step's checkpoint instead of the newest (-1: newest)");
ABSL_FLAG(bool, start_fresh, false,
          "start from step 0 even if --checkpoint_dir holds checkpoints: the ones this shard would read or "
          "overwrite, and those of other shard counts, are first moved into a subfolder (nothing is deleted)");
ABSL_FLAG(bool, allow_schedule_change, false,
          "resume from a checkpoint of a job whose --total_steps differed: the cosine schedule is re-stretched "
          "to the new end (the learning rate jumps); without it such a resume is refused");
ABSL_FLAG(int, max_message_bytes, 4 << 20, "largest accepted gRPC message");
ABSL_FLAG(int, max_connections_per_host, 256,
          "open connections one peer host may hold (trainers behind one NAT address share it); one past it is "
          "closed before its TLS handshake");
ABSL_FLAG(int, max_connections, 1024, "open connections in all; one past it is closed before its TLS handshake");

namespace {

// Whether the command line names flag `name` (--name=v, --name v, -name).
bool OnCommandLine(int argc, char** argv, const std::string& name) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") break;
    arg = arg.substr(arg.find_first_not_of('-') == std::string::npos ? arg.size() : arg.find_first_not_of('-'));
    if (arg.substr(0, arg.find('=')) == name) return true;
  }
  return false;
}

// The layout file of --layout, or the GPT the size flags describe; both
// at once is an error.
absl::StatusOr<pshard::ModelSpec> JobLayoutFromFlags(int argc, char** argv) {
  const std::string path = absl::GetFlag(FLAGS_layout);
  if (path.empty()) {
    pshard::GptConfig gpt;
    gpt.num_layers = absl::GetFlag(FLAGS_layers);
    gpt.d_model = absl::GetFlag(FLAGS_d_model);
    gpt.num_heads = absl::GetFlag(FLAGS_heads);
    gpt.context = absl::GetFlag(FLAGS_context);
    gpt.vocab = absl::GetFlag(FLAGS_vocab);
    return pshard::MakeGptSpec(gpt);
  }
  for (const char* name : {"layers", "d_model", "heads", "context", "vocab"}) {
    if (OnCommandLine(argc, argv, name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, " describes a GPT, and --layout gives the layout: pass one or the other"));
    }
  }
  return pshard::ReadLayoutFile(path);
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("pshard-server --shard_index=I --num_shards=N --num_trainers=M ...");
  absl::ParseCommandLine(argc, argv);
  pshard::ReuseFreedMemory();
  static absl::Notification stop;  // outlives the detached signal thread
  pshard::CallOnTerminationSignal([](int) { stop.Notify(); });

  pshard::ShardServer::Spec spec;
  absl::StatusOr<pshard::ModelSpec> layout = JobLayoutFromFlags(argc, argv);
  if (!layout.ok()) {
    std::fprintf(stderr, "pshard-server: %s\n", std::string(layout.status().message()).c_str());
    return 2;
  }
  spec.job.model = *std::move(layout);
  spec.init_from = absl::GetFlag(FLAGS_init_from);
  spec.job.optimizer.lr = absl::GetFlag(FLAGS_lr);
  spec.job.optimizer.min_lr = absl::GetFlag(FLAGS_min_lr);
  spec.job.optimizer.warmup_steps = absl::GetFlag(FLAGS_warmup_steps);
  spec.job.optimizer.total_steps = absl::GetFlag(FLAGS_total_steps);
  spec.job.optimizer.beta1 = absl::GetFlag(FLAGS_beta1);
  spec.job.optimizer.beta2 = absl::GetFlag(FLAGS_beta2);
  spec.job.optimizer.eps = absl::GetFlag(FLAGS_eps);
  spec.job.optimizer.weight_decay = absl::GetFlag(FLAGS_weight_decay);
  spec.job.optimizer.grad_clip = absl::GetFlag(FLAGS_grad_clip);
  spec.job.seed = absl::GetFlag(FLAGS_seed);
  spec.job.num_shards = absl::GetFlag(FLAGS_num_shards);
  spec.job.num_trainers = absl::GetFlag(FLAGS_num_trainers);
  spec.job.slice_alignment = absl::GetFlag(FLAGS_slice_alignment);
  spec.job.deterministic = absl::GetFlag(FLAGS_deterministic);
  spec.job.micro_batches = absl::GetFlag(FLAGS_micro_batches);
  spec.job.accumulate_on_trainer = absl::GetFlag(FLAGS_accumulate_on_trainer);
  spec.shard_index = absl::GetFlag(FLAGS_shard_index);
  spec.address = absl::GetFlag(FLAGS_address);
  spec.coordinator_address = absl::GetFlag(FLAGS_coordinator);
  spec.advertise_address = absl::GetFlag(FLAGS_advertise_address);
  spec.fetch_wait_limit = absl::GetFlag(FLAGS_fetch_wait_limit);
  spec.enable_ucx = absl::GetFlag(FLAGS_ucx);
  spec.step_timeout = absl::GetFlag(FLAGS_step_timeout);
  spec.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  spec.connection_limits = {.per_connection = absl::GetFlag(FLAGS_max_connections_per_host),
                            .total = absl::GetFlag(FLAGS_max_connections)};
  spec.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  spec.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  spec.checkpoint_every = absl::GetFlag(FLAGS_checkpoint_every);
  spec.checkpoint_keep = absl::GetFlag(FLAGS_checkpoint_keep);
  if (const std::string policy = absl::GetFlag(FLAGS_on_checkpoint_failure); policy == "continue") {
    spec.continue_on_checkpoint_failure = true;
  } else if (policy != "stop") {
    std::fprintf(stderr, "pshard-server: --on_checkpoint_failure=%s: expected stop or continue\n", policy.c_str());
    return 2;
  }
  spec.resume_step = absl::GetFlag(FLAGS_resume_step);
  spec.start_fresh = absl::GetFlag(FLAGS_start_fresh);
  spec.allow_schedule_change = absl::GetFlag(FLAGS_allow_schedule_change);
  spec.security = pshard::SecurityOptionsFromFlags();

  absl::StatusOr<std::unique_ptr<pshard::ShardServer>> server = pshard::ShardServer::Start(spec);
  if (!server.ok()) {
    std::fprintf(stderr, "pshard-server: %s\n", server.status().ToString().c_str());
    return 1;
  }
  pshard::ShardServer* running = server->get();
  const auto counters = running->state().counters();
  std::fprintf(stderr,
               "pshard-server: shard %d/%d serving on %s (%s), metrics on port %d; %lld parameters in the model, "
               "%.1f MiB of state here\n",
               spec.shard_index, spec.job.num_shards, running->address().c_str(),
               pshard::DescribeSecurity(spec.security).c_str(), running->metrics_port(),
               static_cast<long long>(running->state().layout().spec.TotalParameters()),
               counters.state_bytes / 1048576.0);
  for (const std::string& note : running->start_notes()) {
    std::fprintf(stderr, "pshard-server: shard %d: %s\n", spec.shard_index, note.c_str());
  }
  if (!running->restored_from().empty()) {
    std::fprintf(stderr, "pshard-server: shard %d resumed at step %lld from %s\n", spec.shard_index,
                 static_cast<long long>(running->state().current_step()), running->restored_from().c_str());
  }
  if (const std::string port_file = absl::GetFlag(FLAGS_port_file); !port_file.empty()) {
    const std::string tmp = port_file + ".tmp";
    std::ofstream(tmp) << running->port() << "\n"
                       << running->metrics_port() << "\n"
                       << running->state().current_step() << "\n";
    std::rename(tmp.c_str(), port_file.c_str());
  }
  while (!stop.WaitForNotificationWithTimeout(absl::Milliseconds(200)) && running->failure().ok()) {
  }
  std::fprintf(stderr, "pshard-server: shard %d shutting down at step %lld\n", spec.shard_index,
               static_cast<long long>(running->state().current_step()));
  running->Shutdown(absl::Seconds(2));
  // Its own shutdown checkpoint included: a job must not end "cleanly"
  // without the state it was asked to keep.
  const absl::Status failure = running->failure();
  server->reset();
  if (!failure.ok()) {
    std::fprintf(stderr, "pshard-server: %s\n", failure.ToString().c_str());
    return 3;
  }
  return 0;
}
