// The C++ side of the PyTorch bridge: a trainer's connection to the shard
// servers (fetch a unit, push its gradient, asynchronously), its fabric
// group (the members split each fetch and reduce before pushing), its
// metrics endpoint, and the layout checks. python/pshard/torch.py builds on
// it.
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/layout_file.h"
#include "common/metrics/metrics_server.h"
#include "common/reduction_tree.h"
#include "common/security/security.h"
#include "pybind11/numpy.h"
#include "pybind11/pybind11.h"
#include "pybind11/stl.h"
#include "trainer_client/busy_clock.h"
#include "trainer_client/group/group_collective.h"
#include "trainer_client/group/socket/socket_group.h"
#include "trainer_client/prefetcher.h"
#include "trainer_client/shard_client.h"
#include "trainer_client/trainer_metrics.h"

namespace py = pybind11;

namespace pshard {
namespace {

// A Status as the Python exception a caller would expect.
[[noreturn]] void Raise(const absl::Status& status) {
  const std::string message(status.message());
  if (absl::IsInvalidArgument(status) || absl::IsOutOfRange(status)) throw py::value_error(message);
  if (absl::IsDeadlineExceeded(status)) {
    PyErr_SetString(PyExc_TimeoutError, message.c_str());
    throw py::error_already_set();
  }
  throw std::runtime_error(absl::StrCat(absl::StatusCodeToString(status.code()), ": ", message));
}

template <typename T>
T Check(absl::StatusOr<T> value) {
  if (!value.ok()) Raise(value.status());
  return *std::move(value);
}

class Session;

// A flat fp32 array over `values`, which `owner` keeps alive.
template <typename Owner>
py::array_t<float> ArrayOver(std::vector<float>& values, Owner owner) {
  auto* held = new Owner(std::move(owner));
  py::capsule base(held, [](void* p) { delete static_cast<Owner*>(p); });
  return py::array_t<float>({static_cast<py::ssize_t>(values.size())}, {sizeof(float)}, values.data(), base);
}

/// One fetch or push in flight.
class Transfer {
 public:
  /// `group`: the session whose fabric group gathers the fetch's other
  /// shards (null: it fetched them all).
  Transfer(std::shared_ptr<UnitTransfer> transfer, Session* group, Session* session, int unit, bool fetch)
      : transfer_(std::move(transfer)), group_(group), session_(session), unit_(unit), fetch_(fetch) {}
  /// Blocks (without the GIL) until done; raises on failure.
  void Wait();
  bool done() const { return transfer_->done(); }
  /// A fetch's values, fp32, the unit's padded length: the client's own
  /// buffer, not a copy; it lives as long as the array does. In a fabric
  /// group, the first call all-gathers the other members' shards (a
  /// collective: every member takes its units' values in the same order).
  py::array_t<float> Values();

 private:
  std::shared_ptr<UnitTransfer> transfer_;
  Session* group_;
  Session* session_;
  int unit_;
  bool fetch_;
  bool gathered_ = false;
};

/// A trainer's connection, and the accounting of its steps.
class Session {
 public:
  Session(std::vector<std::string> servers, int rank, const std::string& weight_encoding,
          const std::string& grad_encoding, int quant_block, bool error_feedback, const std::string& transport,
          const std::string& metrics_address, double join_timeout_s, double rpc_timeout_s) {
    ShardClient::Options options;
    options.server_addresses = std::move(servers);
    options.trainer_rank = rank;
    options.encodings = Check(ParseWireEncodings("fp32", weight_encoding, grad_encoding, quant_block));
    options.error_feedback = error_feedback;
    options.transport = transport;
    options.join_timeout = absl::Seconds(join_timeout_s);
    options.rpc_timeout = absl::Seconds(rpc_timeout_s);
    options.join_log = [](const std::string&) {};
    if (!metrics_address.empty()) {
      metrics_server_ = Check(metrics::MetricsServer::Start(metrics_address, &registry_));
      options.metrics_address = metrics_server_->address();
    }
    absl::StatusOr<std::unique_ptr<ShardClient>> client = absl::UnknownError("not connected");
    {
      py::gil_scoped_release unlocked;
      client = ShardClient::Connect(std::move(options));
    }
    client_ = Check(std::move(client));  // raises with the GIL held
    metrics_ = std::make_unique<TrainerMetrics>(registry_, rank, client_->transport_name(0), "cpu", 0.0);
    step_started_ = absl::Now();
  }

  std::string LayoutJson() const { return FormatLayoutJson(client_->job().model, /*one_line=*/true); }
  py::dict Job() const {
    const JobConfig& job = client_->job();
    py::dict d;
    d["model"] = job.model.model;
    d["num_shards"] = job.num_shards;
    d["num_trainers"] = job.num_trainers;
    d["micro_batches"] = job.micro_batches;
    d["accumulate_on_trainer"] = job.accumulate_on_trainer;
    d["init_fingerprint"] = job.init_fingerprint;
    d["joined_step"] = client_->joined_step();
    d["rank"] = client_->options().trainer_rank;
    return d;
  }
  int64_t PaddedNumel(int unit) const {
    CheckUnit(unit);
    return client_->layout().partitions[unit].padded_numel();
  }
  int metrics_port() const { return metrics_server_ ? metrics_server_->port() : 0; }

  /// Joins the fabric group of `size` consecutive ranks that holds this
  /// trainer (they meet at shard 0, then talk over TCP on `host`): from
  /// then on each member fetches and pushes only its shards of every unit,
  /// and the group all-gathers the weights and reduces the gradients.
  /// ValueError for a size that does not fit the job's trainers.
  void JoinGroup(int size, const std::string& host) {
    if (group_ != nullptr) throw py::value_error("this trainer has joined its fabric group already");
    const JobConfig& job = client_->job();
    const int rank = client_->options().trainer_rank;
    if (size < 2) throw py::value_error(absl::StrCat("a fabric group of ", size, " trainers: it needs 2 or more"));
    const int first = rank - rank % size;
    if (first + size > job.num_trainers || !IsReductionTreeNode(job.num_trainers, first, size)) {
      throw py::value_error(absl::StrCat("a fabric group of ranks [", first, ", ", first + size,
                                         ") does not align with the ", job.num_trainers,
                                         " trainers' reduction tree (use aligned power-of-two groups)"));
    }
    const int member = rank - first;
    std::vector<int> ranks;
    for (int r = first; r < first + size; ++r) ranks.push_back(r);
    const std::string key = absl::StrCat("fabric:", absl::StrJoin(ranks, ","));
    ShardClient* client = client_.get();
    const absl::Duration timeout = client_->options().join_timeout;
    const RendezvousFn rendezvous = [client, key, member, size, timeout](const std::string& payload) {
      return client->Rendezvous(key, member, size, payload, timeout);
    };
    absl::StatusOr<std::unique_ptr<GroupCollective>> joined = absl::UnknownError("not joined");
    {
      py::gil_scoped_release unlocked;
      joined = JoinSocketGroup(host, member, size, rendezvous, client_->options().rpc_timeout);
    }
    group_ = Check(std::move(joined));
    my_shards_ = MemberShards(job.num_shards, size, member);
  }
  int group_size() const { return group_ ? group_->size() : 1; }

  /// Starts fetching `unit` at `version`: in a fabric group, this member's
  /// shards (Values gathers the rest), or with `alone` every shard.
  std::unique_ptr<Transfer> Fetch(int unit, int64_t version, bool alone) {
    CheckUnit(unit);
    const bool grouped = group_ != nullptr && !alone;
    std::shared_ptr<UnitTransfer> t =
        client_->StartFetch(unit, version, grouped ? my_shards_ : std::optional<std::vector<int>>());
    Remember(t, /*fetch=*/true);
    return std::make_unique<Transfer>(std::move(t), grouped ? this : nullptr, this, unit, true);
  }

  /// All-gathers `values` (this member's shards of `unit` valid) in the
  /// group; a no-op without one. Raises on failure.
  void Gather(int unit, std::vector<float>& values) {
    if (group_ == nullptr) return;
    const UnitPartition& p = client_->layout().partitions[unit];
    const GroupOwnership owned = ShardOwnership(p, group_->size());
    const absl::Time start = absl::Now();
    absl::StatusOr<int64_t> gathered;
    {
      py::gil_scoped_release unlocked;
      gathered = AllGatherWeights(*group_, values, owned, client_->options().encodings.weight_format());
    }
    AddWait(start, absl::Now());
    if (!gathered.ok()) Raise(gathered.status());
    absl::MutexLock lock(&mu_);
    fabric_gathered_ += *gathered;
  }

  /// This member's part of a unit's fetched weights (its shards' ranges),
  /// a copy: what it keeps from forward to backward as its secondary shard.
  py::array_t<float> OwnPart(int unit, py::array_t<float, py::array::c_style | py::array::forcecast> weights) {
    CheckUnit(unit);
    if (group_ == nullptr) throw py::value_error("a secondary shard needs a fabric group");
    const UnitPartition& p = client_->layout().partitions[unit];
    if (weights.ndim() != 1 || weights.shape(0) != p.padded_numel()) {
      throw py::value_error(absl::StrCat("unit ", unit, " has ", p.padded_numel(), " padded elements"));
    }
    const std::vector<ElementRange> mine = ShardOwnership(p, group_->size())[group_->rank()];
    py::array_t<float> part(RangeElements(mine));
    PackRanges(std::span<const float>(weights.data(), p.padded_numel()), mine, part.mutable_data());
    return part;
  }

  /// The unit's weights again from every member's part (a collective).
  py::array_t<float> Regather(int unit, py::array_t<float, py::array::c_style | py::array::forcecast> part) {
    CheckUnit(unit);
    if (group_ == nullptr) throw py::value_error("a secondary shard needs a fabric group");
    const UnitPartition& p = client_->layout().partitions[unit];
    const std::vector<ElementRange> mine = ShardOwnership(p, group_->size())[group_->rank()];
    if (part.ndim() != 1 || part.shape(0) != RangeElements(mine)) {
      throw py::value_error(absl::StrCat("this member's part of unit ", unit, " has ", RangeElements(mine),
                                         " elements"));
    }
    auto values = std::make_shared<std::vector<float>>(p.padded_numel(), 0.0f);
    UnpackRanges(part.data(), mine, *values);
    Gather(unit, *values);
    return ArrayOver(*values, values);
  }

  std::unique_ptr<Transfer> Push(int unit, int64_t step, py::array_t<float, py::array::c_style | py::array::forcecast> grads,
                                 int micro_batch) {
    CheckUnit(unit);
    const int64_t padded = PaddedNumel(unit);
    const int64_t numel = client_->layout().spec.units[unit].numel;
    if (grads.ndim() != 1 || (grads.shape(0) != numel && grads.shape(0) != padded)) {
      throw py::value_error(absl::StrCat("unit ", unit, " takes a flat gradient of ", numel, " (or ", padded,
                                         ") elements"));
    }
    std::vector<float> values(padded, 0.0f);
    std::copy_n(grads.data(), grads.shape(0) == padded ? numel : grads.shape(0), values.begin());
    ShardClient::PushOptions push;
    push.micro_batch = micro_batch;
    if (group_ != nullptr) {
      // The group's sum of this member's shards, pushed for all of it (a
      // collective, in the order every member pushes).
      const GroupOwnership owned = ShardOwnership(client_->layout().partitions[unit], group_->size());
      const absl::Time start = absl::Now();
      absl::StatusOr<int64_t> reduced;
      {
        py::gil_scoped_release unlocked;
        reduced = ReduceScatterGradients(*group_, values, owned, client_->options().encodings.grad_format(),
                                         client_->GroupResidual(unit));
      }
      AddWait(start, absl::Now());
      if (!reduced.ok()) Raise(reduced.status());
      {
        absl::MutexLock lock(&mu_);
        fabric_reduced_ += *reduced;
      }
      push.first_rank = client_->options().trainer_rank - group_->rank();
      push.rank_count = group_->size();
      push.shards = my_shards_;
    }
    std::shared_ptr<UnitTransfer> t = client_->StartPush(unit, step, std::move(values), push);
    Remember(t, /*fetch=*/false);
    return std::make_unique<Transfer>(std::move(t), nullptr, this, unit, false);
  }

  void AddWait(absl::Time start, absl::Time end) {
    absl::MutexLock lock(&mu_);
    waits_.Add(start, end);
  }
  /// The time a pass of the model ran (forward, or backward).
  void AddModelTime(double start_s, double end_s) {
    absl::MutexLock lock(&mu_);
    model_.Add(absl::FromUnixMicros(static_cast<int64_t>(start_s * 1e6)),
               absl::FromUnixMicros(static_cast<int64_t>(end_s * 1e6)));
  }

  /// Closes the step's accounting: its phases, bytes and loss go to the
  /// metrics; returns them as a dict.
  py::dict RecordStep(int64_t step, double loss, int64_t tokens) {
    StepReport report;
    report.step = step;
    report.loss = loss;
    report.tokens = tokens;
    {
      absl::MutexLock lock(&mu_);
      const absl::Time now = absl::Now();
      IntervalUnion busy;
      for (const auto& [t, fetch] : transfers_) {
        busy.Add(t->started(), t->done() ? t->finished() : now);
        (fetch ? report.bytes_fetched : report.bytes_pushed) += t->wire_bytes();
        (fetch ? report.payload_fetched : report.payload_pushed) += t->payload_bytes();
        if (t->done()) (fetch ? report.fetch_latencies : report.push_latencies).push_back(t->finished() - t->started());
      }
      report.times.wall = now - step_started_;
      report.times.comm_exposed = std::min(waits_.Total(), report.times.wall);
      report.times.comm_busy = busy.Total();
      report.times.compute = std::clamp(model_.Total() - report.times.comm_exposed, absl::ZeroDuration(),
                                        report.times.wall - report.times.comm_exposed);
      report.times.other = report.times.wall - report.times.comm_exposed - report.times.compute;
      report.fabric_gathered = std::exchange(fabric_gathered_, 0);
      report.fabric_reduced = std::exchange(fabric_reduced_, 0);
      transfers_.clear();
      waits_ = IntervalUnion();
      model_ = IntervalUnion();
      step_started_ = now;
    }
    metrics_->RecordStep(report);
    py::dict d;
    d["wall_s"] = absl::ToDoubleSeconds(report.times.wall);
    d["compute_s"] = absl::ToDoubleSeconds(report.times.compute);
    d["comm_exposed_s"] = absl::ToDoubleSeconds(report.times.comm_exposed);
    d["comm_busy_s"] = absl::ToDoubleSeconds(report.times.comm_busy);
    d["other_s"] = absl::ToDoubleSeconds(report.times.other);
    d["bytes_fetched"] = report.bytes_fetched;
    d["bytes_pushed"] = report.bytes_pushed;
    d["fabric_gathered"] = report.fabric_gathered;
    d["fabric_reduced"] = report.fabric_reduced;
    return d;
  }

 private:
  void CheckUnit(int unit) const {
    if (unit < 0 || unit >= static_cast<int>(client_->layout().partitions.size())) {
      throw py::index_error(absl::StrCat("unit ", unit, " of a layout of ", client_->layout().partitions.size()));
    }
  }
  void Remember(std::shared_ptr<UnitTransfer> t, bool fetch) {
    absl::MutexLock lock(&mu_);
    transfers_.emplace_back(std::move(t), fetch);
  }

  metrics::Registry registry_;
  std::unique_ptr<metrics::MetricsServer> metrics_server_;
  std::unique_ptr<ShardClient> client_;
  std::unique_ptr<TrainerMetrics> metrics_;
  std::unique_ptr<GroupCollective> group_;    // null: no fabric group
  std::optional<std::vector<int>> my_shards_;  // unset: every shard
  absl::Mutex mu_;
  int64_t fabric_gathered_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t fabric_reduced_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::pair<std::shared_ptr<UnitTransfer>, bool>> transfers_ ABSL_GUARDED_BY(mu_);
  IntervalUnion waits_ ABSL_GUARDED_BY(mu_);
  IntervalUnion model_ ABSL_GUARDED_BY(mu_);
  absl::Time step_started_ ABSL_GUARDED_BY(mu_);
};

py::array_t<float> Transfer::Values() {
  if (!fetch_) throw py::value_error("a push has no values");
  Wait();
  if (group_ != nullptr && !gathered_) {
    group_->Gather(unit_, transfer_->values());
    gathered_ = true;
  }
  return ArrayOver(transfer_->values(), transfer_);
}

void Transfer::Wait() {
  const absl::Time start = absl::Now();
  absl::Status status;
  {
    py::gil_scoped_release unlocked;
    status = transfer_->Wait();
  }
  session_->AddWait(start, absl::Now());
  if (!status.ok()) Raise(status);
}

// The layout document in its canonical one-line form; ValueError naming
// what is wrong.
std::string CanonicalLayout(const std::string& text) {
  return FormatLayoutJson(Check(ParseLayoutJson(text)), /*one_line=*/true);
}

// The layout the servers serve, read over gRPC as a reader: a trainer
// checks it before it joins (a trainer that joins and goes away at once
// costs the servers a connection back to it).
std::string ServerLayout(std::vector<std::string> servers, double timeout_s) {
  ShardClient::Options options;
  options.server_addresses = std::move(servers);
  options.trainer_rank = -1;
  options.transport = "grpc";
  options.join_timeout = absl::Seconds(timeout_s);
  options.join_log = [](const std::string&) {};
  absl::StatusOr<std::unique_ptr<ShardClient>> client = absl::UnknownError("not connected");
  {
    py::gil_scoped_release unlocked;
    client = ShardClient::Connect(std::move(options));
  }
  return FormatLayoutJson(Check(std::move(client))->job().model, /*one_line=*/true);
}

std::string LayoutFingerprintHex(const std::string& text) {
  return FingerprintHex(LayoutFingerprint(Check(ParseLayoutJson(text))));
}

}  // namespace
}  // namespace pshard

PYBIND11_MODULE(_pshard, m) {
  using pshard::Session;
  using pshard::Transfer;
  m.doc() = "pshard's client library: fetch units from shard servers, push their gradients";
  py::class_<Transfer>(m, "Transfer")
      .def("wait", &Transfer::Wait, "Blocks until done; raises on failure.")
      .def("done", &Transfer::done)
      .def("values", &Transfer::Values, "A fetch's fp32 values (padded length), without a copy.");
  py::class_<Session>(m, "Session")
      .def(py::init<std::vector<std::string>, int, const std::string&, const std::string&, int, bool,
                    const std::string&, const std::string&, double, double>(),
           py::arg("servers"), py::arg("rank"), py::arg("weight_encoding") = "fp32",
           py::arg("grad_encoding") = "fp32", py::arg("quant_block") = pshard::kDefaultQuantBlock, py::arg("error_feedback") = true,
           py::arg("transport") = "auto", py::arg("metrics_address") = "", py::arg("join_timeout_s") = 30.0,
           py::arg("rpc_timeout_s") = 120.0)
      .def("layout_json", &Session::LayoutJson)
      .def("job", &Session::Job)
      .def("padded_numel", &Session::PaddedNumel)
      .def("metrics_port", &Session::metrics_port)
      .def("join_group", &Session::JoinGroup, py::arg("size"), py::arg("host") = "127.0.0.1")
      .def("group_size", &Session::group_size)
      .def("own_part", &Session::OwnPart, py::arg("unit"), py::arg("weights"))
      .def("regather", &Session::Regather, py::arg("unit"), py::arg("part"))
      .def("fetch", &Session::Fetch, py::arg("unit"), py::arg("version"), py::arg("alone") = false)
      .def("push", &Session::Push, py::arg("unit"), py::arg("step"), py::arg("grads"), py::arg("micro_batch") = 0)
      .def("add_model_time", &Session::AddModelTime)
      .def("record_step", &Session::RecordStep, py::arg("step"), py::arg("loss"), py::arg("tokens"));
  m.def("canonical_layout", &pshard::CanonicalLayout, "The layout document in its canonical one-line form.");
  m.def("server_layout", &pshard::ServerLayout, py::arg("servers"), py::arg("timeout_s") = 30.0,
        "The layout the servers serve (canonical one-line JSON), read without joining as a trainer.");
  m.def("layout_fingerprint", &pshard::LayoutFingerprintHex, "The layout's fingerprint, 0x and 16 hex digits.");
}
