#include "lab/step_model.h"

#include <algorithm>
#include <utility>

#include "trainer_client/group/group_collective.h"
#include "trainer_client/prefetcher.h"

namespace pshard {
namespace {

// One direction of a node's interface: bytes pass in the order they are
// handed over.
struct Bucket {
  double free_at = 0;
  // Passes `bytes` handed over at `t`; returns when the last byte is through.
  double Pass(double t, double bytes, const LinkModel& link) {
    free_at = std::max(t, free_at) + link.Seconds(bytes);
    return free_at;
  }
};

// Time intervals, merged into the time any of them covers.
class Busy {
 public:
  void Add(double begin, double end) { intervals_.emplace_back(begin, end); }
  double Total() {
    std::sort(intervals_.begin(), intervals_.end());
    double total = 0, end = -1e300;
    for (const auto& [b, e] : intervals_) {
      if (e <= end) continue;
      total += e - std::max(b, end);
      end = e;
    }
    return total;
  }

 private:
  std::vector<std::pair<double, double>> intervals_;
};

class StepSimulation {
 public:
  StepSimulation(const PlanInput& input, std::span<const UnitPartition> units)
      : in_(input), units_(units), members_(std::max(1, input.group)),
        node_out_(input.servers + input.trainers), node_in_(input.servers + input.trainers) {
    for (int m = 0; m < members_; ++m) {
      shards_.push_back(members_ > 1 ? MemberShards(input.servers, members_, m) : AllShards());
    }
    // Every trainer runs this schedule at once: a server's slice goes to
    // each trainer that fetches it, one member of every group, but not
    // over the network to the trainer on its own node.
    for (int s = 0; s < input.servers; ++s) {
      fetchers_.push_back(std::max(1, input.trainers / members_) - (Paired(s) ? 1 : 0));
    }
    flops_ = UnitFlops(input);
    recompute_flops_ = UnitRecomputeFlops(input);
    flops_per_second_ = input.device_flops * input.mfu;
  }

  StepTime Run() {
    t_ = in_.step_overhead;  // the servers publish the step's weights
    const int lanes = in_.fetch_once_per_step ? in_.micro_batches : 1;
    const bool accumulate = in_.accumulate_on_trainer && lanes == 1 && in_.micro_batches > 1;
    std::vector<bool> resident(units_.size(), false);
    for (int micro = 0; micro < in_.micro_batches; micro += lanes) {
      Pass(lanes, !accumulate, in_.stage < 3 ? &resident : nullptr);
    }
    for (int u = static_cast<int>(units_.size()) - 1; u >= 0 && accumulate; --u) Push(u);
    const double end = std::max(t_, last_ack_);
    StepTime time;
    time.compute = compute_;
    time.step = end;
    time.exposed = std::max(0.0, end - compute_);
    time.comm = busy_.Total();
    time.tokens_per_second = end > 0 ? static_cast<double>(in_.tokens_per_step()) * in_.trainers / end : 0;
    return time;
  }

 private:
  std::vector<int> AllShards() const {
    std::vector<int> all(in_.servers);
    for (int s = 0; s < in_.servers; ++s) all[s] = s;
    return all;
  }

  // Nodes: server s on node s; trainer r on node r with server r when
  // paired, else on node N + r. Member m of the simulated group is rank m.
  bool Paired(int s) const { return in_.paired && s < in_.trainers; }
  int TrainerNode(int rank) const { return in_.paired && rank < in_.servers ? rank : in_.servers + rank; }

  // Bytes of the slices of `unit` that trainer `rank` exchanges with other
  // nodes, in `format`.
  double RemoteBytes(int unit, int rank, const WireFormat& format) const {
    double bytes = 0;
    for (int s : shards_[rank % members_]) {
      if (s != TrainerNode(rank)) bytes += static_cast<double>(format.EncodedBytes(units_[unit].Slice(s).length));
    }
    return bytes;
  }

  // The other paired nodes' trainers move what this group's do, at the same
  // moment, through their nodes' interfaces (which their servers share).
  void LoadOtherPairedNodes(double t, int unit, const WireFormat& format, std::vector<Bucket>& interfaces) {
    if (!in_.paired) return;
    for (int k = members_; k < std::min(in_.servers, in_.trainers); ++k) {
      interfaces[k].Pass(t, RemoteBytes(unit, k, format), in_.slow);
    }
  }

  double Compute(double flops) {
    const double seconds = flops_per_second_ > 0 ? flops / flops_per_second_ : 0.0;
    compute_ += seconds;
    t_ += seconds;
    return seconds;
  }

  // Seconds of one fabric collective over `unit`: each member receives
  // (G-1)/G of it, `bytes_per_element` each (the weights' all-gather: 2
  // for bf16, FabricGatherBytesPerElement; the reduce-scatter: fp32, 4).
  double Collective(int unit, int bytes_per_element) const {
    if (members_ < 2) return 0.0;
    const double bytes = bytes_per_element * static_cast<double>(units_[unit].padded_numel()) * (members_ - 1) /
                         members_;
    return in_.fabric.Seconds(bytes) + absl::ToDoubleSeconds(in_.fabric.latency) * (members_ - 1);
  }

  void Issue(int unit) {
    const double t = t_;
    const double latency = absl::ToDoubleSeconds(in_.slow.latency);
    const WireFormat format = in_.encodings.weight_format();
    double ready = t;
    for (int m = 0; m < members_; ++m) {
      double through = t + latency;  // the request reaches the servers
      for (int s : shards_[m]) {
        if (s == TrainerNode(m)) continue;  // its own node's server
        const double bytes = static_cast<double>(format.EncodedBytes(units_[unit].Slice(s).length));
        through = std::max(through, node_out_[s].Pass(t + latency, fetchers_[s] * bytes, in_.slow));
      }
      through = std::max(through, node_in_[TrainerNode(m)].Pass(t + latency, RemoteBytes(unit, m, format), in_.slow));
      ready = std::max(ready, through + latency);
    }
    LoadOtherPairedNodes(t + latency, unit, format, node_in_);
    busy_.Add(t, ready);
    fetch_ready_.push_back(ready);
  }

  // Waits for schedule position `p`, issuing fetches up to p + depth first.
  void Get(size_t p, const std::vector<int>& schedule) {
    const size_t last = std::min(schedule.size() - 1, p + static_cast<size_t>(in_.prefetch));
    while (issued_ < schedule.size() && issued_ <= last) Issue(schedule[issued_++]);
    const double begin = t_;
    t_ = std::max(t_, fetch_ready_[p]);
    if (members_ > 1) t_ += Collective(schedule[p], FabricGatherBytesPerElement(in_.encodings.weights));
    busy_.Add(begin, t_);
  }

  void Push(int unit) {
    const double begin = t_;
    t_ += Collective(unit, 4);  // the group's reduce-scatter, on this thread
    busy_.Add(begin, t_);
    const double latency = absl::ToDoubleSeconds(in_.slow.latency);
    const WireFormat format = in_.encodings.grad_format();
    double acked = t_;
    for (int m = 0; m < members_; ++m) {
      double through = t_;
      for (int s : shards_[m]) {
        if (s == TrainerNode(m)) continue;
        const double bytes = static_cast<double>(format.EncodedBytes(units_[unit].Slice(s).length));
        through = std::max(through, node_in_[s].Pass(t_, fetchers_[s] * bytes, in_.slow));
      }
      through = std::max(through, node_out_[TrainerNode(m)].Pass(t_, RemoteBytes(unit, m, format), in_.slow));
      acked = std::max(acked, through + 2 * latency);  // arrives, and the answer comes back
    }
    LoadOtherPairedNodes(t_, unit, format, node_out_);
    busy_.Add(t_, acked);
    last_ack_ = std::max(last_ack_, acked);
  }

  void Pass(int lanes, bool push, std::vector<bool>* resident) {
    const int k = static_cast<int>(units_.size());
    const bool keep = !in_.reshard.reshard || resident != nullptr;
    const bool regather = !keep && in_.reshard.group > 0;
    std::vector<int> schedule;
    for (int u = 0; u < k; ++u) {
      if (resident == nullptr || !(*resident)[u]) schedule.push_back(u);
    }
    for (int u = k - 2; u >= 0 && !keep && !regather; --u) schedule.push_back(u);
    issued_ = 0;
    fetch_ready_.clear();
    size_t position = 0;
    for (int u = 0; u < k; ++u) {
      if (resident == nullptr || !(*resident)[u]) {
        Get(position++, schedule);
        if (resident != nullptr) (*resident)[u] = true;
      }
      Compute(lanes * flops_[u] / 3);
    }
    for (int u = k - 1; u >= 0; --u) {
      if (!keep && u < k - 1) {
        if (regather) {
          const double begin = t_;
          t_ += Collective(u, FabricGatherBytesPerElement(in_.encodings.weights));
          busy_.Add(begin, t_);
        } else {
          Get(position++, schedule);
        }
      }
      Compute(lanes * (2 * flops_[u] / 3 + recompute_flops_[u]));
      if (push) Push(u);
    }
  }

  const PlanInput& in_;
  const std::span<const UnitPartition> units_;
  const int members_;
  std::vector<std::vector<int>> shards_;  // per member
  std::vector<int> fetchers_;  // per server: the trainers its slice goes to over the network
  std::vector<double> flops_, recompute_flops_;
  double flops_per_second_ = 0;
  std::vector<Bucket> node_out_, node_in_;  // per node: its interface, each way
  std::vector<double> fetch_ready_;  // per schedule position of the pass
  size_t issued_ = 0;
  double t_ = 0, compute_ = 0, last_ack_ = 0;
  Busy busy_;
};

}  // namespace

std::vector<double> UnitFlops(const PlanInput& input) {
  const GptConfig& g = input.shape;
  const double c = g.d_model, b = input.batch, t = input.seq_len, tokens = b * t;
  const double attention = 12.0 * b * t * t * c;  // per block
  std::vector<double> flops;
  for (size_t u = 0; u < input.spec.units.size(); ++u) {
    if (!input.gpt) {
      flops.push_back(6.0 * static_cast<double>(input.spec.units[u].numel) * tokens + attention);
    } else if (u == 0) {
      flops.push_back(0.0);  // the embedding is a lookup
    } else if (u + 1 == input.spec.units.size()) {
      flops.push_back(6.0 * static_cast<double>(g.vocab) * c * tokens);
    } else {
      flops.push_back(6.0 * 12.0 * c * c * tokens + attention);
    }
  }
  return flops;
}

std::vector<double> UnitRecomputeFlops(const PlanInput& input) {
  const GptConfig& g = input.shape;
  const double c = g.d_model, b = input.batch, t = input.seq_len;
  std::vector<double> flops(input.spec.units.size(), 0.0);
  if (!input.recompute) return flops;
  const std::vector<double> model = UnitFlops(input);
  // CpuGpt reruns every block's internals but the last's (see gpt.h).
  const size_t first = input.gpt ? 1 : 0;
  const size_t end = input.spec.units.size() - (input.gpt ? 1 : 0);
  for (size_t u = first; u + 1 < end; ++u) {
    flops[u] = input.gpt ? 2.0 * 8.0 * c * c * b * t + 4.0 * b * t * t * c : model[u] / 3;
  }
  return flops;
}

StepTime PredictStepTime(const PlanInput& input, std::span<const UnitPartition> units) {
  return StepSimulation(input, units).Run();
}

}  // namespace pshard
