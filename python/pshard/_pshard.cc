// The C++ side of the PyTorch bridge: a trainer's connection to the shard
// servers (fetch a unit, push its gradient, asynchronously), its metrics
// endpoint, and the layout checks. python/pshard/torch.py builds on it.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/layout_file.h"
#include "common/metrics/metrics_server.h"
#include "common/security/security.h"
#include "pybind11/numpy.h"
#include "pybind11/pybind11.h"
#include "pybind11/stl.h"
#include "trainer_client/busy_clock.h"
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

/// One fetch or push in flight.
class Transfer {
 public:
  Transfer(std::shared_ptr<UnitTransfer> transfer, Session* session, bool fetch)
      : transfer_(std::move(transfer)), session_(session), fetch_(fetch) {}
  /// Blocks (without the GIL) until done; raises on failure.
  void Wait();
  bool done() const { return transfer_->done(); }
  /// A fetch's values, fp32, the unit's padded length: the client's own
  /// buffer, not a copy; it lives as long as the array does.
  py::array_t<float> Values() {
    if (!fetch_) throw py::value_error("a push has no values");
    Wait();
    auto* owner = new std::shared_ptr<UnitTransfer>(transfer_);
    py::capsule base(owner, [](void* p) { delete static_cast<std::shared_ptr<UnitTransfer>*>(p); });
    std::vector<float>& values = transfer_->values();
    return py::array_t<float>({static_cast<py::ssize_t>(values.size())}, {sizeof(float)}, values.data(), base);
  }

 private:
  std::shared_ptr<UnitTransfer> transfer_;
  Session* session_;
  bool fetch_;
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

  std::unique_ptr<Transfer> Fetch(int unit, int64_t version) {
    CheckUnit(unit);
    std::shared_ptr<UnitTransfer> t = client_->StartFetch(unit, version);
    Remember(t, /*fetch=*/true);
    return std::make_unique<Transfer>(std::move(t), this, true);
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
    std::shared_ptr<UnitTransfer> t = client_->StartPush(unit, step, std::move(values), push);
    Remember(t, /*fetch=*/false);
    return std::make_unique<Transfer>(std::move(t), this, false);
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
  absl::Mutex mu_;
  std::vector<std::pair<std::shared_ptr<UnitTransfer>, bool>> transfers_ ABSL_GUARDED_BY(mu_);
  IntervalUnion waits_ ABSL_GUARDED_BY(mu_);
  IntervalUnion model_ ABSL_GUARDED_BY(mu_);
  absl::Time step_started_ ABSL_GUARDED_BY(mu_);
};

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
      .def("fetch", &Session::Fetch, py::arg("unit"), py::arg("version"))
      .def("push", &Session::Push, py::arg("unit"), py::arg("step"), py::arg("grads"), py::arg("micro_batch") = 0)
      .def("add_model_time", &Session::AddModelTime)
      .def("record_step", &Session::RecordStep, py::arg("step"), py::arg("loss"), py::arg("tokens"));
  m.def("canonical_layout", &pshard::CanonicalLayout, "The layout document in its canonical one-line form.");
  m.def("server_layout", &pshard::ServerLayout, py::arg("servers"), py::arg("timeout_s") = 30.0,
        "The layout the servers serve (canonical one-line JSON), read without joining as a trainer.");
  m.def("layout_fingerprint", &pshard::LayoutFingerprintHex, "The layout's fingerprint, 0x and 16 hex digits.");
}
