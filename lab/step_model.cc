#include "lab/step_model.h"

#include <algorithm>
#include <map>
#include <tuple>
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

// A transfer's way between a trainer and a server: nothing (one node), or
// the buckets it passes, each way, and the one-way latency.
struct Route {
  int server = 0;
  bool remote = false;
  double latency = 0;
  std::vector<int> down, up;  // bucket ids: server to trainer, trainer to server
};

class StepSimulation {
 public:
  // Simulates fabric group `focus` (ranks focus·G .. focus·G + G - 1); every
  // other trainer runs the same schedule at the same moments and loads the
  // buckets it shares with them.
  StepSimulation(const PlanInput& input, std::span<const UnitPartition> units, int focus)
      : in_(input), units_(units), members_(std::max(1, input.group)), focus_(focus) {
    for (int r = 0; r < input.trainers; ++r) {
      std::vector<Route> mine;
      for (int s : members_ > 1 ? MemberShards(input.servers, members_, r % members_) : AllShards()) {
        mine.push_back(RouteOf(r, s));
      }
      routes_.push_back(std::move(mine));
    }
    load_.resize(buckets_.size());
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

  // Nodes: the topology's; else server s on node s, and trainer r on node r
  // with server r when paired, else on node N + r.
  int ServerNode(int s) const { return in_.nodes ? in_.nodes->of_server[s] : s; }
  int TrainerNode(int rank) const {
    if (in_.nodes) return in_.nodes->of_trainer[rank];
    return in_.paired && rank < in_.servers ? rank : in_.servers + rank;
  }

  // The id of a bucket: one direction of a node's interface (kind 0 what
  // it sends, 1 what it receives), or of a node pair's own link (kind 2,
  // from node a to node b); made on first use.
  int BucketId(int kind, int a, int b, const LinkModel& link) {
    auto [it, made] = bucket_ids_.try_emplace(std::make_tuple(kind, a, b), static_cast<int>(buckets_.size()));
    if (made) {
      buckets_.emplace_back();
      bucket_links_.push_back(&link);
    }
    return it->second;
  }

  Route RouteOf(int rank, int s) {
    Route route;
    route.server = s;
    const int sn = ServerNode(s), tn = TrainerNode(rank);
    if (sn == tn) return route;  // its own node's server
    route.remote = true;
    const LinkModel* own = nullptr;
    if (in_.nodes) {
      auto it = in_.nodes->links.find({std::min(sn, tn), std::max(sn, tn)});
      if (it != in_.nodes->links.end()) own = &it->second;
    }
    if (own != nullptr) {
      route.latency = absl::ToDoubleSeconds(own->latency);
      route.down = {BucketId(2, sn, tn, *own)};
      route.up = {BucketId(2, tn, sn, *own)};
    } else {
      route.latency = absl::ToDoubleSeconds(in_.slow.latency);
      route.down = {BucketId(0, sn, 0, in_.slow), BucketId(1, tn, 0, in_.slow)};
      route.up = {BucketId(0, tn, 0, in_.slow), BucketId(1, sn, 0, in_.slow)};
    }
    return route;
  }

  double Compute(double flops) {
    const double seconds = flops_per_second_ > 0 ? flops / flops_per_second_ : 0.0;
    compute_ += seconds;
    t_ += seconds;
    return seconds;
  }

  // Seconds of one fabric collective over `unit`: each member receives
  // (G-1)/G of it in `format` (the weights' all-gather in the weights'
  // encoding, the reduce-scatter in the gradients').
  double Collective(int unit, const WireFormat& format) const {
    if (members_ < 2) return 0.0;
    const double bytes = FabricBytesPerElement(format) * static_cast<double>(units_[unit].padded_numel()) * (members_ - 1) /
                         members_;
    return in_.fabric.Seconds(bytes) + absl::ToDoubleSeconds(in_.fabric.latency) * (members_ - 1);
  }

  // Every trainer moves `unit`'s slices at `t` (`down`: fetches, which
  // leave the servers a latency after `t`; else pushes): each bucket passes
  // all the bytes it carries at once. Returns when each of the focus
  // group's transfers is through, latencies included: ready for a fetch,
  // acknowledged for a push; never before `t`.
  double Move(double t, int unit, const WireFormat& format, bool down) {
    std::fill(load_.begin(), load_.end(), -1.0);  // -1: not touched
    for (const std::vector<Route>& routes : routes_) {
      for (const Route& r : routes) {
        if (!r.remote) continue;
        const double bytes = static_cast<double>(format.EncodedBytes(units_[unit].Slice(r.server).length));
        for (int id : down ? r.down : r.up) load_[id] = std::max(load_[id], 0.0) + bytes;
      }
    }
    for (size_t id = 0; id < buckets_.size(); ++id) {
      if (load_[id] < 0) continue;
      const double start = t + (down ? absl::ToDoubleSeconds(bucket_links_[id]->latency) : 0.0);
      buckets_[id].Pass(start, load_[id], *bucket_links_[id]);
    }
    double done = t;
    for (int m = 0; m < members_; ++m) {
      for (const Route& r : routes_[focus_ * members_ + m]) {
        if (!r.remote) continue;
        // The request reaches the server (fetch), the bytes pass, and they
        // (or the acknowledgement) come back.
        double through = t + (down ? r.latency : 0.0);
        for (int id : down ? r.down : r.up) through = std::max(through, buckets_[id].free_at);
        done = std::max(done, through + (down ? r.latency : 2 * r.latency));
      }
    }
    return done;
  }

  void Issue(int unit) {
    const double t = t_;
    const double ready = Move(t, unit, in_.encodings.weight_format(), /*down=*/true);
    busy_.Add(t, ready);
    fetch_ready_.push_back(ready);
  }

  // Waits for schedule position `p`, issuing fetches up to p + depth first.
  void Get(size_t p, const std::vector<int>& schedule) {
    const size_t last = std::min(schedule.size() - 1, p + static_cast<size_t>(in_.prefetch));
    while (issued_ < schedule.size() && issued_ <= last) Issue(schedule[issued_++]);
    const double begin = t_;
    t_ = std::max(t_, fetch_ready_[p]);
    if (members_ > 1) t_ += Collective(schedule[p], in_.encodings.weight_format());
    busy_.Add(begin, t_);
  }

  void Push(int unit) {
    const double begin = t_;
    t_ += Collective(unit, in_.encodings.grad_format());  // the group's reduce-scatter, on this thread
    busy_.Add(begin, t_);
    const double acked = Move(t_, unit, in_.encodings.grad_format(), /*down=*/false);
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
          t_ += Collective(u, in_.encodings.weight_format());
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
  const int focus_;
  std::vector<std::vector<Route>> routes_;  // per trainer rank: its servers
  std::map<std::tuple<int, int, int>, int> bucket_ids_;
  std::vector<Bucket> buckets_;
  std::vector<const LinkModel*> bucket_links_;  // per bucket
  std::vector<double> load_;                    // per bucket, of the transfer being moved
  std::vector<double> flops_, recompute_flops_;
  double flops_per_second_ = 0;
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
  // Without a topology every group runs alike; with one, the slowest
  // group's step is the job's (the servers wait for every push).
  const int groups = input.nodes ? input.trainers / std::max(1, input.group) : 1;
  StepTime slowest;
  for (int focus = 0; focus < groups; ++focus) {
    const StepTime time = StepSimulation(input, units, focus).Run();
    if (focus == 0 || time.step > slowest.step) slowest = time;
  }
  return slowest;
}

}  // namespace pshard
