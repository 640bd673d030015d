// pshard-trainer: a CPU trainer rank. Fetches every unit just in time from
// the shard servers, computes, pushes gradients, and reports where the time
// goes.
#include <algorithm>
#include <cblas.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/host_port.h"
#include "common/link_rate.h"
#include "common/security/flags.h"
#include "common/signals.h"
#include "absl/strings/numbers.h"
#include "common/metrics/metrics_server.h"
#include "trainer_client/data/default_corpus.h"
#include "absl/strings/str_join.h"
#include "pshard/config.h"
#include "pshard/cuda_config.h"
#include "trainer_client/peak_flops.h"
#include "trainer_client/route_plan.h"
#include "trainer_client/group/socket/socket_group.h"
#include "trainer_client/trainer_metrics.h"
#include "trainer_client/rejoining_trainer.h"
#include "trainer_client/trainer.h"
#include "trainer_client/gpu_plugin.h"
#include "common/memory_policy.h"
#include "common/levers.h"

ABSL_FLAG(std::string, servers, "", "comma-separated host:port of every shard server");
ABSL_FLAG(int, rank, 0, "this trainer's rank, 0..M-1");
ABSL_FLAG(int64_t, steps, 100, "train until this step (exclusive)");
ABSL_FLAG(int, batch, 8, "sequences per micro-batch");
ABSL_FLAG(int, seq_len, 64, "tokens per sequence (<= model context)");
ABSL_FLAG(int, prefetch, 1, "units fetched ahead of the one computing (0: none)");
ABSL_FLAG(bool, fetch_once_per_step, false,
          "run all of a step's micro-batches in one pass: each unit is fetched once per step and its summed "
          "gradient pushed once, for the activations of every micro-batch (the job must accumulate on the "
          "trainer)");
ABSL_FLAG(std::string, reshard_after_forward, "true",
          "true: drop each unit's weights after its forward and fetch them again for its backward (ZeRO stage 3); "
          "false: keep every unit from its forward to its backward (one weight transfer per pass instead of two, "
          "for the memory of all units' weights); G (the fabric group's size): keep the 1/G of every unit this "
          "trainer fetched and all-gather it within the group for backward (the secondary shard)");
ABSL_FLAG(int, stage, 3,
          "ZeRO stage of the weights: 3 fetches them pass by pass (--reshard_after_forward says when they are "
          "dropped); 2 keeps a resident replica of every unit, fetched once per step and used by all its "
          "micro-batches; 1 is the same as 2 (gradients always go to their owners)");
ABSL_FLAG(std::string, attention, "auto",
          "GPU attention: fused (tiled, no T x T matrices; head size 64), materialized (cuBLAS around a softmax "
          "kernel), or auto (fused where it applies)");
ABSL_FLAG(bool, recompute, false,
          "keep only each block's input between forward and backward and recompute the block in backward "
          "(less activation memory, about one more forward of the blocks)");
ABSL_FLAG(std::string, device, "cpu",
          "where the model runs: cpu, cuda or cuda:N (needs a CUDA build), or auto (cuda when built and present)");
ABSL_FLAG(std::string, group_backend, "tcp",
          "fabric-group collectives: tcp (any trainers) or nccl (GPU trainers; needs an NCCL build)");
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
ABSL_FLAG(std::string, transport, "auto",
          "data path to the servers: auto (UCX where built and offered, else gRPC), grpc or ucx");
ABSL_FLAG(std::string, data, "", "training text file (bytes are tokens); empty: the built-in corpus");
ABSL_FLAG(uint64_t, data_seed, 1, "data order seed");
ABSL_FLAG(int, log_every, 10, "print progress every this many steps (0: never)");
ABSL_FLAG(std::string, val_data, "",
          "held-out text file (bytes are tokens) to evaluate on every --eval_every steps: forward only, "
          "nothing pushed");
ABSL_FLAG(int, eval_every, 0, "evaluate on --val_data after every this many steps and after the last (0: never)");
ABSL_FLAG(int, val_batches, 8, "micro-batches of --val_data per evaluation (the same ones every time)");
ABSL_FLAG(uint64_t, val_seed, 7, "which micro-batches of --val_data are evaluated");
ABSL_FLAG(std::string, step_log, "",
          "append one JSON line per step to this file: times, bytes, loss (empty: none)");
ABSL_FLAG(int, blas_threads, 1, "BLAS threads for this trainer");
ABSL_FLAG(absl::Duration, rpc_timeout, absl::Seconds(120), "deadline of every fetch and push");
ABSL_FLAG(std::string, link_rate, "",
          "emulated bandwidth of each node interface (or connection: --link_scope), e.g. 100mbit (default: $PSHARD_LINK_RATE, else none)");
ABSL_FLAG(std::string, link_delay, "", "emulated one-way latency, e.g. 5ms (default: $PSHARD_LINK_DELAY)");
ABSL_FLAG(std::string, link_scope, "node",
          "what shares the emulated rate: node (this trainer's node interface, and each server node's, per "
          "direction, shared by all their connections) or connection");
ABSL_FLAG(std::string, link_dir, "",
          "folder of the emulated nodes' bucket files, shared by the job's trainers (empty: only this trainer's "
          "node interface is shaped)");
ABSL_FLAG(std::string, link_jitter, "", "emulated jitter, e.g. 1ms (default: $PSHARD_LINK_JITTER)");
ABSL_FLAG(std::string, metrics_address, "127.0.0.1:0",
          "host:port of the Prometheus /metrics endpoint (port 0: any free port; empty: off)");
ABSL_FLAG(std::string, peak_flops, "auto",
          "FLOP/s that MFU is measured against: a number, 'auto' (a GPU's datasheet dense bf16 rate; on the CPU, "
          "this machine's measured sgemm rate) or 0 (no MFU)");
ABSL_FLAG(std::string, topology, "",
          "topology file (JSON: nodes, fabric groups, links; servers by address or as shard:K of --servers) to "
          "plan routes from");
ABSL_FLAG(bool, print_plan, false, "print this trainer's route plan (after joining) and exit");
ABSL_FLAG(absl::Duration, metrics_linger, absl::ZeroDuration(),
          "keep serving /metrics this long after the last step, so that Prometheus scrapes the final values "
          "(a few scrape intervals; a termination signal ends it early)");
ABSL_FLAG(std::string, fabric_rate, "",
          "emulated bandwidth of each fabric-group member's outgoing interface (--group_backend=tcp), e.g. 10gbit "
          "(empty: the machine's speed)");
ABSL_FLAG(std::string, fabric_delay, "", "emulated one-way latency between fabric-group members, e.g. 50us");
ABSL_FLAG(std::string, group_host, "127.0.0.1",
          "address this trainer's fabric-group endpoint listens on and is reached at (on the group's fabric)");
ABSL_FLAG(absl::Duration, join_timeout, absl::Seconds(60), "how long to wait for the servers at start");
ABSL_FLAG(absl::Duration, server_retry_limit, absl::Minutes(10),
          "after a step fails because a server went away, restarted or rolled back, rejoin the servers (with "
          "backoff) for at most this long, then exit; 0: exit at the first such failure");

namespace {

// A flag's value, or the environment variable's when the flag is empty.
std::string FlagOrEnv(const std::string& flag, const char* env) {
  if (!flag.empty()) return flag;
  const char* value = std::getenv(env);
  return value == nullptr ? std::string() : std::string(value);
}

std::string Ms(absl::Duration d) { return absl::StrFormat("%.0f ms", absl::ToDoubleMilliseconds(d)); }

std::string Rate(double per_second) {
  if (per_second >= 1e6) return absl::StrFormat("%.1fM", per_second / 1e6);
  if (per_second >= 1e3) return absl::StrFormat("%.1fk", per_second / 1e3);
  return absl::StrFormat("%.0f", per_second);
}

// The rate MFU is measured against: a CPU model's measured sgemm rate, a
// GPU's datasheet bf16 rate.
double PeakFlops(const pshard::UnitModel& model, const std::string& device) {
  if (model.DeviceName() != "cpu") {
    const absl::StatusOr<int> index = pshard::CudaDeviceIndex(device);
    const absl::StatusOr<const pshard::GpuPlugin*> gpu = pshard::LoadGpuPlugin();  // loaded: the model runs on it
    return index.ok() && gpu.ok() ? (*gpu)->peak_bf16_flops(*index) : 0.0;
  }
  return pshard::MeasureSgemmFlops();
}

int Run() {
  static std::atomic<bool> stop{false};
  pshard::CallOnTerminationSignal([](int) { stop = true; });
  openblas_set_num_threads(absl::GetFlag(FLAGS_blas_threads));

  absl::StatusOr<pshard::WireEncodings> encodings =
      pshard::ParseWireEncodings(absl::GetFlag(FLAGS_encoding), absl::GetFlag(FLAGS_weight_encoding),
                                 absl::GetFlag(FLAGS_grad_encoding), absl::GetFlag(FLAGS_quant_block));
  if (!encodings.ok()) {
    std::fprintf(stderr, "pshard-trainer: %s\n", encodings.status().ToString().c_str());
    return 2;
  }
  absl::StatusOr<bool> error_feedback = pshard::ParseErrorFeedback(absl::GetFlag(FLAGS_error_feedback), encodings->grads);
  if (!error_feedback.ok()) {
    std::fprintf(stderr, "pshard-trainer: %s\n", std::string(error_feedback.status().message()).c_str());
    return 2;
  }
  pshard::ShardClient::Options copts;
  {
    absl::StatusOr<std::vector<std::string>> servers =
        pshard::ParseAddressList(absl::GetFlag(FLAGS_servers), "--servers");
    if (!servers.ok()) {
      std::fprintf(stderr, "pshard-trainer: %s\n", std::string(servers.status().message()).c_str());
      return 2;
    }
    copts.server_addresses = *std::move(servers);
  }
  copts.trainer_rank = absl::GetFlag(FLAGS_rank);
  copts.encodings = *encodings;
  copts.error_feedback = *error_feedback;
  copts.rpc_timeout = absl::GetFlag(FLAGS_rpc_timeout);
  copts.join_timeout = absl::GetFlag(FLAGS_join_timeout);
  copts.transport = absl::GetFlag(FLAGS_transport);
  {
    absl::StatusOr<std::shared_ptr<const pshard::ClientSecurity>> security =
        pshard::ClientSecurity::Create(pshard::SecurityOptionsFromFlags(), pshard::Role::kTrainer);
    if (!security.ok()) {
      std::fprintf(stderr, "pshard-trainer: %s\n", std::string(security.status().message()).c_str());
      return 2;
    }
    copts.security = *security;
  }
  const std::string val_path = absl::GetFlag(FLAGS_val_data);
  const int eval_every = absl::GetFlag(FLAGS_eval_every);
  const int val_batches = absl::GetFlag(FLAGS_val_batches);
  if (eval_every < 0 || val_batches < 1 || (eval_every > 0) != !val_path.empty()) {
    std::fprintf(stderr,
                 "pshard-trainer: --val_data and --eval_every go together (--eval_every=K >= 1 with a file; "
                 "got --val_data=\"%s\" --eval_every=%d), and --val_batches=%d must be >= 1\n",
                 val_path.c_str(), eval_every, val_batches);
    return 2;
  }
  std::optional<pshard::TokenDataset> val_data;
  if (!val_path.empty()) {
    absl::StatusOr<pshard::TokenDataset> loaded = pshard::TokenDataset::FromFile(val_path);
    if (!loaded.ok()) {
      std::fprintf(stderr, "pshard-trainer: --val_data: %s\n", loaded.status().ToString().c_str());
      return 2;
    }
    if (loaded->size() <= absl::GetFlag(FLAGS_seq_len)) {
      std::fprintf(stderr, "pshard-trainer: --val_data=%s holds %lld tokens, not more than --seq_len=%d\n",
                   val_path.c_str(), static_cast<long long>(loaded->size()), absl::GetFlag(FLAGS_seq_len));
      return 2;
    }
    val_data = *std::move(loaded);
  }
  copts.join_log = [rank = copts.trainer_rank](const std::string& line) {
    std::fprintf(stderr, "pshard-trainer %d: %s\n", rank, line.c_str());
  };
  absl::StatusOr<pshard::LinkSpec> link =
      pshard::LinkSpec::Parse(FlagOrEnv(absl::GetFlag(FLAGS_link_rate), "PSHARD_LINK_RATE"),
                              FlagOrEnv(absl::GetFlag(FLAGS_link_delay), "PSHARD_LINK_DELAY"),
                              FlagOrEnv(absl::GetFlag(FLAGS_link_jitter), "PSHARD_LINK_JITTER"));
  if (!link.ok()) {
    std::fprintf(stderr, "pshard-trainer: %s\n", link.status().ToString().c_str());
    return 2;
  }
  copts.link = *link;
  const absl::StatusOr<pshard::LinkSpec> fabric =
      pshard::LinkSpec::Parse(absl::GetFlag(FLAGS_fabric_rate), absl::GetFlag(FLAGS_fabric_delay), "");
  if (!fabric.ok()) {
    std::fprintf(stderr, "pshard-trainer: --fabric_rate/--fabric_delay: %s\n", fabric.status().ToString().c_str());
    return 2;
  }
  copts.link_scope = absl::GetFlag(FLAGS_link_scope);
  copts.link_dir = absl::GetFlag(FLAGS_link_dir);
  if (const std::string rate = FlagOrEnv(absl::GetFlag(FLAGS_link_rate), "PSHARD_LINK_RATE"); !rate.empty()) {
    // Parsed above: the description cannot fail. It flags a bytes unit.
    std::fprintf(stderr, "pshard-trainer %d: emulated link rate %s\n", copts.trainer_rank,
                 pshard::DescribeLinkRate(rate).value_or("?").c_str());
  }
  std::optional<pshard::Topology> topology;
  if (const std::string file = absl::GetFlag(FLAGS_topology); !file.empty()) {
    absl::StatusOr<pshard::Topology> loaded = pshard::Topology::Load(file);
    if (!loaded.ok()) {
      std::fprintf(stderr, "pshard-trainer: %s\n", loaded.status().ToString().c_str());
      return 2;
    }
    topology = std::move(*loaded);
    if (absl::Status s = topology->ResolveShards(copts.server_addresses); !s.ok()) {
      std::fprintf(stderr, "pshard-trainer: %s: %s\n", file.c_str(), std::string(s.message()).c_str());
      return 2;
    }
  }
  absl::StatusOr<pshard::RoutePlan> plan = pshard::PlanRoutes(
      topology ? &*topology : nullptr, copts.trainer_rank, copts.server_addresses, PSHARD_WITH_UCX != 0);
  if (!plan.ok()) {
    std::fprintf(stderr, "pshard-trainer: %s\n", plan.status().ToString().c_str());
    return 2;
  }
  if (topology) {
    copts.transport_by_address = plan->TransportByAddress();
    copts.node = plan->node;
    for (const pshard::Topology::Node& node : topology->nodes) {
      for (const std::string& address : node.servers) copts.node_by_address[address] = node.name;
    }
    for (const pshard::Topology::Link& l : topology->links) {
      if ((l.a != plan->node && l.b != plan->node) || (l.rate.empty() && l.delay.empty())) continue;
      absl::StatusOr<pshard::LinkSpec> own =
          pshard::LinkSpec::Parse(l.rate, l.delay, FlagOrEnv(absl::GetFlag(FLAGS_link_jitter), "PSHARD_LINK_JITTER"));
      if (!own.ok()) {
        std::fprintf(stderr, "pshard-trainer: topology link %s-%s: %s\n", l.a.c_str(), l.b.c_str(),
                     std::string(own.status().message()).c_str());
        return 2;
      }
      copts.link_to_node[l.a == plan->node ? l.b : l.a] = *own;
    }
  }
  // The shaping this trainer applies, as it applies it: the topology's
  // links to other nodes, and --link_rate's everywhere else.
  std::string links = copts.link.ToString();
  if (!copts.link_to_node.empty()) {
    std::vector<std::string> shaped;
    for (const auto& [node, spec] : copts.link_to_node) shaped.push_back(absl::StrCat(node, " ", spec.ToString()));
    links = absl::StrCat("shaped by the topology (node ", copts.node, ": to ", absl::StrJoin(shaped, "; to "),
                         "; elsewhere ", links, ")");
    std::fprintf(stderr, "pshard-trainer %d: links %s\n", copts.trainer_rank, links.c_str());
  }
  const std::vector<int>& fabric_group = plan->fabric_group;
  for (size_t i = 1; i < fabric_group.size(); ++i) {
    if (fabric_group[i] != fabric_group[0] + static_cast<int>(i)) {
      std::fprintf(stderr, "pshard-trainer: fabric group [%s] is not a run of consecutive ranks\n",
                   absl::StrJoin(fabric_group, ",").c_str());
      return 2;
    }
  }
  if (fabric->enabled() && fabric_group.size() < 2) {
    // Nothing would carry it: refused, not ignored.
    std::fprintf(stderr,
                 "pshard-trainer: --fabric_rate/--fabric_delay shape a fabric group's fabric, and trainer %d is in "
                 "none (the topology's fabric_groups, or pshard local --fabric_group_size)\n",
                 copts.trainer_rank);
    return 2;
  }
  double peak_flops = 0.0;
  const bool measure_peak = absl::GetFlag(FLAGS_peak_flops) == "auto";  // once the model is known
  if (const std::string peak = absl::GetFlag(FLAGS_peak_flops);
      !measure_peak && (!absl::SimpleAtod(peak, &peak_flops) || peak_flops < 0)) {
    std::fprintf(stderr, "pshard-trainer: --peak_flops=%s is not a number, 'auto' or 0\n", peak.c_str());
    return 2;
  }
  pshard::metrics::Registry registry;
  std::unique_ptr<pshard::metrics::MetricsServer> metrics_server;
  if (const std::string address = absl::GetFlag(FLAGS_metrics_address); !address.empty()) {
    auto started = pshard::metrics::MetricsServer::Start(address, &registry);
    if (!started.ok()) {
      std::fprintf(stderr, "pshard-trainer: %s\n", started.status().ToString().c_str());
      return 2;
    }
    metrics_server = std::move(*started);
    copts.metrics_address = metrics_server->address();
    std::fprintf(stderr, "pshard-trainer %d: metrics on %s\n", copts.trainer_rank, copts.metrics_address.c_str());
  }
  auto client = pshard::ShardClient::Connect(copts);
  if (!client.ok()) {
    std::fprintf(stderr, "pshard-trainer: %s\n", client.status().ToString().c_str());
    return 1;
  }
  {
    // What carries each link (for UCX, its transports: a fall back from
    // shared memory to tcp shows here).
    std::map<std::string, std::vector<std::string>> links;  // description -> shards
    for (size_t s = 0; s < (*client)->shard_addresses().size(); ++s) {
      links[(*client)->transport_description(static_cast<int>(s))].push_back(absl::StrCat(s));
    }
    for (const auto& [description, shards] : links) {
      std::fprintf(stderr, "pshard-trainer %d: shard%s %s: %s\n", copts.trainer_rank, shards.size() > 1 ? "s" : "",
                   absl::StrJoin(shards, ",").c_str(), description.c_str());
    }
    std::vector<std::string> over_ucx;
    for (size_t s = 0; s < (*client)->shard_addresses().size(); ++s) {
      if ((*client)->transport_name(static_cast<int>(s)) == "ucx") over_ucx.push_back(absl::StrCat(s));
    }
    if (copts.security->tls() && !over_ucx.empty()) {
      std::fprintf(stderr,
                   "pshard-trainer %d: warning: --tls protects gRPC only; the weights and gradients of shard%s %s "
                   "travel over UCX in plaintext (docs/security.md); --transport=grpc carries them over TLS\n",
                   copts.trainer_rank, over_ucx.size() > 1 ? "s" : "", absl::StrJoin(over_ucx, ",").c_str());
    }
  }
  if (absl::GetFlag(FLAGS_print_plan)) {
    std::printf("%s", plan->ToString().c_str());
    const std::vector<std::string> shards = (*client)->shard_addresses();
    for (size_t s = 0; s < shards.size(); ++s) {
      std::printf("  shard %zu = %s: %s in use\n", s, shards[s].c_str(), (*client)->transport_description(s).c_str());
    }
    return 0;
  }
  const std::string path = absl::GetFlag(FLAGS_data);
  absl::StatusOr<pshard::TokenDataset> data =
      path.empty() ? pshard::TokenDataset::FromText(pshard::DefaultCorpus()) : pshard::TokenDataset::FromFile(path);
  if (!data.ok()) {
    std::fprintf(stderr, "pshard-trainer: %s\n", data.status().ToString().c_str());
    return 2;
  }
  pshard::TrainerOptions topts;
  std::unique_ptr<pshard::GroupCollective> group;
  if (fabric_group.size() > 1) {
    // The members meet at shard 0, then talk directly over TCP.
    const int member = copts.trainer_rank - fabric_group[0];
    const int size = static_cast<int>(fabric_group.size());
    const std::string key = absl::StrCat("fabric:", absl::StrJoin(fabric_group, ","));
    const pshard::RendezvousFn rendezvous = [&](const std::string& payload) {
      return (*client)->Rendezvous(key, member, size, payload, copts.join_timeout);
    };
    absl::StatusOr<std::unique_ptr<pshard::GroupCollective>> joined;
    if (const std::string backend = absl::GetFlag(FLAGS_group_backend); backend == "tcp") {
      joined = pshard::JoinSocketGroup(absl::GetFlag(FLAGS_group_host), member, size, rendezvous, copts.rpc_timeout,
                                       *fabric);
    } else if (fabric->enabled()) {
      joined = absl::InvalidArgumentError(absl::StrCat("--fabric_rate and --fabric_delay emulate a tcp group's fabric; "
                                                       "--group_backend=", backend, " runs on the real one"));
    } else if (backend == "nccl") {
      const absl::StatusOr<int> index = pshard::CudaDeviceIndex(absl::GetFlag(FLAGS_device));
      const absl::StatusOr<const pshard::GpuPlugin*> gpu = pshard::LoadGpuPlugin();
      if (!index.ok()) {
        joined = index.status();
      } else if (!gpu.ok()) {
        joined = absl::Status(gpu.status().code(), absl::StrCat("--group_backend=nccl: ", gpu.status().message()));
      } else if ((*gpu)->join_nccl_group == nullptr) {
        joined = absl::FailedPreconditionError("--group_backend=nccl needs a build with -DPSHARD_WITH_NCCL=ON");
      } else {
        joined = (*gpu)->join_nccl_group(member, size, *index, rendezvous);
      }
    } else {
      joined = absl::InvalidArgumentError(absl::StrCat("--group_backend=", backend, ": expected tcp or nccl"));
    }
    if (!joined.ok()) {
      std::fprintf(stderr, "pshard-trainer: %s\n", joined.status().ToString().c_str());
      return 1;
    }
    group = std::move(*joined);
    topts.group = group.get();
    std::fprintf(stderr, "pshard-trainer %d: member %d of fabric group [%s]%s\n", copts.trainer_rank, member,
                 absl::StrJoin(fabric_group, ",").c_str(),
                 fabric->enabled() ? absl::StrCat(", fabric emulated at ", fabric->ToString()).c_str() : "");
  }
  topts.batch = absl::GetFlag(FLAGS_batch);
  topts.seq_len = absl::GetFlag(FLAGS_seq_len);
  topts.prefetch_depth = absl::GetFlag(FLAGS_prefetch);
  topts.data_seed = absl::GetFlag(FLAGS_data_seed);
  topts.recompute_blocks = absl::GetFlag(FLAGS_recompute);
  topts.fetch_once_per_step = absl::GetFlag(FLAGS_fetch_once_per_step);
  absl::StatusOr<pshard::ReshardAfterForward> reshard =
      pshard::ParseReshardAfterForward(absl::GetFlag(FLAGS_reshard_after_forward));
  if (!reshard.ok()) {
    std::fprintf(stderr, "pshard-trainer: %s\n", std::string(reshard.status().message()).c_str());
    return 2;
  }
  topts.reshard_after_forward = reshard->reshard;
  topts.secondary_shard = reshard->group;
  if (absl::Status s = pshard::CheckStage(absl::GetFlag(FLAGS_stage)); !s.ok()) {
    std::fprintf(stderr, "pshard-trainer: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  topts.stage = absl::GetFlag(FLAGS_stage);
  topts.attention = absl::GetFlag(FLAGS_attention);
  topts.device = absl::GetFlag(FLAGS_device);
  auto trainer = pshard::Trainer::Create(client->get(), &*data, topts);
  if (!trainer.ok()) {
    std::fprintf(stderr, "pshard-trainer: %s\n", trainer.status().ToString().c_str());
    return 2;
  }
  const pshard::UnitModel& model = (*trainer)->model();
  if (measure_peak) peak_flops = PeakFlops(model, topts.device);
  // Labelled with the data path in use (shard 0's; "auto" may mix them).
  pshard::TrainerMetrics metrics(registry, copts.trainer_rank, (*client)->transport_name(0),
                                 model.DeviceName() == "cpu" ? "cpu" : "cuda", peak_flops);
  const pshard::ModelMemory memory = model.Memory();
  metrics.SetModelMemory(memory);
  const pshard::HostMemory host_memory = pshard::HostMemoryOf(topts, **client);
  metrics.SetHostMemory(host_memory);
  const pshard::JobConfig job = (*client)->job();  // a copy: the client is replaced on rejoin
  metrics.SetSettings(pshard::SettingsOf(topts, **client, model));
  const int rank = copts.trainer_rank;
  const int64_t steps = absl::GetFlag(FLAGS_steps);
  const int log_every = absl::GetFlag(FLAGS_log_every);
  if (rank == 0) {
    const auto mib = [](int64_t bytes) { return absl::StrFormat("%.1f MiB", bytes / 1048576.0); };
    std::printf("pshard: %lld parameters in %zu units over %d shard servers, %d trainers; %s on the wire, "
                "prefetch %d; %s to shard 0, links %s; model on %s, %s of activations per trainer%s%s\n",
                static_cast<long long>((*client)->layout().spec.TotalParameters()),
                (*client)->layout().spec.units.size(), job.num_shards, job.num_trainers,
                encodings->ToString().c_str(), topts.prefetch_depth,
                (*client)->transport_name(0).c_str(), links.c_str(), model.DeviceName().c_str(),
                absl::StrCat(mib(memory.activations),
                             model.lanes() > 1 ? absl::StrCat(" (", model.lanes(), " micro-batches held at once)")
                                               : "")
                    .c_str(),
                absl::StrCat(topts.recompute_blocks ? " (blocks recomputed in backward)" : "",
                             host_memory.secondary_shard > 0
                                 ? absl::StrCat("; secondary shard: 1/", topts.secondary_shard,
                                                " of every unit kept from forward (",
                                                mib(host_memory.secondary_shard),
                                                "), all-gathered in the fabric group for backward")
                             : topts.stage < 3 ? absl::StrCat("; stage ", topts.stage, ": a resident replica of every "
                                                            "unit, fetched once per step: ",
                                                            mib(host_memory.weights_held), " of weights")
                             : topts.reshard_after_forward
                                 ? ""
                                 : absl::StrCat("; every unit kept from forward to backward: ",
                                                mib(host_memory.weights_held), " of weights"),
                             host_memory.residuals > 0
                                 ? absl::StrCat("; error feedback: ", mib(host_memory.residuals),
                                                " of gradient residuals in host memory")
                                 : "")
                    .c_str(),
                memory.device > 0
                    ? absl::StrCat("; ", mib(memory.device), " of device memory = activations + ",
                                   mib(memory.weights), " of bf16 weights (", topts.prefetch_depth + 1,
                                   " units: prefetch depth + 1) + ", mib(memory.gradients),
                                   " of fp32 gradients (2 units: one computing, one copying out",
                                   model.lanes() > 1 ? ", each with room for the micro-batches' partial sums)" : ")")
                          .c_str()
                    : "");
    std::fflush(stdout);
  }

  std::deque<double> recent_losses;
  pshard::StepTimes window, total;
  int window_steps = 0;
  int64_t done = 0;
  int64_t report_tokens = 0;  // this trainer's tokens per step
  double step_flops = 0.0;    // and model FLOPs
  int64_t wire_fetched = 0;   // all steps, on the wire to and from the servers
  int64_t wire_pushed = 0;
  int64_t fabric_bytes = 0;   // received from the fabric group, all steps
  std::unique_ptr<FILE, int (*)(FILE*)> step_log(nullptr, &std::fclose);
  if (const std::string path = absl::GetFlag(FLAGS_step_log); !path.empty()) {
    step_log.reset(std::fopen(path.c_str(), "a"));
    if (step_log == nullptr) {
      std::fprintf(stderr, "pshard-trainer %d: cannot open --step_log=%s: %s\n", rank, path.c_str(),
                   std::strerror(errno));
      return 2;
    }
  }
  // A step that fails because a server went away, restarted or rolled
  // back is retried after a rejoin (RejoiningTrainer).
  pshard::RejoiningTrainer::Options rejoining;
  rejoining.client = copts;
  rejoining.trainer = topts;
  rejoining.retry_limit = absl::GetFlag(FLAGS_server_retry_limit);
  rejoining.stopping = [] { return stop.load(); };
  pshard::RejoiningTrainer runner(rejoining, &*data, *std::move(client), *std::move(trainer));
  while (runner.next_step() < steps && !stop) {
    absl::StatusOr<pshard::StepReport> r = runner.Step();
    if (!r.ok()) {
      std::fprintf(stderr, "pshard-trainer %d: step %lld failed: %s\n", rank,
                   static_cast<long long>(runner.next_step()), r.status().ToString().c_str());
      return 1;
    }
    const int64_t step = r->step;
    ++done;
    report_tokens = r->tokens;
    step_flops = r->flops;
    wire_fetched += r->bytes_fetched;
    wire_pushed += r->bytes_pushed;
    fabric_bytes += r->fabric_gathered + r->fabric_reduced;
    metrics.RecordStep(*r);
    if (step_log != nullptr) {
      const std::string line = pshard::StepLogLine(rank, *r);
      std::fputs(line.c_str(), step_log.get());
      std::fflush(step_log.get());
    }
    recent_losses.push_back(r->loss);
    if (recent_losses.size() > 10) recent_losses.pop_front();
    for (pshard::StepTimes* t : {&window, &total}) {
      t->wall += r->times.wall;
      t->compute += r->times.compute;
      t->comm_exposed += r->times.comm_exposed;
      t->comm_busy += r->times.comm_busy;
      t->data += r->times.data;
      t->other += r->times.other;
    }
    ++window_steps;
    if (val_data && ((step + 1) % eval_every == 0 || step + 1 == steps)) {
      // Version step + 1: the weights after this step's update, which the
      // next step fetches too. A server lost meanwhile fails the
      // evaluation; the next step rejoins, and this evaluation is skipped.
      absl::StatusOr<pshard::EvalReport> eval = runner.trainer().Evaluate(
          step + 1, *val_data, val_batches, absl::GetFlag(FLAGS_val_seed));
      if (eval.ok()) {
        metrics.RecordEval(*eval);
        std::printf("eval after step %lld | val loss %.5f over %d batches (%lld tokens) | %s\n",
                    static_cast<long long>(step + 1), eval->loss, eval->batches,
                    static_cast<long long>(eval->tokens), Ms(eval->wall).c_str());
        std::fflush(stdout);
      } else if (pshard::IsRecoverableFailure(eval.status())) {
        std::fprintf(stderr, "pshard-trainer %d: evaluation after step %lld skipped: %s\n", rank,
                     static_cast<long long>(step + 1), eval.status().ToString().c_str());
      } else {
        std::fprintf(stderr, "pshard-trainer %d: evaluation after step %lld failed: %s\n", rank,
                     static_cast<long long>(step + 1), eval.status().ToString().c_str());
        return 1;
      }
    }
    if (log_every > 0 && ((step + 1) % log_every == 0 || step + 1 == steps)) {
      const double tokens = static_cast<double>(r->tokens) * job.num_trainers * window_steps;
      // The job's rate: this trainer's, times the trainers (they run in step).
      std::printf("step %lld/%lld | loss %.3f | %s tok/s (cluster) | compute %s | comm %s (exposed %s)\n",
                  static_cast<long long>(step + 1), static_cast<long long>(steps), r->loss,
                  Rate(tokens / absl::ToDoubleSeconds(window.wall)).c_str(),
                  Ms(window.compute / window_steps).c_str(), Ms(window.comm_busy / window_steps).c_str(),
                  Ms(window.comm_exposed / window_steps).c_str());
      std::fflush(stdout);
      window = pshard::StepTimes();
      window_steps = 0;
    }
  }
  if (done == 0) return stop ? 130 : 0;
  double final_loss = 0.0;
  for (double l : recent_losses) final_loss += l;
  final_loss /= static_cast<double>(recent_losses.size());
  const double wall = absl::ToDoubleSeconds(total.wall);
  auto pct = [&](absl::Duration d) { return 100.0 * absl::ToDoubleSeconds(d) / wall; };
  const auto per_step = [&](absl::Duration d) {
    return absl::StrFormat("%.1f ms", absl::ToDoubleMilliseconds(d) / static_cast<double>(done));
  };
  std::printf("trainer %d summary: %lld steps | final loss %.3f (mean of last %zu steps) | unigram entropy "
              "%.3f nats\n  time: compute %.1f%% | exposed comm %.1f%% | data %.1f%% | other %.1f%% | comm "
              "busy %.1f%% (hidden behind compute: %.1f%%)\n  per step: wall %s | compute %s | comm busy %s | "
              "exposed comm %s | fetched %.2f + pushed %.2f = %.2f MiB on the wire | %.0f tok/s (this trainer)%s\n",
              rank, static_cast<long long>(done), final_loss, recent_losses.size(),
              data->UnigramEntropyNats(), pct(total.compute), pct(total.comm_exposed), pct(total.data),
              pct(total.other), pct(total.comm_busy), pct(total.comm_busy - total.comm_exposed),
              per_step(total.wall).c_str(), per_step(total.compute).c_str(), per_step(total.comm_busy).c_str(),
              per_step(total.comm_exposed).c_str(), static_cast<double>(wire_fetched) / done / 1048576.0,
              static_cast<double>(wire_pushed) / done / 1048576.0,
              static_cast<double>(wire_fetched + wire_pushed) / done / 1048576.0,
              static_cast<double>(report_tokens) * static_cast<double>(done) / wall,
              peak_flops > 0 ? absl::StrFormat(" | MFU %.1f%% of %s", 100.0 * step_flops * done / wall / peak_flops,
                                               peak_flops >= 1e12 ? absl::StrFormat("%.0f TFLOP/s", peak_flops / 1e12)
                                                                  : absl::StrFormat("%.1f GFLOP/s", peak_flops / 1e9))
                                   .c_str()
                             : "");
  std::printf("  memory: %.1f MiB of activations | %.1f MiB of fp32 weights held at the peak of a pass | %.1f MiB of "
              "secondary shard | %.1f MiB of error-feedback residuals\n",
              memory.activations / 1048576.0, host_memory.weights_held / 1048576.0,
              host_memory.secondary_shard / 1048576.0, host_memory.residuals / 1048576.0);
  if (fabric_bytes > 0) {
    std::printf("  fabric group: %.2f MiB received per step (all-gathers and reduce-scatters)\n",
                static_cast<double>(fabric_bytes) / done / 1048576.0);
  }
  std::fflush(stdout);
  if (const absl::Duration linger = absl::GetFlag(FLAGS_metrics_linger); linger > absl::ZeroDuration() && !stop) {
    std::fprintf(stderr, "pshard-trainer %d: serving final metrics for %s\n", rank,
                 absl::FormatDuration(linger).c_str());
    const absl::Time until = absl::Now() + linger;
    while (!stop && absl::Now() < until) absl::SleepFor(std::min(absl::Milliseconds(100), until - absl::Now()));
  }
  return stop ? 130 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("pshard-trainer --servers=h:p,h:p,... --rank=R [--steps=S ...]");
  absl::ParseCommandLine(argc, argv);
  pshard::ReuseFreedMemory();
  return Run();
}
