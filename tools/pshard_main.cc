// pshard: the command-line tool. Subcommands:
//   pshard local [flags]   train on a local cluster of N servers and M trainers
//   pshard status --servers=host:port,...   one table of a running job
//   pshard plan [flags]    memory, bytes and step time of a job, predicted
//   pshard sweep --flag=v1,v2 ...   a grid of local jobs, measured and predicted
//   pshard plot results.csv   the figures of a sweep
//   pshard layout | export | reshard | sample   layouts, weights out, checkpoints moved (weights_main.h)
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/host_port.h"
#include "common/link_rate.h"
#include "common/security/flags.h"
#include "lab/plan.h"
#include "lab/plan_flags.h"
#include "lab/plan_report.h"
#include "lab/sweep.h"
#include "common/status_macros.h"
#include "pshard/config.h"
#include "trainer_client/peak_flops.h"
#include "tools/cluster_status.h"
#include "tools/local_cluster.h"
#include "trainer_client/route_plan.h"
#include "tools/sweep.h"
#include "tools/weights_main.h"
#include "common/wire_encoding.h"
#include "common/levers.h"

// `local` reads it as N, `status` as a list of addresses.
ABSL_FLAG(std::string, servers, "4",
          "local: N, shard server processes; status: the gRPC address (host:port) of one shard server of the job, "
          "or of all of them, comma-separated");
ABSL_FLAG(int, trainers, 2, "M: trainer processes");
ABSL_FLAG(int64_t, steps, 300, "train until this step");
ABSL_FLAG(int64_t, schedule_steps, 0,
          "end of the cosine learning-rate decay (0: --steps); keep it when resuming with a larger --steps to go "
          "on at the final rate");
ABSL_FLAG(bool, allow_schedule_change, false,
          "resume from checkpoints of a job whose schedule ended elsewhere, re-stretching the schedule");
ABSL_FLAG(int, batch, 8, "sequences per trainer per step");
ABSL_FLAG(int, seq_len, 64, "tokens per sequence");
ABSL_FLAG(int, prefetch, 1, "units fetched ahead of the one computing");
ABSL_FLAG(bool, recompute, false, "trainers recompute each block in backward instead of keeping its activations");
ABSL_FLAG(std::string, encoding, "bf16",
          "wire encoding of weights and gradients: fp32, bf16 or int8 (int4 is for --grad_encoding only)");
ABSL_FLAG(std::string, weight_encoding, "", "wire encoding of fetched weights: fp32, bf16 or int8 (empty: --encoding)");
ABSL_FLAG(std::string, grad_encoding, "",
          "wire encoding of pushed gradients: fp32, bf16, int8 or int4 (empty: --encoding)");
ABSL_FLAG(int, quant_block, pshard::kDefaultQuantBlock,
          "elements per scale of int8 and int4 (block quantization; a multiple of 16 in [16, 16384])");
ABSL_FLAG(std::string, error_feedback, "auto",
          "add each gradient slice's quantization residual of its last push to its next one: auto (on for int8 "
          "and int4 gradients), true or false");
ABSL_FLAG(std::string, device, "cpu", "where trainers run the model: cpu, cuda or auto");
ABSL_FLAG(std::string, reshard_after_forward, "true",
          "true: trainers fetch each unit again for its backward (ZeRO stage 3); false: they keep every unit "
          "from its forward to its backward; G (= --fabric_group_size): each keeps the 1/G it fetched and the "
          "group all-gathers the unit for backward (the secondary shard)");
ABSL_FLAG(int, stage, 3,
          "ZeRO stage of the weights: 3 (fetched pass by pass) or 2 (a resident replica per trainer, fetched once "
          "per step); 1 is the same as 2");
ABSL_FLAG(std::string, attention, "auto", "GPU trainers' attention: auto, fused or materialized");
ABSL_FLAG(std::string, data, "", "training text file; empty: the built-in corpus");
ABSL_FLAG(int, layers, 4, "transformer blocks");
ABSL_FLAG(int, d_model, 128, "model width");
ABSL_FLAG(int, heads, 4, "attention heads");
ABSL_FLAG(int, context, 64, "maximum sequence length");
ABSL_FLAG(double, lr, 2e-3, "peak learning rate");
ABSL_FLAG(double, min_lr, 2e-4, "final learning rate");
ABSL_FLAG(int64_t, warmup_steps, 20, "warm-up steps");
ABSL_FLAG(double, grad_clip, 1.0, "global gradient-norm clip (0: off)");
ABSL_FLAG(double, weight_decay, 0.1, "AdamW weight decay");
ABSL_FLAG(int, micro_batches, 1, "micro-batches per trainer per step (gradient accumulation)");
ABSL_FLAG(bool, accumulate_on_trainer, false, "trainers push once per step instead of per micro-batch");
ABSL_FLAG(bool, fetch_once_per_step, false,
          "trainers run all micro-batches of a step in one pass: each unit fetched and pushed once per step, "
          "activations kept for every micro-batch (needs --accumulate_on_trainer)");
ABSL_FLAG(uint64_t, seed, 1234, "initialisation seed (sample: the seed of the draws)");
ABSL_FLAG(int, log_every, 10, "progress line every this many steps");
ABSL_FLAG(std::string, val_data, "",
          "held-out text file: trainer 0 (its fabric group) reports the loss on it every --eval_every steps");
ABSL_FLAG(int, eval_every, 0, "evaluate on --val_data after every this many steps and after the last (0: never)");
ABSL_FLAG(int, val_batches, 8, "micro-batches of --val_data per evaluation");
ABSL_FLAG(int, fabric_group_size, 1,
          "trainers form fabric groups of this many consecutive ranks (each fetches 1/G of every unit, the group "
          "all-gathers and reduce-scatters over TCP, and pushes once); 1: no groups");
ABSL_FLAG(std::string, checkpoint_dir, "", "servers write checkpoints here (and resume from the newest)");
ABSL_FLAG(std::string, init_from, "",
          "start the job from these weights (a .safetensors file of the GPT's tensors, e.g. from pshard export) "
          "instead of its random initialisation: fine-tuning; a checkpoint to resume from still wins");
ABSL_FLAG(int64_t, checkpoint_every, 0, "servers checkpoint every this many steps (0: only at shutdown)");
ABSL_FLAG(int, checkpoint_keep, 2,
          "checkpoints kept per shard (and always the two newest steps every shard holds)");
ABSL_FLAG(std::string, on_checkpoint_failure, "stop",
          "a checkpoint a server cannot write (full disk, folder deleted): stop the job, or continue (logged)");
ABSL_FLAG(int64_t, resume_step, -1, "servers restore this step's checkpoints instead of the newest (-1: newest)");
ABSL_FLAG(bool, start_fresh, false,
          "start from step 0 even if --checkpoint_dir holds checkpoints (they are moved into a subfolder)");
ABSL_FLAG(std::string, link_rate, "",
          "emulated bandwidth of each node's network interface (or connection: --link_scope), tc units: 100mbit, 1gbit (bits) or 20mbps (bytes!) "
          "(default: $PSHARD_LINK_RATE, else none)");
ABSL_FLAG(std::string, link_delay, "", "emulated one-way latency, e.g. 5ms (default: $PSHARD_LINK_DELAY)");
ABSL_FLAG(std::string, link_jitter, "", "emulated jitter, e.g. 1ms (default: $PSHARD_LINK_JITTER)");
ABSL_FLAG(std::string, link_mode, "emulated",
          "emulated: links emulated in the trainers' processes over loopback; kernel: each trainer in its own "
          "network namespace behind a veth pair shaped by tc tbf to --link_rate (root; rate only, no delay)");
ABSL_FLAG(std::string, placement, "separate",
          "emulated nodes: separate (every server and trainer on its own node) or paired (trainer R on a node with "
          "server R, as one server and one trainer per machine)");
ABSL_FLAG(std::string, topology, "",
          "a topology file (JSON; trainer_client/route_plan.h) placing the job's servers (named shard:K) and "
          "trainers on nodes, with fabric groups and links of their own rate and delay between nodes: local "
          "gives it to every trainer, plan and sweep predict with it");
ABSL_FLAG(std::string, link_scope, "node",
          "what shares an emulated link's rate: node (each process on its own emulated node, whose interface all "
          "its connections share, per direction) or connection (each trainer-server connection its own)");
ABSL_FLAG(std::string, params, "",
          "plan: a parameter count (7.5e9, 7.5B, 125M) spread over --layers equal layers of width --d_model, "
          "instead of the GPT of --layers, --d_model, --heads");
ABSL_FLAG(std::string, fabric_rate, "",
          "bandwidth of each fabric-group member's interface, tc units (empty: unlimited); local emulates it in "
          "the trainers' tcp groups, plan and sweep predict with it");
ABSL_FLAG(std::string, fabric_delay, "",
          "one-way latency between members of a fabric group (local emulates it; plan and sweep predict with it)");
ABSL_FLAG(std::string, device_flops, "auto",
          "plan: a trainer device's peak FLOP/s (e.g. 989e12), or auto: this machine's SGEMM rate");
ABSL_FLAG(double, mfu, 0.5, "plan: the model FLOPs utilisation the trainers achieve, (0, 1]");
ABSL_FLAG(double, optimizer_state_bytes, 12,
          "plan: optimizer state bytes per parameter for the ZeRO comparison (K; Adam with an fp32 master: 12)");
ABSL_FLAG(bool, tls, false,
          "local: mutual TLS between every process (a CA and per-role certificates are made in the run folder's "
          "tls/ with pshard-make-certs.sh)");
ABSL_FLAG(bool, auth_tokens, false,
          "local: every call carries its role's token (a token file of random tokens is written to the run "
          "folder)");
ABSL_FLAG(std::string, transport, "auto",
          "local: the trainers' data path to the servers: auto (UCX where it starts), grpc or ucx");
ABSL_FLAG(int, trainer_restarts, 3,
          "local: a trainer that dies (killed by a signal) is started again, at most this many times per rank; it "
          "rejoins and redoes its step");
ABSL_FLAG(int, server_restarts, 3,
          "local: a shard server that dies (killed by a signal) is started again on its port, at most this many "
          "times per shard; it restores its newest checkpoint (--checkpoint_dir) and the job rolls back to it");
ABSL_FLAG(absl::Duration, server_retry_limit, absl::Minutes(10),
          "local: how long a trainer keeps rejoining after a server went away (0: it exits at once)");
ABSL_FLAG(absl::Duration, rpc_timeout, absl::Seconds(120), "local: the trainers' deadline of every fetch and push");
ABSL_FLAG(bool, json, false, "plan: print JSON instead of tables");
ABSL_FLAG(std::string, step_overhead, "0",
          "plan: time of every step the planner's event model does not see (servers' update, host work of the "
          "transfers), e.g. 25ms; a sweep calibrates it");
ABSL_FLAG(std::string, out, "sweep", "sweep: the results folder (results.json, results.csv, points/, figures)");
ABSL_FLAG(int, skip_steps, 3, "sweep: warm-up steps of each point, not measured");
ABSL_FLAG(int, measure_steps, 5, "sweep: steps measured per point after the warm-up");
ABSL_FLAG(int, loss_steps, 0,
          "sweep: > 0: each point also trains this many steps, links unshaped (they change no number), and reports "
          "trainer 0's loss on --val_data after the last (results: measured_val_loss); 0: no loss");
ABSL_FLAG(bool, calibrate, true,
          "sweep: find the MFU the planner assumes from an unshaped run of the first point (false: --mfu)");
ABSL_FLAG(bool, plot, false, "sweep: draw the figures when done (as pshard plot does)");
ABSL_FLAG(absl::Duration, point_timeout, absl::Minutes(30),
          "sweep: a point still running after this is stopped, and the sweep with it");
ABSL_FLAG(int, metrics_port_base, 9400,
          "metrics ports: server s on BASE+s, trainer r on BASE+100+r (0: any free ports, no Prometheus config)");
ABSL_FLAG(std::string, run_dir, "", "where logs go (default: a new folder under /tmp)");
ABSL_FLAG(std::string, bin_dir, "", "folder of pshard-server and pshard-trainer (default: next to pshard)");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(5),
          "status: deadline of each server's GetStatus and of each trainer's /metrics scrape");

namespace {

std::string SelfDir() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  std::string path(buf, n);
  return path.substr(0, path.rfind('/'));
}

// A flag's value, or the environment variable's when the flag is empty.
std::string FlagOrEnv(const std::string& flag, const char* env) {
  if (!flag.empty()) return flag;
  const char* value = std::getenv(env);
  return value == nullptr ? std::string() : std::string(value);
}

// Checks the emulated link settings before anything starts and says how
// they are read; the trainer flags that carry them.
absl::StatusOr<std::vector<std::string>> LinkFlags() {
  const std::string rate = FlagOrEnv(absl::GetFlag(FLAGS_link_rate), "PSHARD_LINK_RATE");
  const std::string delay = FlagOrEnv(absl::GetFlag(FLAGS_link_delay), "PSHARD_LINK_DELAY");
  const std::string jitter = FlagOrEnv(absl::GetFlag(FLAGS_link_jitter), "PSHARD_LINK_JITTER");
  absl::StatusOr<std::string> described = pshard::DescribeLinkRate(rate);
  if (!described.ok()) return described.status();
  for (const auto& [name, text] : {std::pair{"delay", delay}, std::pair{"jitter", jitter}}) {
    absl::Duration d;
    if (!text.empty() && (!absl::ParseDuration(text, &d) || d < absl::ZeroDuration())) {
      return absl::InvalidArgumentError(absl::StrCat("--link_", name, "=", text, " is not a duration such as 5ms"));
    }
  }
  const std::string scope = absl::GetFlag(FLAGS_link_scope);
  if (scope != "node" && scope != "connection") {
    return absl::InvalidArgumentError(absl::StrCat("--link_scope=", scope, " is not node or connection"));
  }
  if (rate.empty() && delay.empty() && jitter.empty()) return std::vector<std::string>();
  if (absl::GetFlag(FLAGS_link_mode) == "emulated") {
    std::printf("pshard: emulated links: rate %s per %s, delay %s, jitter %s\n", described->c_str(),
              scope == "connection" ? "trainer-server connection and direction"
              : absl::GetFlag(FLAGS_topology).empty()
                  ? "node interface and direction (every server and trainer on its own node)"
                  : "node interface and direction (on the nodes of --topology; its links' own rates and delays "
                    "replace these between their nodes)",
                delay.empty() ? "0" : delay.c_str(), jitter.empty() ? "0" : jitter.c_str());
  }
  return std::vector<std::string>{absl::StrCat("--link_rate=", rate), absl::StrCat("--link_delay=", delay),
                                  absl::StrCat("--link_jitter=", jitter), absl::StrCat("--link_scope=", scope)};
}

// What --topology (checked for a job of `servers` servers) sets: the
// fabric groups (else --fabric_group_size's) and whether any node pair has
// a link of its own to emulate.
struct JobTopology {
  int group = 1;
  bool shaped = false;
};
absl::StatusOr<JobTopology> JobTopologyOf(int servers) {
  const std::string file = absl::GetFlag(FLAGS_topology);
  const int flag = absl::GetFlag(FLAGS_fabric_group_size);
  if (file.empty()) return JobTopology{flag, false};
  ASSIGN_OR_RETURN(const pshard::Topology topology, pshard::Topology::Load(file));
  const int trainers = absl::GetFlag(FLAGS_trainers);
  RETURN_IF_ERROR(topology.CheckForJob(servers, trainers));
  JobTopology job;
  ASSIGN_OR_RETURN(job.group, topology.UniformGroupSize(trainers));
  if (flag != 1 && flag != job.group) {
    return absl::InvalidArgumentError(absl::StrCat("--fabric_group_size=", flag, " disagrees with ", file,
                                                   ", whose fabric groups are of ", job.group,
                                                   ": the topology's groups are the job's"));
  }
  if (absl::GetFlag(FLAGS_placement) != "separate" || absl::GetFlag(FLAGS_link_mode) == "kernel") {
    return absl::InvalidArgumentError(
        "--topology places the processes and shapes their links: not with --placement=paired or --link_mode=kernel");
  }
  for (const pshard::Topology::Link& l : topology.links) job.shaped |= !l.rate.empty() || !l.delay.empty();
  return job;
}

int RunLocal() {
  pshard::LocalClusterSpec spec;
  if (!absl::SimpleAtoi(absl::GetFlag(FLAGS_servers), &spec.num_servers)) {
    std::fprintf(stderr, "pshard local: --servers=%s is not a number of servers\n",
                 absl::GetFlag(FLAGS_servers).c_str());
    return 2;
  }
  if (absl::GetFlag(FLAGS_fetch_once_per_step) && absl::GetFlag(FLAGS_micro_batches) > 1 &&
      !absl::GetFlag(FLAGS_accumulate_on_trainer)) {
    std::fprintf(stderr,
                 "pshard local: --fetch_once_per_step pushes each unit's gradient once per step, summed over the "
                 "micro-batches: add --accumulate_on_trainer\n");
    return 2;
  }
  if (const std::string attention = absl::GetFlag(FLAGS_attention);
      attention != "auto" && attention != "fused" && attention != "materialized") {
    std::fprintf(stderr, "pshard local: --attention=%s: expected auto, fused or materialized\n", attention.c_str());
    return 2;
  }
  absl::StatusOr<pshard::WireEncodings> encodings =
      pshard::ParseWireEncodings(absl::GetFlag(FLAGS_encoding), absl::GetFlag(FLAGS_weight_encoding),
                                 absl::GetFlag(FLAGS_grad_encoding), absl::GetFlag(FLAGS_quant_block));
  if (!encodings.ok()) {
    std::fprintf(stderr, "pshard local: %s\n", std::string(encodings.status().message()).c_str());
    return 2;
  }
  if (absl::Status e = pshard::ParseErrorFeedback(absl::GetFlag(FLAGS_error_feedback), encodings->grads).status();
      !e.ok()) {
    std::fprintf(stderr, "pshard local: %s\n", std::string(e.message()).c_str());
    return 2;
  }
  absl::StatusOr<pshard::ReshardAfterForward> reshard =
      pshard::ParseReshardAfterForward(absl::GetFlag(FLAGS_reshard_after_forward));
  if (!reshard.ok()) {
    std::fprintf(stderr, "pshard local: %s\n", std::string(reshard.status().message()).c_str());
    return 2;
  }
  absl::StatusOr<JobTopology> job_topology = JobTopologyOf(spec.num_servers);
  if (!job_topology.ok()) {
    std::fprintf(stderr, "pshard local: %s\n", std::string(job_topology.status().message()).c_str());
    return 2;
  }
  spec.fabric_group_size = job_topology->group;
  if (!absl::GetFlag(FLAGS_topology).empty()) {
    // The servers' and trainers' processes may run elsewhere than here.
    spec.topology_file = std::filesystem::absolute(absl::GetFlag(FLAGS_topology)).string();
  }
  if (reshard->group > 0 && reshard->group != spec.fabric_group_size) {
    std::fprintf(stderr,
                 "pshard local: --reshard_after_forward=%d keeps a secondary shard within each fabric group: it "
                 "needs --fabric_group_size=%d (now %d)\n",
                 reshard->group, reshard->group, spec.fabric_group_size);
    return 2;
  }
  if (absl::Status s = pshard::CheckStage(absl::GetFlag(FLAGS_stage)); !s.ok()) {
    std::fprintf(stderr, "pshard local: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  absl::StatusOr<std::vector<std::string>> link_flags = LinkFlags();
  if (!link_flags.ok()) {
    std::fprintf(stderr, "pshard local: %s\n", std::string(link_flags.status().message()).c_str());
    return 2;
  }
  spec.num_trainers = absl::GetFlag(FLAGS_trainers);
  spec.bin_dir = absl::GetFlag(FLAGS_bin_dir).empty() ? SelfDir() : absl::GetFlag(FLAGS_bin_dir);
  spec.run_dir = absl::GetFlag(FLAGS_run_dir);
  spec.metrics_port_base = absl::GetFlag(FLAGS_metrics_port_base);
  if (spec.run_dir.empty()) {
    char tmpl[] = "/tmp/pshard-local-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) {
      std::perror("pshard: mkdtemp");
      return 1;
    }
    spec.run_dir = tmpl;
  }
  const int64_t steps = absl::GetFlag(FLAGS_steps);
  const int64_t schedule_steps = absl::GetFlag(FLAGS_schedule_steps) > 0 ? absl::GetFlag(FLAGS_schedule_steps) : steps;
  spec.steps = steps;
  spec.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  spec.schedule_steps = schedule_steps;
  spec.server_flags = {
      absl::StrCat("--layers=", absl::GetFlag(FLAGS_layers)),
      absl::StrCat("--d_model=", absl::GetFlag(FLAGS_d_model)),
      absl::StrCat("--heads=", absl::GetFlag(FLAGS_heads)),
      absl::StrCat("--context=", absl::GetFlag(FLAGS_context)),
      absl::StrCat("--seed=", absl::GetFlag(FLAGS_seed)),
      absl::StrCat("--lr=", absl::GetFlag(FLAGS_lr)),
      absl::StrCat("--min_lr=", absl::GetFlag(FLAGS_min_lr)),
      absl::StrCat("--warmup_steps=", absl::GetFlag(FLAGS_warmup_steps)),
      absl::StrCat("--total_steps=", schedule_steps),
      absl::StrCat("--grad_clip=", absl::GetFlag(FLAGS_grad_clip)),
      absl::StrCat("--weight_decay=", absl::GetFlag(FLAGS_weight_decay)),
      absl::StrCat("--micro_batches=", absl::GetFlag(FLAGS_micro_batches)),
      absl::StrCat("--accumulate_on_trainer=", absl::GetFlag(FLAGS_accumulate_on_trainer) ? "true" : "false"),
      absl::StrCat("--checkpoint_dir=", absl::GetFlag(FLAGS_checkpoint_dir)),
      absl::StrCat("--checkpoint_every=", absl::GetFlag(FLAGS_checkpoint_every)),
      absl::StrCat("--checkpoint_keep=", absl::GetFlag(FLAGS_checkpoint_keep)),
      absl::StrCat("--on_checkpoint_failure=", absl::GetFlag(FLAGS_on_checkpoint_failure)),
      absl::StrCat("--resume_step=", absl::GetFlag(FLAGS_resume_step)),
      absl::StrCat("--start_fresh=", absl::GetFlag(FLAGS_start_fresh) ? "true" : "false"),
      absl::StrCat("--allow_schedule_change=", absl::GetFlag(FLAGS_allow_schedule_change) ? "true" : "false"),
  };
  if (const std::string init = absl::GetFlag(FLAGS_init_from); !init.empty()) {
    // The servers may run elsewhere than here: the file by its absolute path.
    spec.server_flags.push_back(absl::StrCat("--init_from=", std::filesystem::absolute(init).string()));
  }
  spec.trainer_flags = {
      absl::StrCat("--steps=", steps),
      absl::StrCat("--batch=", absl::GetFlag(FLAGS_batch)),
      absl::StrCat("--seq_len=", absl::GetFlag(FLAGS_seq_len)),
      absl::StrCat("--prefetch=", absl::GetFlag(FLAGS_prefetch)),
      absl::StrCat("--recompute=", absl::GetFlag(FLAGS_recompute) ? "true" : "false"),
      absl::StrCat("--fetch_once_per_step=", absl::GetFlag(FLAGS_fetch_once_per_step) ? "true" : "false"),
      absl::StrCat("--reshard_after_forward=", absl::GetFlag(FLAGS_reshard_after_forward)),
      absl::StrCat("--stage=", absl::GetFlag(FLAGS_stage)),
      absl::StrCat("--encoding=", absl::GetFlag(FLAGS_encoding)),
      absl::StrCat("--weight_encoding=", absl::GetFlag(FLAGS_weight_encoding)),
      absl::StrCat("--grad_encoding=", absl::GetFlag(FLAGS_grad_encoding)),
      absl::StrCat("--quant_block=", absl::GetFlag(FLAGS_quant_block)),
      absl::StrCat("--error_feedback=", absl::GetFlag(FLAGS_error_feedback)),
      absl::StrCat("--device=", absl::GetFlag(FLAGS_device)),
      absl::StrCat("--attention=", absl::GetFlag(FLAGS_attention)),
      absl::StrCat("--data=", absl::GetFlag(FLAGS_data)),
      absl::StrCat("--log_every=", absl::GetFlag(FLAGS_log_every)),
      absl::StrCat("--server_retry_limit=", absl::FormatDuration(absl::GetFlag(FLAGS_server_retry_limit))),
      absl::StrCat("--rpc_timeout=", absl::FormatDuration(absl::GetFlag(FLAGS_rpc_timeout))),
  };
  if (!absl::GetFlag(FLAGS_fabric_rate).empty() || !absl::GetFlag(FLAGS_fabric_delay).empty()) {
    if (spec.fabric_group_size < 2) {
      std::fprintf(stderr, "pshard local: --fabric_rate and --fabric_delay shape fabric groups: they need "
                           "--fabric_group_size of 2 or more\n");
      return 2;
    }
    absl::Duration delay;
    const std::string delay_text = absl::GetFlag(FLAGS_fabric_delay);
    if (absl::StatusOr<std::string> rate = pshard::DescribeLinkRate(absl::GetFlag(FLAGS_fabric_rate)); !rate.ok()) {
      std::fprintf(stderr, "pshard local: --fabric_rate: %s\n", std::string(rate.status().message()).c_str());
      return 2;
    }
    if (!delay_text.empty() && (!absl::ParseDuration(delay_text, &delay) || delay < absl::ZeroDuration())) {
      std::fprintf(stderr, "pshard local: --fabric_delay=%s is not a duration such as 50us\n", delay_text.c_str());
      return 2;
    }
    spec.trainer_flags.push_back(absl::StrCat("--fabric_rate=", absl::GetFlag(FLAGS_fabric_rate)));
    spec.trainer_flags.push_back(absl::StrCat("--fabric_delay=", absl::GetFlag(FLAGS_fabric_delay)));
  }
  if (!absl::GetFlag(FLAGS_val_data).empty() || absl::GetFlag(FLAGS_eval_every) != 0) {
    // The trainer checks them (both or neither) before it starts.
    spec.evaluator_flags = {absl::StrCat("--val_data=", absl::GetFlag(FLAGS_val_data)),
                            absl::StrCat("--eval_every=", absl::GetFlag(FLAGS_eval_every)),
                            absl::StrCat("--val_batches=", absl::GetFlag(FLAGS_val_batches))};
  }
  if (const std::string placement = absl::GetFlag(FLAGS_placement); placement == "paired") {
    spec.paired = true;
  } else if (placement != "separate") {
    std::fprintf(stderr, "pshard local: --placement=%s is not separate or paired\n", placement.c_str());
    return 2;
  }
  if (const std::string transport = absl::GetFlag(FLAGS_transport); transport != "auto") {
    if (transport != "grpc" && transport != "ucx") {
      std::fprintf(stderr, "pshard local: --transport=%s is not auto, grpc or ucx\n", transport.c_str());
      return 2;
    }
    if (absl::GetFlag(FLAGS_link_mode) == "kernel" && transport != "grpc") {
      std::fprintf(stderr, "pshard local: --link_mode=kernel runs the trainers over gRPC\n");
      return 2;
    }
    spec.trainer_flags.push_back(absl::StrCat("--transport=", transport));
  }
  spec.trainer_restarts = absl::GetFlag(FLAGS_trainer_restarts);
  if (spec.trainer_restarts < 0) {
    std::fprintf(stderr, "pshard local: --trainer_restarts=%d must be 0 or more\n", spec.trainer_restarts);
    return 2;
  }
  spec.server_restarts = absl::GetFlag(FLAGS_server_restarts);
  if (spec.server_restarts < 0) {
    std::fprintf(stderr, "pshard local: --server_restarts=%d must be 0 or more\n", spec.server_restarts);
    return 2;
  }
  if (const std::string policy = absl::GetFlag(FLAGS_on_checkpoint_failure); policy != "stop" && policy != "continue") {
    std::fprintf(stderr, "pshard local: --on_checkpoint_failure=%s: expected stop or continue\n", policy.c_str());
    return 2;
  }
  spec.tls = absl::GetFlag(FLAGS_tls);
  spec.tokens = absl::GetFlag(FLAGS_auth_tokens);
  if (spec.tls && PSHARD_WITH_UCX && absl::GetFlag(FLAGS_transport) != "grpc") {
    std::fprintf(stderr,
                 "pshard local: warning: --tls protects gRPC only; with --transport=%s the trainers fetch weights "
                 "and push gradients over UCX, in plaintext (docs/security.md); --transport=grpc carries them over "
                 "TLS\n",
                 absl::GetFlag(FLAGS_transport).c_str());
  }
  if (pshard::SecurityOptionsFromFlags().any()) {
    std::fprintf(stderr,
                 "pshard local: --tls_cert, --tls_key, --tls_ca and --auth_token_file are for pshard status and "
                 "the programs; pshard local makes its own with --tls and --auth_tokens\n");
    return 2;
  }
  spec.link_mode = absl::GetFlag(FLAGS_link_mode);
  if (spec.link_mode == "kernel") {
    // The kernel shapes the rate; there is nothing left to emulate.
    const std::string rate = FlagOrEnv(absl::GetFlag(FLAGS_link_rate), "PSHARD_LINK_RATE");
    if (rate.empty() || !FlagOrEnv(absl::GetFlag(FLAGS_link_delay), "PSHARD_LINK_DELAY").empty() ||
        !FlagOrEnv(absl::GetFlag(FLAGS_link_jitter), "PSHARD_LINK_JITTER").empty() || spec.fabric_group_size > 1) {
      std::fprintf(stderr,
                   "pshard local: --link_mode=kernel shapes a --link_rate and nothing else: no --link_delay or "
                   "--link_jitter (this tc has no netem) and no fabric groups\n");
      return 2;
    }
    spec.kernel_rate = rate;
  } else if (spec.link_mode == "emulated") {
    spec.trainer_flags.insert(spec.trainer_flags.end(), link_flags->begin(), link_flags->end());
    spec.emulated_links = !link_flags->empty() || job_topology->shaped;
  } else {
    std::fprintf(stderr, "pshard local: --link_mode=%s is not emulated or kernel\n", spec.link_mode.c_str());
    return 2;
  }
  absl::Status s = pshard::RunLocalCluster(spec);
  if (absl::IsCancelled(s)) return 130;
  if (!s.ok()) {
    std::fprintf(stderr, "pshard: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}

// The current values of the flags `names`, as the registry holds them.
absl::StatusOr<pshard::FlagValues> CurrentFlagValues(const std::vector<std::string>& names) {
  pshard::FlagValues values;
  for (const std::string& name : names) {
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr) return absl::InvalidArgumentError(absl::StrCat("pshard has no flag --", name));
    values[name] = flag->CurrentValue();
  }
  return values;
}

int RunPlan() {
  absl::StatusOr<pshard::FlagValues> values = CurrentFlagValues(pshard::PlanFlagNames());
  absl::StatusOr<pshard::PlanInput> input =
      values.ok() ? pshard::PlanInputFromFlags(*values) : absl::StatusOr<pshard::PlanInput>(values.status());
  if (!input.ok()) {
    std::fprintf(stderr, "pshard plan: %s\n", std::string(input.status().message()).c_str());
    return 2;
  }
  absl::StatusOr<pshard::Plan> plan = pshard::MakePlan(*input);
  if (!plan.ok()) {
    std::fprintf(stderr, "pshard plan: %s\n", std::string(plan.status().message()).c_str());
    return 2;
  }
  const std::string text =
      absl::GetFlag(FLAGS_json) ? pshard::FormatJson(pshard::PlanToJson(*plan)) : pshard::FormatPlan(*plan);
  std::fputs(text.c_str(), stdout);
  return 0;
}

// The flags `pshard sweep` reads itself; every other flag given is an axis
// of its grid.
const std::vector<std::string>& SweepOwnFlags() {
  static const std::vector<std::string> own = {"out", "skip_steps", "measure_steps", "loss_steps", "calibrate", "plot",
                                               "point_timeout",
                                               "device_flops", "mfu", "fabric_rate", "fabric_delay",
                                               "step_overhead"};
  return own;
}

// The plan of a sweep point: its flags set in the registry for the time
// of reading them, then put back.
absl::StatusOr<pshard::Plan> PlanPoint(const pshard::SweepPoint& point, const pshard::Calibration& calibration) {
  std::vector<std::pair<absl::CommandLineFlag*, std::string>> saved;
  auto restore = [&saved] {
    std::string ignored;
    for (auto& [flag, value] : saved) flag->ParseFrom(value, &ignored);
  };
  for (const auto& [name, value] : point.flags) {
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr) {
      restore();
      return absl::InvalidArgumentError(absl::StrCat("pshard has no flag --", name));
    }
    saved.emplace_back(flag, flag->CurrentValue());
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      restore();
      return absl::InvalidArgumentError(absl::StrCat("--", name, "=", value, ": ", error));
    }
  }
  absl::StatusOr<pshard::FlagValues> values = CurrentFlagValues(pshard::PlanFlagNames());
  restore();
  if (!values.ok()) return values.status();
  (*values)["device_flops"] = absl::StrCat(calibration.device_flops);
  (*values)["mfu"] = absl::StrCat(calibration.mfu);
  (*values)["step_overhead"] = absl::FormatDuration(absl::Seconds(calibration.step_overhead));
  ASSIGN_OR_RETURN(pshard::PlanInput input, pshard::PlanInputFromFlags(*values));
  return pshard::MakePlan(input);
}

int RunSweep(const std::vector<std::string>& grid_args) {
  const std::vector<std::pair<std::string, std::string>> reserved = {
      {"steps", "each point runs --skip_steps + --measure_steps steps"},
      {"log_every", "the sweep reads the trainers' step logs"},
      {"eval_every", "with --loss_steps the sweep evaluates after the last of them"},
      {"run_dir", "each point runs in OUT/points/N"},
      {"metrics_port_base", "points take any free ports"},
      {"bin_dir", "points run this build's binaries"},
      {"timeout", "it is pshard status's"},
      {"params", "it is pshard plan's: a sweep runs the GPT of --layers, --d_model, --heads"},
      {"json", "it is pshard plan's"},
      {"optimizer_state_bytes", "it is pshard plan's"}};
  auto is_local_flag = [](const std::string& name) { return absl::FindCommandLineFlag(name) != nullptr; };
  absl::StatusOr<std::vector<pshard::SweepAxis>> axes = pshard::ParseGrid(grid_args, is_local_flag, reserved);
  if (!axes.ok()) {
    std::fprintf(stderr, "pshard sweep: %s\n", std::string(axes.status().message()).c_str());
    return 2;
  }
  pshard::SweepSpec spec;
  spec.axes = std::move(*axes);
  spec.out_dir = absl::GetFlag(FLAGS_out);
  spec.pshard_bin = SelfDir() + "/pshard";
  spec.skip_steps = absl::GetFlag(FLAGS_skip_steps);
  spec.measure_steps = absl::GetFlag(FLAGS_measure_steps);
  spec.loss_steps = absl::GetFlag(FLAGS_loss_steps);
  if (spec.loss_steps < 0) {
    std::fprintf(stderr, "pshard sweep: --loss_steps=%d must be 0 (no loss) or more\n", spec.loss_steps);
    return 2;
  }
  if (spec.loss_steps > 0 &&
      std::none_of(spec.axes.begin(), spec.axes.end(), [](const pshard::SweepAxis& a) { return a.flag == "val_data"; })) {
    std::fprintf(stderr, "pshard sweep: --loss_steps needs held-out text to evaluate on: --val_data=FILE\n");
    return 2;
  }
  spec.calibrate = absl::GetFlag(FLAGS_calibrate);
  spec.given.mfu = absl::GetFlag(FLAGS_mfu);
  if (absl::Duration d; absl::ParseDuration(absl::GetFlag(FLAGS_step_overhead), &d) && d >= absl::ZeroDuration()) {
    spec.given.step_overhead = absl::ToDoubleSeconds(d);
  } else {
    std::fprintf(stderr, "pshard sweep: --step_overhead=%s is not a duration such as 20ms\n",
                 absl::GetFlag(FLAGS_step_overhead).c_str());
    return 2;
  }
  spec.plot = absl::GetFlag(FLAGS_plot);
  spec.point_timeout = absl::GetFlag(FLAGS_point_timeout);
  if (spec.point_timeout <= absl::ZeroDuration()) {
    std::fprintf(stderr, "pshard sweep: --point_timeout must be positive\n");
    return 2;
  }
  spec.plot_script = SelfDir() + "/pshard-plot.py";
  // Measured once for the whole sweep.
  if (const std::string flops = absl::GetFlag(FLAGS_device_flops); flops == "auto") {
    spec.given.device_flops = pshard::MeasureSgemmFlops();
  } else if (!absl::SimpleAtod(flops, &spec.given.device_flops) || !(spec.given.device_flops > 0)) {
    std::fprintf(stderr, "pshard sweep: --device_flops=%s is not a FLOP rate or auto\n", flops.c_str());
    return 2;
  }
  spec.plan = PlanPoint;
  absl::Status s = pshard::RunSweep(spec);
  if (absl::IsCancelled(s)) {
    std::fprintf(stderr, "pshard sweep: %s; run the same command again to resume\n", std::string(s.message()).c_str());
    return 130;
  }
  if (!s.ok()) {
    std::fprintf(stderr, "pshard sweep: %s\n", std::string(s.message()).c_str());
    return absl::IsInvalidArgument(s) ? 2 : 1;
  }
  return 0;
}

int RunPlot(const std::vector<char*>& args) {
  if (args.size() != 3) {
    std::fprintf(stderr, "pshard plot: give one results.csv (pshard plot OUT/results.csv [--out=DIR])\n");
    return 2;
  }
  const std::string csv = args[2];
  std::string out = absl::GetFlag(FLAGS_out);
  if (out == "sweep") out = std::string(csv.substr(0, csv.rfind('/') == std::string::npos ? 0 : csv.rfind('/')));
  if (out.empty()) out = ".";
  absl::StatusOr<std::vector<std::string>> figures = pshard::PlotSweep(SelfDir() + "/pshard-plot.py", csv, out);
  if (!figures.ok()) {
    std::fprintf(stderr, "pshard plot: %s\n", std::string(figures.status().message()).c_str());
    return 1;
  }
  for (const std::string& f : *figures) std::printf("%s\n", f.c_str());
  return 0;
}

// Prints the job's table; exits 1 when a server or trainer did not answer.
int RunStatus() {
  absl::StatusOr<std::vector<std::string>> parsed = pshard::ParseAddressList(absl::GetFlag(FLAGS_servers), "--servers");
  if (!parsed.ok()) {
    std::fprintf(stderr,
                 "pshard status: %s\n  give one shard server of the job (--servers=host:port) or all of them "
                 "(--servers=host:port,host:port,...)\n",
                 std::string(parsed.status().message()).c_str());
    return 2;
  }
  std::vector<std::string> servers = *std::move(parsed);
  absl::StatusOr<std::shared_ptr<const pshard::ClientSecurity>> security =
      pshard::ClientSecurity::Create(pshard::SecurityOptionsFromFlags(), pshard::Role::kReader);
  if (!security.ok()) {
    std::fprintf(stderr, "pshard status: %s\n", std::string(security.status().message()).c_str());
    return 2;
  }
  const pshard::ClientSecurity* reader = security->get();
  if (servers.size() == 1) {
    absl::StatusOr<std::vector<std::string>> all =
        pshard::DiscoverShardAddresses(servers[0], absl::GetFlag(FLAGS_timeout), reader);
    if (all.ok()) {
      servers = std::move(*all);
    } else {
      // The table still shows the one server, UP or DOWN.
      std::fprintf(stderr, "pshard status: cannot find the rest of the job from %s: %s\n", servers[0].c_str(),
                   std::string(all.status().message()).c_str());
      const pshard::ClusterStatus one = pshard::QueryClusterStatus(servers, absl::GetFlag(FLAGS_timeout), reader);
      std::fputs(pshard::FormatClusterStatus(one).c_str(), stdout);
      return 1;
    }
  }
  const pshard::ClusterStatus status = pshard::QueryClusterStatus(servers, absl::GetFlag(FLAGS_timeout), reader);
  std::fputs(pshard::FormatClusterStatus(status).c_str(), stdout);
  return status.Healthy() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "pshard <command> [flags]\n"
      "  local   train a GPT on a local cluster: N shard servers + M trainers on loopback\n"
      "  status  --servers=host:port,...: steps, memory and waits of the shard servers, speed and loss of "
      "the trainers\n"
      "  plan    the memory, bytes per step and step time a job would have (the flags of local, and --params, "
      "--fabric_rate, --device_flops, --mfu, --json)\n"
      "  sweep   a grid of local jobs: flags of local given as lists (--link_rate=1gbit,100mbit --prefetch=1,2), "
      "each measured beside the plan's prediction, into --out (resumable; --plot for figures)\n"
      "  plot    OUT/results.csv: a sweep's figures\n"
      "  layout  the layout file of the GPT of --layers, --d_model, --heads, --context (--to=FILE)\n"
      "  export  --from=CHECKPOINT_DIR|HOST:PORT --to=FILE.safetensors [--dtype=bf16]: a job's weights in one file\n"
      "  reshard --from=DIR --to=NEW_DIR --num_shards=N: a checkpoint written for N shard servers\n"
      "  sample  --from=CHECKPOINT_DIR|HOST:PORT --prompt=TEXT [--tokens --temperature --top_k --seed]: text "
      "from the trained GPT");
  // A sweep's grid flags hold lists that their own types would refuse:
  // they are taken out before the flags are parsed.
  std::vector<std::string> grid_args;
  std::vector<char*> own_argv;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool sweep = argc > 1 && std::string(argv[1]) == "sweep";
    const std::string name = arg.rfind("--", 0) == 0 ? arg.substr(2, arg.find('=') - 2) : std::string();
    if (sweep && i > 1 && !name.empty() && !absl::c_linear_search(SweepOwnFlags(), name) && name != "help") {
      grid_args.push_back(arg);
    } else {
      own_argv.push_back(argv[i]);
    }
  }
  std::vector<char*> args = absl::ParseCommandLine(static_cast<int>(own_argv.size()), own_argv.data());
  if (args.size() < 2) {
    std::fprintf(stderr, "%s\n", absl::ProgramUsageMessage().data());
    return 2;
  }
  const std::string command = args[1];
  if (command == "local") return RunLocal();
  if (command == "status") return RunStatus();
  if (command == "plan") return RunPlan();
  if (command == "sweep") {
    if (args.size() != 2) {
      std::fprintf(stderr, "pshard sweep: unexpected argument '%s' (flags only: --flag=v1,v2,...)\n", args[2]);
      return 2;
    }
    return RunSweep(grid_args);
  }
  if (command == "plot") return RunPlot(args);
  if (command == "layout" || command == "export" || command == "reshard" || command == "sample") {
    if (args.size() != 2) {
      std::fprintf(stderr, "pshard %s: unexpected argument '%s' (flags only)\n", command.c_str(), args[2]);
      return 2;
    }
    if (command == "layout") return pshard::RunLayoutCommand();
    if (command == "export") return pshard::RunExportCommand();
    if (command == "reshard") return pshard::RunReshardCommand();
    return pshard::RunSampleCommand();
  }
  std::fprintf(stderr, "pshard: unknown command '%s'\n%s\n", command.c_str(), absl::ProgramUsageMessage().data());
  return 2;
}
