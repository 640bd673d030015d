#include "lab/plan_report.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace pshard {
namespace {

// GB (10^9 bytes, as ZeRO's table counts) from 0.1 GB up, MiB below.
std::string Gb(double bytes) {
  if (bytes < 1e8) return absl::StrFormat("%.2f MiB", bytes / 1048576.0);
  return absl::StrFormat("%.1f GB", bytes / 1e9);
}

std::string Mib(double bytes) {
  if (bytes >= 1024.0 * 1048576.0) return absl::StrFormat("%.2f GiB", bytes / (1024.0 * 1048576.0));
  return absl::StrFormat("%.2f MiB", bytes / 1048576.0);
}

std::string Ms(double seconds) { return absl::StrFormat("%.1f ms", seconds * 1e3); }

std::string Count(double n) {
  if (n >= 1e9) return absl::StrFormat("%.2fB", n / 1e9);
  if (n >= 1e6) return absl::StrFormat("%.2fM", n / 1e6);
  if (n >= 1e3) return absl::StrFormat("%.1fK", n / 1e3);
  return absl::StrFormat("%.0f", n);
}

std::string LinkText(const LinkModel& link) {
  const double bits = link.bytes_per_second * 8;
  const std::string rate = bits <= 0     ? std::string("unlimited")
                           : bits >= 1e9 ? absl::StrFormat("%.4g Gbit/s", bits / 1e9)
                                         : absl::StrFormat("%.4g Mbit/s", bits / 1e6);
  return absl::StrCat(rate, ", ", absl::FormatDuration(link.latency), " one way");
}

// The topology's nodes and own links, as the plan used them.
std::string NodesText(const PlanInput::Nodes& nodes) {
  std::vector<std::string> placed, links;
  for (size_t n = 0; n < nodes.names.size(); ++n) {
    std::vector<std::string> here;
    for (size_t s = 0; s < nodes.of_server.size(); ++s) {
      if (nodes.of_server[s] == static_cast<int>(n)) here.push_back(absl::StrCat("shard:", s));
    }
    for (size_t r = 0; r < nodes.of_trainer.size(); ++r) {
      if (nodes.of_trainer[r] == static_cast<int>(n)) here.push_back(absl::StrCat("trainer ", r));
    }
    placed.push_back(absl::StrCat(nodes.names[n], " (", absl::StrJoin(here, ", "), ")"));
  }
  for (const auto& [pair, link] : nodes.links) {
    links.push_back(absl::StrCat(nodes.names[pair.first], "-", nodes.names[pair.second], " ", LinkText(link)));
  }
  return absl::StrCat("topology ", nodes.file, ": nodes ", absl::StrJoin(placed, ", "), "; ",
                      links.empty() ? std::string("no links of their own (every pair over the slow link)")
                                    : absl::StrCat("own links ", absl::StrJoin(links, "; "),
                                                   " (other pairs over the slow link)"));
}

JsonValue Num(double v) { return JsonValue::Number(v); }

JsonValue BytesJson(const StepBytes& b) {
  return JsonValue::MakeObject({{"fetched", Num(b.fetched)},
                                {"pushed", Num(b.pushed)},
                                {"fabric_gathered", Num(b.gathered)},
                                {"fabric_reduced", Num(b.reduced)}});
}

JsonValue TimeJson(const StepTime& t) {
  return JsonValue::MakeObject({{"compute_seconds", Num(t.compute)},
                                {"comm_seconds", Num(t.comm)},
                                {"exposed_seconds", Num(t.exposed)},
                                {"step_seconds", Num(t.step)},
                                {"tokens_per_second", Num(t.tokens_per_second)},
                                {"comm_bound", JsonValue::Bool(t.comm_bound())}});
}

}  // namespace

std::string FormatPlan(const Plan& p) {
  const PlanInput& in = p.input;
  std::string out;
  const std::string model =
      in.gpt ? absl::StrFormat("GPT of %d layers x %d (%d heads)", in.shape.num_layers, in.shape.d_model,
                               in.shape.num_heads)
             : absl::StrFormat("%d equal layers", in.shape.num_layers);
  absl::StrAppend(&out, "pshard plan: ", model, ", ", Count(static_cast<double>(p.parameters)), " parameters (",
                  Count(static_cast<double>(p.padded_parameters)), " padded over ", in.servers, " shards); ",
                  in.servers, " servers, ", in.trainers, " trainers",
                  in.group > 1 ? absl::StrCat(" in fabric groups of ", in.group) : std::string(), "; ",
                  in.micro_batches, " x ", in.batch, " x ", in.seq_len, " tokens per trainer and step\n");
  absl::StrAppend(&out, "  on the wire ", in.encodings.ToString(), ", stage ", in.stage, ", reshard after forward ",
                  in.reshard.group > 0 ? absl::StrCat(in.reshard.group) : (in.reshard.reshard ? "true" : "false"),
                  ", prefetch ", in.prefetch, "\n");
  absl::StrAppend(&out, "  slow link ", LinkText(in.slow), "; fabric ", LinkText(in.fabric), "; device ",
                  absl::StrFormat("%.4g GFLOP/s at %.0f%% MFU", in.device_flops / 1e9, in.mfu * 100), "\n");
  if (in.nodes) absl::StrAppend(&out, "  ", NodesText(*in.nodes), "\n");
  absl::StrAppend(&out, "\n");

  absl::StrAppend(&out, absl::StrFormat("Model state per device, %s parameters on %d devices (K = %g):\n",
                                        Count(static_cast<double>(p.parameters)), p.zero.devices,
                                        in.optimizer_state_bytes));
  absl::StrAppend(&out, absl::StrFormat("  %-28s %12s\n", "data parallel", Gb(p.zero.data_parallel)));
  absl::StrAppend(&out, absl::StrFormat("  %-28s %12s\n", "ZeRO-1 (optimizer state)", Gb(p.zero.stage1)));
  absl::StrAppend(&out, absl::StrFormat("  %-28s %12s\n", "ZeRO-2 (+ gradients)", Gb(p.zero.stage2)));
  absl::StrAppend(&out, absl::StrFormat("  %-28s %12s\n", "ZeRO-3 (+ weights)", Gb(p.zero.stage3)));
  absl::StrAppend(&out, absl::StrFormat("  %-28s %12s  (master %s, Adam %s, weight view %s, reduction %s)\n",
                                        "pshard server", Gb(static_cast<double>(p.server.total())),
                                        Mib(p.server.master), Mib(p.server.optimizer), Mib(p.server.weight_views),
                                        Mib(p.server.reduction)));
  absl::StrAppend(&out, absl::StrFormat(
                            "  %-28s %12s  (weights held %s, secondary shard %s, residuals %s, activations %s; "
                            "activations %s kept, %s recomputed; %s)\n\n",
                            "pshard trainer", Gb(static_cast<double>(p.trainer.total())),
                            Mib(p.trainer.weights_held), Mib(p.trainer.secondary_shard), Mib(p.trainer.residuals),
                            Mib(p.trainer.activations), Mib(p.trainer.activations_kept),
                            Mib(p.trainer.activations_recomputed),
                            in.cuda ? "the CUDA model's activations, on the device, bf16"
                                    : "the CPU model's activations, fp32 (--device=cuda: the CUDA model's)"));

  absl::StrAppend(&out, "Bytes per trainer and step (payload, as pshard_trainer_payload_bytes_total counts):\n");
  absl::StrAppend(&out, absl::StrFormat("  slow link   fetched %s, pushed %s\n", Mib(p.bytes.fetched),
                                        Mib(p.bytes.pushed)));
  if (in.group > 1) {
    absl::StrAppend(&out, absl::StrFormat("  fabric      all-gathered %s, reduce-scattered %s\n",
                                          Mib(p.bytes.gathered), Mib(p.bytes.reduced)));
  }
  absl::StrAppend(&out, "\nPredicted step:\n");
  absl::StrAppend(&out, absl::StrFormat("  compute %s, communication %s, exposed %s: step %s, %.0f tokens/s (%s)\n",
                                        Ms(p.time.compute), Ms(p.time.comm), Ms(p.time.exposed), Ms(p.time.step),
                                        p.time.tokens_per_second,
                                        p.time.comm_bound() ? "communication-bound" : "compute-bound"));
  if (p.knee.tokens_per_step > 0) {
    absl::StrAppend(&out, absl::StrFormat(
                              "  compute hides the slow link above about %.0f tokens per trainer and step; this job "
                              "has %d",
                              p.knee.tokens_per_step, in.tokens_per_step()));
    if (p.knee.bandwidth_tokens_per_step > 0) {
      absl::StrAppend(&out, absl::StrFormat(" (the bandwidth alone asks %.0f: %.3g bytes per parameter on the "
                                            "busier direction%s)",
                                            p.knee.bandwidth_tokens_per_step, p.knee.bytes_per_parameter,
                                            in.slow.latency > absl::ZeroDuration() ? "; latency asks the rest" : ""));
    }
    absl::StrAppend(&out, "\n");
    if (std::isinf(p.knee.rate_bytes_per_second)) {
      absl::StrAppend(&out, absl::StrFormat("  at %s one way, no link rate makes this job compute-bound: latency "
                                            "alone exposes more than its compute\n",
                                            absl::FormatDuration(in.slow.latency)));
    } else if (p.knee.rate_bytes_per_second > 0) {
      absl::StrAppend(&out, absl::StrFormat("  this job is compute-bound above about %.4g Mbit/s at this latency\n",
                                            p.knee.rate_bytes_per_second * 8 / 1e6));
    }
  } else {
    absl::StrAppend(&out, "  the slow link is unlimited: no compute-bound knee\n");
  }
  if (!p.levers.empty()) {
    absl::StrAppend(&out, "\nLevers at this link, one at a time (most tokens/s first; speedup in tokens/s):\n");
    absl::StrAppend(&out, absl::StrFormat("  %-84s %10s %8s %12s %12s %12s\n", "flags", "step", "speedup",
                                          "fetched", "pushed", "memory"));
    bool larger_batch = false;
    for (const LeverOption& l : p.levers) {
      const bool batch = l.batch_factor > 1.0;
      larger_batch |= batch;
      absl::StrAppend(&out, absl::StrFormat("  %-84s %10s %7.2fx %12s %12s %12s\n",
                                            batch ? absl::StrCat(l.flags, " *") : l.flags, Ms(l.time.step),
                                            l.speedup, Mib(l.bytes.fetched), Mib(l.bytes.pushed),
                                            Mib(l.trainer_memory)));
    }
    if (larger_batch) {
      absl::StrAppend(&out, "  * more tokens per step: the optimizer sees a larger batch (retune lr and steps)\n");
    }
    if (!std::is_sorted(p.levers.begin(), p.levers.end(),
                        [](const LeverOption& a, const LeverOption& b) { return a.speedup > b.speedup; })) {
      absl::StrAppend(&out, absl::StrFormat("  within %.0f%% of each other the model cannot tell levers apart: one "
                                            "that keeps the job's numbers is ranked before one that quantizes them\n",
                                            kIndistinctSpeedup * 100));
    }
    const LeverOption& best = p.levers.front();
    absl::StrAppend(&out, best.speedup > 1.005
                              ? absl::StrFormat("  buys the most: %s (%.2fx the tokens/s)\n", best.flags, best.speedup)
                              : std::string("  no lever speeds the job up at this link\n"));
    auto same = std::find_if(p.levers.begin(), p.levers.end(), [](const LeverOption& l) { return l.batch_factor == 1; });
    if (best.batch_factor != 1 && same != p.levers.end() && same->speedup > 1.005) {
      absl::StrAppend(&out, absl::StrFormat("  buys the most at this batch: %s (%.2fx)\n", same->flags, same->speedup));
    }
  }
  return out;
}

JsonValue PlanToJson(const Plan& p) {
  const PlanInput& in = p.input;
  JsonValue::Array by_trainer;
  for (const StepBytes& b : p.bytes_by_trainer) by_trainer.push_back(BytesJson(b));
  JsonValue::Array levers;
  for (const LeverOption& l : p.levers) {
    levers.push_back(JsonValue::MakeObject({{"flags", JsonValue::String(l.flags)},
                                            {"bytes", BytesJson(l.bytes)},
                                            {"time", TimeJson(l.time)},
                                            {"trainer_memory_bytes", Num(l.trainer_memory)},
                                            {"speedup", Num(l.speedup)},
                                            {"batch_factor", Num(l.batch_factor)},
                                            {"keeps_numbers", JsonValue::Bool(l.keeps_numbers)}}));
  }
  return JsonValue::MakeObject({
      {"parameters", Num(p.parameters)},
      {"padded_parameters", Num(p.padded_parameters)},
      {"servers", Num(in.servers)},
      {"trainers", Num(in.trainers)},
      {"fabric_group_size", Num(in.group)},
      {"topology", in.nodes ? JsonValue::String(NodesText(*in.nodes)) : JsonValue()},
      {"tokens_per_trainer_step", Num(in.tokens_per_step())},
      {"zero", JsonValue::MakeObject({{"devices", Num(p.zero.devices)},
                                      {"data_parallel_bytes", Num(p.zero.data_parallel)},
                                      {"stage1_bytes", Num(p.zero.stage1)},
                                      {"stage2_bytes", Num(p.zero.stage2)},
                                      {"stage3_bytes", Num(p.zero.stage3)}})},
      {"server_memory", JsonValue::MakeObject({{"master_bytes", Num(p.server.master)},
                                               {"optimizer_bytes", Num(p.server.optimizer)},
                                               {"weight_view_bytes", Num(p.server.weight_views)},
                                               {"reduction_bytes", Num(p.server.reduction)},
                                               {"total_bytes", Num(p.server.total())}})},
      {"trainer_memory", JsonValue::MakeObject({{"weights_held_bytes", Num(p.trainer.weights_held)},
                                                {"secondary_shard_bytes", Num(p.trainer.secondary_shard)},
                                                {"residual_bytes", Num(p.trainer.residuals)},
                                                {"activation_bytes", Num(p.trainer.activations)},
                                                {"activation_bytes_kept", Num(p.trainer.activations_kept)},
                                                {"activation_bytes_recomputed", Num(p.trainer.activations_recomputed)},
                                                {"total_bytes", Num(p.trainer.total())}})},
      {"bytes_per_step", BytesJson(p.bytes)},
      {"bytes_per_step_by_trainer", JsonValue::MakeArray(std::move(by_trainer))},
      {"time", TimeJson(p.time)},
      {"knee", JsonValue::MakeObject(
                   {{"bytes_per_parameter", Num(p.knee.bytes_per_parameter)},
                    {"tokens_per_trainer_step", Num(p.knee.tokens_per_step)},
                    {"bandwidth_tokens_per_trainer_step", Num(p.knee.bandwidth_tokens_per_step)},
                    // JSON has no infinity: a rate no link reaches is null.
                    {"rate_mbit", std::isinf(p.knee.rate_bytes_per_second)
                                      ? JsonValue()
                                      : Num(p.knee.rate_bytes_per_second * 8 / 1e6)}})},
      {"levers", JsonValue::MakeArray(std::move(levers))},
  });
}

}  // namespace pshard
