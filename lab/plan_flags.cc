#include "lab/plan_flags.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/link_rate.h"
#include "common/status_macros.h"
#include "trainer_client/peak_flops.h"
#include "trainer_client/route_plan.h"

namespace pshard {
namespace {

class Reader {
 public:
  explicit Reader(const FlagValues& flags) : flags_(flags) {}

  /// A flag callers may leave out: `fallback` then.
  std::string TextOr(const std::string& name, const std::string& fallback) const {
    auto it = flags_.find(name);
    return it == flags_.end() ? fallback : it->second;
  }
  absl::StatusOr<std::string> Text(const std::string& name) const {
    auto it = flags_.find(name);
    if (it == flags_.end()) return absl::InternalError(absl::StrCat("the planner was not given --", name));
    return it->second;
  }
  absl::StatusOr<int> Int(const std::string& name) const {
    ASSIGN_OR_RETURN(const std::string text, Text(name));
    int v = 0;
    if (!absl::SimpleAtoi(text, &v)) return Bad(name, text, "an integer");
    return v;
  }
  absl::StatusOr<double> Number(const std::string& name) const {
    ASSIGN_OR_RETURN(const std::string text, Text(name));
    double v = 0;
    if (!absl::SimpleAtod(text, &v) || !std::isfinite(v)) return Bad(name, text, "a number");
    return v;
  }
  absl::StatusOr<bool> Bool(const std::string& name) const {
    ASSIGN_OR_RETURN(const std::string text, Text(name));
    bool v = false;
    if (!absl::SimpleAtob(text, &v)) return Bad(name, text, "true or false");
    return v;
  }
  absl::StatusOr<LinkModel> Link(const std::string& rate_flag, const std::string& delay_flag) const {
    ASSIGN_OR_RETURN(const std::string rate, Text(rate_flag));
    ASSIGN_OR_RETURN(const std::string delay, Text(delay_flag));
    LinkModel link;
    absl::StatusOr<double> r = ParseLinkRate(rate);
    if (!r.ok()) return absl::InvalidArgumentError(absl::StrCat("--", rate_flag, ": ", r.status().message()));
    link.bytes_per_second = *r;
    if (!delay.empty() && delay != "0" && (!absl::ParseDuration(delay, &link.latency) || link.latency < absl::ZeroDuration())) {
      return Bad(delay_flag, delay, "a duration such as 5ms");
    }
    return link;
  }

 private:
  static absl::Status Bad(const std::string& name, const std::string& text, const char* what) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, "=", text, " is not ", what));
  }
  const FlagValues& flags_;
};

// The nodes of a topology file for a job of `servers` and `trainers`, and
// the size of its fabric groups.
absl::StatusOr<PlanInput::Nodes> NodesOf(const std::string& file, int servers, int trainers, int& group) {
  ASSIGN_OR_RETURN(const Topology topology, Topology::Load(file));
  absl::Status checked = topology.CheckForJob(servers, trainers);
  absl::StatusOr<int> size = topology.UniformGroupSize(trainers);
  if (!checked.ok() || !size.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--topology=", file, ": ", (checked.ok() ? size.status() : checked).message()));
  }
  group = *size;
  PlanInput::Nodes nodes;
  nodes.file = file;
  for (const Topology::Node& n : topology.nodes) nodes.names.push_back(n.name);
  for (int s = 0; s < servers; ++s) nodes.of_server.push_back(topology.NodeOfServer(absl::StrCat("shard:", s)));
  for (int r = 0; r < trainers; ++r) nodes.of_trainer.push_back(topology.NodeOfTrainer(r));
  for (const Topology::Link& l : topology.links) {
    // As the trainers emulate it: a link with neither is no link of its own.
    if (l.rate.empty() && l.delay.empty()) continue;
    LinkModel link;
    ASSIGN_OR_RETURN(link.bytes_per_second, ParseLinkRate(l.rate));  // Parse checked both
    if (!l.delay.empty()) absl::ParseDuration(l.delay, &link.latency);
    const int a = static_cast<int>(std::find(nodes.names.begin(), nodes.names.end(), l.a) - nodes.names.begin());
    const int b = static_cast<int>(std::find(nodes.names.begin(), nodes.names.end(), l.b) - nodes.names.begin());
    nodes.links[{std::min(a, b), std::max(a, b)}] = link;
  }
  return nodes;
}

}  // namespace

const std::vector<std::string>& PlanFlagNames() {
  static const std::vector<std::string> names = {
      "servers", "trainers", "fabric_group_size", "micro_batches", "batch", "seq_len",
      "accumulate_on_trainer", "fetch_once_per_step", "recompute", "prefetch", "stage",
      "reshard_after_forward", "encoding", "weight_encoding", "grad_encoding", "quant_block",
      "error_feedback", "layers", "d_model", "heads", "context", "params", "link_rate", "link_delay",
      "fabric_rate", "fabric_delay", "device_flops", "mfu", "optimizer_state_bytes", "placement", "step_overhead",
      "topology", "device"};
  return names;
}

absl::StatusOr<int64_t> ParseParameterCount(const std::string& raw) {
  std::string text(absl::StripAsciiWhitespace(raw));
  double scale = 1;
  if (!text.empty()) {
    switch (absl::ascii_toupper(static_cast<unsigned char>(text.back()))) {
      case 'K': scale = 1e3; break;
      case 'M': scale = 1e6; break;
      case 'B':
      case 'G': scale = 1e9; break;
      case 'T': scale = 1e12; break;
      default: break;
    }
    if (scale != 1) text.pop_back();
  }
  double v = 0;
  if (!absl::SimpleAtod(text, &v) || !(v * scale >= 1) || v * scale > 1e15) {
    return absl::InvalidArgumentError(
        absl::StrCat("--params=", raw, " is not a parameter count such as 7.5e9, 7.5B or 125M"));
  }
  return static_cast<int64_t>(std::llround(v * scale));
}

absl::StatusOr<PlanInput> PlanInputFromFlags(const FlagValues& flags) {
  const Reader read(flags);
  PlanInput in;
  ASSIGN_OR_RETURN(in.servers, read.Int("servers"));
  ASSIGN_OR_RETURN(in.trainers, read.Int("trainers"));
  ASSIGN_OR_RETURN(in.group, read.Int("fabric_group_size"));
  ASSIGN_OR_RETURN(in.micro_batches, read.Int("micro_batches"));
  ASSIGN_OR_RETURN(in.batch, read.Int("batch"));
  ASSIGN_OR_RETURN(in.seq_len, read.Int("seq_len"));
  ASSIGN_OR_RETURN(in.accumulate_on_trainer, read.Bool("accumulate_on_trainer"));
  ASSIGN_OR_RETURN(in.fetch_once_per_step, read.Bool("fetch_once_per_step"));
  ASSIGN_OR_RETURN(in.recompute, read.Bool("recompute"));
  ASSIGN_OR_RETURN(in.prefetch, read.Int("prefetch"));
  ASSIGN_OR_RETURN(in.stage, read.Int("stage"));
  ASSIGN_OR_RETURN(const std::string reshard, read.Text("reshard_after_forward"));
  ASSIGN_OR_RETURN(in.reshard, ParseReshardAfterForward(reshard));
  ASSIGN_OR_RETURN(const std::string both, read.Text("encoding"));
  ASSIGN_OR_RETURN(const std::string weights, read.Text("weight_encoding"));
  ASSIGN_OR_RETURN(const std::string grads, read.Text("grad_encoding"));
  ASSIGN_OR_RETURN(const int block, read.Int("quant_block"));
  ASSIGN_OR_RETURN(in.encodings, ParseWireEncodings(both, weights, grads, block));
  ASSIGN_OR_RETURN(const std::string feedback, read.Text("error_feedback"));
  ASSIGN_OR_RETURN(in.error_feedback, ParseErrorFeedback(feedback, in.encodings.grads));
  ASSIGN_OR_RETURN(in.shape.num_layers, read.Int("layers"));
  ASSIGN_OR_RETURN(in.shape.d_model, read.Int("d_model"));
  ASSIGN_OR_RETURN(in.shape.num_heads, read.Int("heads"));
  ASSIGN_OR_RETURN(in.shape.context, read.Int("context"));
  ASSIGN_OR_RETURN(const std::string params, read.Text("params"));
  if (params.empty()) {
    RETURN_IF_ERROR(in.shape.Validate());
    ASSIGN_OR_RETURN(in.spec, MakeGptSpec(in.shape));
    if (in.seq_len > in.shape.context) {
      return absl::InvalidArgumentError(
          absl::StrCat("--seq_len=", in.seq_len, " exceeds the model's --context=", in.shape.context));
    }
  } else {
    ASSIGN_OR_RETURN(const int64_t count, ParseParameterCount(params));
    ASSIGN_OR_RETURN(in.spec, MakeUniformSpec(count, in.shape.num_layers));
    in.gpt = false;
    in.shape.context = std::max(in.shape.context, in.seq_len);
  }
  ASSIGN_OR_RETURN(const std::string placement, read.Text("placement"));
  if (placement != "separate" && placement != "paired") {
    return absl::InvalidArgumentError(absl::StrCat("--placement=", placement, " is not separate or paired"));
  }
  in.paired = placement == "paired";
  ASSIGN_OR_RETURN(const std::string topology, read.Text("topology"));
  if (!topology.empty()) {
    int group = 1;
    ASSIGN_OR_RETURN(in.nodes, NodesOf(topology, in.servers, in.trainers, group));
    if (in.group != 1 && in.group != group) {
      return absl::InvalidArgumentError(absl::StrCat("--fabric_group_size=", in.group, " disagrees with ", topology,
                                                     ", whose fabric groups are of ", group,
                                                     ": the topology's groups are the job's"));
    }
    in.group = group;
  }
  ASSIGN_OR_RETURN(in.slow, read.Link("link_rate", "link_delay"));
  ASSIGN_OR_RETURN(in.fabric, read.Link("fabric_rate", "fabric_delay"));
  const std::string device = read.TextOr("device", "cpu");
  if (device != "cpu" && device != "cuda" && device != "auto") {
    return absl::InvalidArgumentError(absl::StrCat("--device=", device, ": expected cpu, cuda or auto"));
  }
  in.cuda = device == "cuda";
  ASSIGN_OR_RETURN(const std::string device_flops, read.Text("device_flops"));
  if (device_flops == "auto") {
    in.device_flops = MeasureSgemmFlops();
  } else {
    ASSIGN_OR_RETURN(in.device_flops, read.Number("device_flops"));
  }
  ASSIGN_OR_RETURN(in.mfu, read.Number("mfu"));
  ASSIGN_OR_RETURN(const std::string overhead, read.Text("step_overhead"));
  absl::Duration overhead_time;
  if (!overhead.empty() && overhead != "0" &&
      (!absl::ParseDuration(overhead, &overhead_time) || overhead_time < absl::ZeroDuration())) {
    return absl::InvalidArgumentError(absl::StrCat("--step_overhead=", overhead, " is not a duration such as 20ms"));
  }
  in.step_overhead = absl::ToDoubleSeconds(overhead_time);
  ASSIGN_OR_RETURN(in.optimizer_state_bytes, read.Number("optimizer_state_bytes"));
  RETURN_IF_ERROR(in.Validate());
  return in;
}

}  // namespace pshard
