#include "shard_server/server.h"

#include <atomic>
#include <thread>
#include <cstdio>

#include <algorithm>
#include <filesystem>
#include <optional>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/optimizer.h"
#include "absl/strings/str_join.h"
#include "shard_server/checkpoint.h"
#include "shard_server/connection_gate.h"
#include "common/serial_executor.h"
#include "absl/synchronization/notification.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "proto/rpc_util.h"
#include "common/metrics/metrics_server.h"
#include "shard_server/norm_coordinator.h"
#include "shard_server/grpc/grpc_service.h"
#include "shard_server/session_tokens.h"
#include "shard_server/step_driver.h"
#include "pshard/config.h"
#if PSHARD_WITH_UCX
#include "shard_server/ucx/ucx_service.h"
#endif

namespace pshard {

struct ShardServer::Impl {
  std::unique_ptr<ServerMetrics> metrics;
  std::unique_ptr<metrics::MetricsServer> metrics_server;
  std::shared_ptr<NormCoordinator> coordinator;  // shard 0 only
  std::unique_ptr<v1::ShardService::Stub> coordinator_stub;  // other shards
  std::unique_ptr<CallerAuthenticator> authenticator;
  std::shared_ptr<const ClientSecurity> as_server;  // how it calls other shards
  SessionTokens tokens;
  std::unique_ptr<ConnectionCaps> waiting_fetches;  // counted in fetches
  std::unique_ptr<ConnectionCaps> push_bytes;       // bytes of pushes not yet complete
  std::unique_ptr<ConnectionCaps> connections;      // counted in connections, per peer host
#if PSHARD_WITH_UCX
  std::unique_ptr<UcxService> ucx;
#endif
  std::unique_ptr<ShardServiceImpl> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor;  // of server
  std::unique_ptr<ConnectionGate> gate;  // hands connections to acceptor
  // The step driver, and what it is made from: a rollback stops it,
  // replaces the state, and starts a new one. driver_mu orders rollbacks
  // and shutdown.
  absl::Mutex driver_mu;
  std::unique_ptr<StepDriver> driver ABSL_GUARDED_BY(driver_mu);
  bool driving ABSL_GUARDED_BY(driver_mu) = false;
  StepDriver::AgreeFn agree;
  StepDriver::AfterStepFn after_step;
  absl::Duration step_timeout;
  void StartDriver(ShardState* state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(driver_mu) {
    driver = std::make_unique<StepDriver>(state, agree, step_timeout, metrics.get(), after_step);
    driving = true;
  }
  absl::Notification shutdown;
  bool stopped = false;
  // Shards other than 0 announce where they serve until shard 0 has it.
  absl::Notification stop_announcing;
  std::thread announcer;
  std::string checkpoint_dir;
  int checkpoint_keep = 2;
  bool continue_on_checkpoint_failure = false;
  mutable absl::Mutex failure_mu;
  absl::Status failure ABSL_GUARDED_BY(failure_mu);
  // A checkpoint of `step` that was not written: logged and counted; it
  // stops the server unless the job chose to go on without it.
  void CheckpointFailed(int shard, int64_t step, const absl::Status& why) {
    if (metrics) metrics->checkpoint_failures.Increment();
    if (continue_on_checkpoint_failure) {
      std::fprintf(stderr,
                   "pshard-server: shard %d: checkpoint at step %lld FAILED: %s; training goes on WITHOUT it "
                   "(--on_checkpoint_failure=continue): a crash now loses every step since the last one written\n",
                   shard, static_cast<long long>(step), why.ToString().c_str());
      return;
    }
    std::fprintf(stderr,
                 "pshard-server: shard %d: checkpoint at step %lld FAILED: %s; stopping "
                 "(--on_checkpoint_failure=continue would train on without it)\n",
                 shard, static_cast<long long>(step), why.ToString().c_str());
    absl::MutexLock lock(&failure_mu);
    if (failure.ok()) {
      failure = absl::Status(why.code(), absl::StrCat("shard ", shard, ": the checkpoint of step ", step,
                                                       " could not be written: ", why.message()));
    }
  }
  std::atomic<int64_t> saved_step{-1};  // the newest step written or being written, -1: none
  // Checkpoints are written on their own thread (`writer`), one at a time.
  absl::Mutex writer_mu;
  bool writing ABSL_GUARDED_BY(writer_mu) = false;
  // Removes the files retention lets go and lists what is left. Between
  // steps, with no write in flight.
  void Prune(int shard, int num_shards) {
    absl::MutexLock lock(&checkpoints_mu);
    PruneCheckpoints(checkpoint_dir, shard, num_shards, checkpoint_keep, common_steps);
    held_steps = ListCheckpointSteps(checkpoint_dir, shard, num_shards);
  }
  void WaitForWriter() {
    absl::MutexLock lock(&writer_mu);
    writer_mu.Await(absl::Condition(+[](bool* busy) { return !*busy; }, &writing));
  }
  // This shard's checkpoint steps on disk, and the two newest steps every
  // shard holds (learnt with each norm agreement), ascending. Two: should
  // another shard's file of the newest turn out damaged, it falls back to
  // the one before, and that must still be here.
  absl::Mutex checkpoints_mu;
  std::vector<int64_t> held_steps ABSL_GUARDED_BY(checkpoints_mu);
  std::vector<int64_t> common_steps ABSL_GUARDED_BY(checkpoints_mu);

  // The partial to report: this shard's norm and the checkpoints it holds.
  StepNorm WithHeldSteps(const StepNorm& partial) {
    StepNorm out = partial;
    absl::MutexLock lock(&checkpoints_mu);
    const size_t skip = held_steps.size() > kMaxReportedCheckpoints ? held_steps.size() - kMaxReportedCheckpoints : 0;
    out.checkpoint_steps.assign(held_steps.begin() + skip, held_steps.end());
    return out;
  }
  void LearnCommonSteps(const StepNorm& agreed) {
    if (agreed.checkpoint_steps.empty()) return;
    absl::MutexLock lock(&checkpoints_mu);
    common_steps.insert(common_steps.end(), agreed.checkpoint_steps.begin(), agreed.checkpoint_steps.end());
    absl::c_sort(common_steps);
    common_steps.erase(std::unique(common_steps.begin(), common_steps.end()), common_steps.end());
    if (common_steps.size() > 2) common_steps.erase(common_steps.begin(), common_steps.end() - 2);
  }
  // Last: destroyed first, running what is queued while the rest is alive.
  std::unique_ptr<SerialExecutor> writer = std::make_unique<SerialExecutor>();
};

namespace {

// Shard 0 agrees with itself through its own coordinator.
absl::StatusOr<StepNorm> AgreeLocally(NormCoordinator* coordinator, int64_t step,
                                      const StepNorm& partial, absl::Time deadline) {
  absl::Notification done;
  absl::StatusOr<StepNorm> result;
  coordinator->Report(step, 0, partial, deadline, [&](absl::StatusOr<StepNorm> total) {
    result = std::move(total);
    done.Notify();
  });
  done.WaitForNotification();  // Report always answers by its deadline
  return result;
}

absl::StatusOr<StepNorm> AgreeRemotely(v1::ShardService::Stub* stub, const ShardState& state,
                                       uint64_t fingerprint, int64_t step, const StepNorm& partial,
                                       absl::Time deadline) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  v1::NormReport report;
  report.set_shard_index(state.shard_index());
  report.set_step(step);
  report.set_sum_of_squares(partial.sum_of_squares.ToBytes());
  report.set_non_finite(partial.non_finite);
  report.set_job_fingerprint(fingerprint);
  for (int64_t s : partial.checkpoint_steps) report.add_checkpoint_steps(s);
  v1::NormAgreement agreement;
  grpc::Status s = stub->AgreeNorm(&ctx, report, &agreement);
  if (!s.ok()) {
    return absl::Status(FromGrpcStatus(s).code(),
                        absl::StrCat("norm agreement with the coordinator (shard 0): ", s.error_message()));
  }
  absl::StatusOr<SquareSum> total = SquareSum::FromBytes(agreement.total_sum_of_squares());
  if (!total.ok()) {
    return absl::DataLossError(absl::StrCat("norm agreement from the coordinator (shard 0): ", total.status().message()));
  }
  StepNorm agreed;
  agreed.sum_of_squares = *total;
  agreed.non_finite = agreement.non_finite();
  agreed.checkpoint_steps.assign(agreement.common_checkpoint_steps().begin(),
                                 agreement.common_checkpoint_steps().end());
  return agreed;
}

// Tells shard 0 where this shard serves; retries (shard 0 may start later)
// until it is told, refused, or `stop` is notified.
void Announce(v1::ShardService::Stub* coordinator, int shard, int port, const std::string& advertised,
              uint64_t fingerprint, absl::Notification& stop) {
  v1::AnnounceRequest request;
  request.set_shard_index(shard);
  request.set_port(port);
  request.set_advertised_address(advertised);
  request.set_job_fingerprint(fingerprint);
  do {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::AnnounceResponse response;
    const grpc::Status s = coordinator->Announce(&ctx, request, &response);
    if (s.ok()) return;
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE && s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
      std::fprintf(stderr, "pshard-server: shard %d: shard 0 refused this shard's address: %s\n", shard,
                   s.error_message().c_str());
      return;
    }
  } while (!stop.WaitForNotificationWithTimeout(absl::Seconds(1)));
}

// Whether a pshard server answers at `address` as shard `shard`, within a
// second. Without TLS or tokens: what shard 0 probes before an Announce moves
// a shard.
// Room for a trainer's pushes of every unit at once in fp32, twice over,
// and 16 MiB; in all, that for each trainer and two more.
ConnectionCaps::Limits DefaultPushByteLimits(const ShardState& state) {
  int64_t gradient = 0;
  for (int unit = 0; unit < state.num_units(); ++unit) gradient += 4 * state.slice_length(unit);
  const int64_t per_connection = 2 * gradient + (int64_t{16} << 20);
  return ConnectionCaps::Limits{.per_connection = per_connection,
                                .total = per_connection * (state.job().num_trainers + 2)};
}

bool ShardAnswersAt(const std::string& address, int shard) {
  std::unique_ptr<v1::ShardService::Stub> stub =
      v1::ShardService::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  v1::StatusRequest request;
  v1::StatusResponse response;
  return stub->GetStatus(&ctx, request, &response).ok() && response.shard_index() == shard;
}

std::string Lr(double lr) { return absl::StrFormat("%.3g", lr); }

// A resume onto another end of the learning-rate schedule: refused unless
// asked for; when asked for, the note says what changes.
absl::StatusOr<std::string> CheckScheduleEnd(const Checkpoint& checkpoint, const ShardServer::Spec& spec) {
  const int64_t was = checkpoint.header.schedule_end;
  const OptimizerConfig& now = spec.job.optimizer;
  if (was < 0 || was == now.total_steps) return std::string();  // unknown (first format), or the same
  OptimizerConfig before = now;
  before.total_steps = was;
  const int64_t step = checkpoint.header.step;
  const double stretched = LearningRateAt(now, step), kept = LearningRateAt(before, step);
  const std::string change = absl::StrCat(
      "the checkpoint (step ", step, ") was written by a job whose learning-rate schedule ends at step ", was,
      ", this one's ends at step ", now.total_steps, ": stretched, the rate at step ", step, " is ", Lr(stretched),
      stretched == kept ? "" : absl::StrCat(" instead of ", Lr(kept)), " and reaches --min_lr (", Lr(now.min_lr),
      ") at step ", now.total_steps);
  if (!spec.allow_schedule_change) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", checkpoint.path, ": ", change, ". To train longer, either keep the schedule (pshard local: ",
        "--schedule_steps=", was, "; pshard-server: --total_steps=", was, "): the steps after ", was,
        " run at its final rate, --min_lr (", Lr(now.min_lr), "); or stretch it to the new end with --allow_schedule_change"));
  }
  return absl::StrCat("schedule re-stretched (--allow_schedule_change): ", change);
}

std::string CheckpointPath(const ShardServer::Spec& spec, int64_t step) {
  return (std::filesystem::path(spec.checkpoint_dir) / CheckpointFileName(spec.shard_index, spec.job.num_shards, step))
      .string();
}

// Restores this shard's checkpoint of `step`; its path.
absl::StatusOr<std::string> RestoreStep(ShardState& state, const ShardServer::Spec& spec, int64_t step,
                                        std::vector<std::string>& notes) {
  const std::string path = CheckpointPath(spec, step);
  ASSIGN_OR_RETURN(Checkpoint checkpoint, ReadCheckpoint(path));
  if (checkpoint.header.step != step) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path, " says step ", checkpoint.header.step));
  }
  ASSIGN_OR_RETURN(const std::string schedule_note, CheckScheduleEnd(checkpoint, spec));
  RETURN_IF_ERROR(state.RestoreCheckpoint(std::move(checkpoint)));
  if (!schedule_note.empty()) notes.push_back(schedule_note);
  return path;
}

// Restores the newest intact checkpoint of this shard (or `resume_step`'s);
// the path restored, "" when there is none to restore.
absl::StatusOr<std::string> RestoreFromFolder(ShardState& state, const ShardServer::Spec& spec,
                                              std::vector<std::string>& notes) {
  if (spec.start_fresh) {
    ASSIGN_OR_RETURN(const std::string aside,
                     SetAsideCheckpoints(spec.checkpoint_dir, spec.shard_index, spec.job.num_shards));
    if (!aside.empty()) notes.push_back(absl::StrCat("--start_fresh: earlier checkpoints moved to ", aside));
    return std::string();
  }
  RETURN_IF_ERROR(CheckFolderLayout(spec.checkpoint_dir, spec.job.num_shards, state.LayoutDescription()));
  const std::vector<int64_t> steps = ListCheckpointSteps(spec.checkpoint_dir, spec.shard_index, spec.job.num_shards);
  if (spec.resume_step >= 0) {
    if (std::find(steps.begin(), steps.end(), spec.resume_step) == steps.end()) {
      return absl::NotFoundError(absl::StrCat("no checkpoint of step ", spec.resume_step, " for shard ",
                                              spec.shard_index, " of ", spec.job.num_shards, " in ",
                                              spec.checkpoint_dir, " (steps there: ",
                                              steps.empty() ? "none" : absl::StrJoin(steps, ", "), ")"));
    }
    return RestoreStep(state, spec, spec.resume_step, notes);
  }
  // The newest intact one: a damaged file is set aside, named, and the one
  // before it is tried (the shards ahead then roll back to the step this
  // one restores, which retention kept for this case).
  for (auto newest = steps.rbegin(); newest != steps.rend(); ++newest) {
    absl::StatusOr<std::string> restored = RestoreStep(state, spec, *newest, notes);
    if (restored.ok() || restored.status().code() != absl::StatusCode::kDataLoss) return restored;
    const std::string path = CheckpointPath(spec, *newest);
    ASSIGN_OR_RETURN(const std::string aside, SetAsideDamagedCheckpoint(path));
    const std::string note = absl::StrCat(restored.status().message(), "; set aside as ", aside,
                                          ", trying the checkpoint before it");
    notes.push_back(note);
  }
  if (!steps.empty()) {
    // Starting from the seed's weights would silently drop the job's training.
    return absl::DataLossError(absl::StrCat("every checkpoint of shard ", spec.shard_index, " in ",
                                            spec.checkpoint_dir, " is damaged (set aside in its folder damaged/: ",
                                            absl::StrJoin(notes, "; "), "); --start_fresh starts over"));
  }
  return std::string();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShardServer>> ShardServer::Start(Spec spec) {
  if (spec.shard_index != 0 && spec.coordinator_address.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard ", spec.shard_index, " needs the address of shard 0 (the coordinator)"));
  }
  // A fetch chunk plus its framing must fit in one message.
  if (spec.fetch_chunk_bytes + (64 << 10) > spec.max_message_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("max message size ", spec.max_message_bytes,
                                                   " bytes cannot carry fetch chunks of ", spec.fetch_chunk_bytes,
                                                   " bytes; raise it or lower the chunk size"));
  }
  if (spec.connection_limits.per_connection < 1 ||
      spec.connection_limits.total < spec.connection_limits.per_connection) {
    return absl::InvalidArgumentError(absl::StrCat(
        "connection caps of ", spec.connection_limits.per_connection, " per host and ", spec.connection_limits.total,
        " in all: need at least 1 per host, and no fewer in all than per host"));
  }
  // Credentials first: a server that cannot authenticate must not start open.
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials, ServerCredentialsFor(spec.security));
  ASSIGN_OR_RETURN(std::unique_ptr<CallerAuthenticator> authenticator, CallerAuthenticator::Create(spec.security));
  // How this server calls the others (shard 0, a restarted shard).
  ASSIGN_OR_RETURN(std::shared_ptr<const ClientSecurity> as_server, ClientSecurity::Create(spec.security, Role::kServer));
  std::unique_ptr<ShardServer> server(new ShardServer());
  if (spec.checkpoint_every < 0 || spec.checkpoint_keep < 1) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint interval ", spec.checkpoint_every, " and count kept ",
                                                   spec.checkpoint_keep, ": need interval >= 0, count >= 1"));
  }
  if (spec.checkpoint_dir.empty() && (spec.resume_step >= 0 || spec.start_fresh)) {
    return absl::InvalidArgumentError("a resume step or a fresh start needs a checkpoint folder");
  }
  if (spec.resume_step >= 0 && spec.start_fresh) {
    return absl::InvalidArgumentError("a resume step and a fresh start exclude each other");
  }
  {
    std::optional<InitialWeights> initial;
    if (!spec.init_from.empty()) {
      ASSIGN_OR_RETURN(initial, InitialWeights::Load(spec.init_from, spec.job.model));
      spec.job.init_fingerprint = initial->fingerprint();
    }
    ASSIGN_OR_RETURN(server->state_,
                     ShardState::Create(spec.job, spec.shard_index, initial ? &*initial : nullptr));
  }
  server->impl_ = std::make_unique<Impl>();
  Impl& impl = *server->impl_;
  impl.authenticator = std::move(authenticator);
  impl.as_server = as_server;
  impl.checkpoint_keep = spec.checkpoint_keep;
  impl.continue_on_checkpoint_failure = spec.continue_on_checkpoint_failure;
  if (!spec.checkpoint_dir.empty()) {
    // Made now, so that a folder missing later was deleted.
    std::error_code made;
    std::filesystem::create_directories(spec.checkpoint_dir, made);
    if (made) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot create the checkpoint folder ", spec.checkpoint_dir, ": ", made.message()));
    }
    ASSIGN_OR_RETURN(server->restored_from_, RestoreFromFolder(*server->state_, spec, server->start_notes_));
    absl::MutexLock lock(&impl.checkpoints_mu);
    impl.held_steps = ListCheckpointSteps(spec.checkpoint_dir, spec.shard_index, spec.job.num_shards);
    if (!server->restored_from_.empty()) {
      impl.saved_step = server->state_->current_step();
      // Trainers refuse servers at different steps, so a job that trains
      // on from here has every shard at this step.
      impl.common_steps = {server->state_->current_step()};
    }
  }
  if (!spec.init_from.empty()) {
    server->start_notes_.push_back(
        server->restored_from_.empty()
            ? absl::StrCat("initial weights from ", spec.init_from, " (--init_from)")
            : absl::StrCat("--init_from ", spec.init_from,
                           " is where the job started; the checkpoint's weights are restored, not its"));
  }
  std::vector<std::string> transports = {"grpc"};
  if (PSHARD_WITH_UCX && spec.enable_ucx) transports.push_back("ucx");
  impl.metrics = std::make_unique<ServerMetrics>(server->registry_, spec.shard_index, spec.job.num_trainers,
                                                 server->state_->num_units(), transports);
  const ShardState::Counters counters = server->state_->counters();
  impl.metrics->state_master_bytes.Set(static_cast<double>(counters.master_bytes));
  impl.metrics->state_m_bytes.Set(static_cast<double>(counters.moment_bytes));
  impl.metrics->state_v_bytes.Set(static_cast<double>(counters.moment_bytes));
  impl.metrics->state_grad_bytes.Set(static_cast<double>(counters.gradient_bytes));
  impl.metrics->expected_state_bytes.Set(16.0 * static_cast<double>(server->state_->layout().spec.TotalParameters()) /
                                         spec.job.num_shards);
  if (!spec.metrics_address.empty()) {
    ASSIGN_OR_RETURN(impl.metrics_server, metrics::MetricsServer::Start(spec.metrics_address, &server->registry_));
  }
  if (spec.shard_index == 0) {
    impl.coordinator = std::make_shared<NormCoordinator>(spec.job.num_shards);
    server->state_->SetNormWaitDescription([weak = std::weak_ptr<NormCoordinator>(impl.coordinator)](int64_t step) {
      const std::shared_ptr<NormCoordinator> coordinator = weak.lock();
      const std::vector<int> missing = coordinator ? coordinator->Missing(step) : std::vector<int>();
      return missing.empty() ? std::string()
                             : absl::StrCat("no partial norm yet from shard(s) ", absl::StrJoin(missing, ","));
    });
  } else {
    server->state_->SetNormWaitDescription(
        [](int64_t) { return std::string("waiting for the total from shard 0, the coordinator"); });
  }
  ShardServiceImpl::Options options;
  if (impl.metrics_server) options.metrics_address = impl.metrics_server->address();
  options.fetch_wait_limit = spec.fetch_wait_limit;
  options.norm_wait_limit = spec.step_timeout;
  options.fetch_chunk_bytes = spec.fetch_chunk_bytes;
  options.tokens = &impl.tokens;
  impl.waiting_fetches = std::make_unique<ConnectionCaps>("fetches waiting for their versions",
                                                          spec.waiting_fetch_limits, &impl.metrics->waiting_fetches);
  options.waiting_fetches = impl.waiting_fetches.get();
  impl.push_bytes = std::make_unique<ConnectionCaps>(
      "bytes of pushes not yet complete",
      spec.push_byte_limits.total > 0 ? spec.push_byte_limits : DefaultPushByteLimits(*server->state_),
      &impl.metrics->unfinished_push_bytes);
  options.push_bytes = impl.push_bytes.get();
  options.coordinator_address = spec.coordinator_address;
  options.own_address = spec.advertise_address;
  options.authenticator = impl.authenticator.get();
  options.roll_back = [raw = server.get()](int64_t step, int rank, const std::vector<std::string>& restarted) {
    return raw->RollBack(step, rank, restarted);
  };
  if (!server->restored_from_.empty()) options.restored_step = server->state_->current_step();
  if (spec.shard_index == 0 && !spec.security.any()) options.answers_as_shard = ShardAnswersAt;
#if PSHARD_WITH_UCX
  if (spec.enable_ucx) {
    UcxService::Options ucx_options;
    ucx_options.fetch_wait_limit = spec.fetch_wait_limit;
    ucx_options.waiting_fetches = impl.waiting_fetches.get();
    absl::StatusOr<std::unique_ptr<UcxService>> ucx =
        UcxService::Start(server->state_.get(), &impl.tokens, impl.metrics.get(), ucx_options);
    if (ucx.ok()) {
      impl.ucx = std::move(*ucx);
      options.ucx_address = impl.ucx->address();
    } else {
      std::fprintf(stderr, "pshard-server: shard %d: UCX data path unavailable, serving gRPC only: %s\n",
                   spec.shard_index, std::string(ucx.status().message()).c_str());
    }
  }
#endif
  impl.service = std::make_unique<ShardServiceImpl>(server->state_.get(), impl.coordinator.get(),
                                                    impl.metrics.get(), options);

  // The listening socket is the gate's: it counts and caps connections
  // before gRPC takes them (and their handshakes) on.
  impl.connections = std::make_unique<ConnectionCaps>("open connections", spec.connection_limits,
                                                      &impl.metrics->open_connections, "host");
  ASSIGN_OR_RETURN(impl.gate,
                   ConnectionGate::Listen(spec.address, impl.connections.get(), &impl.metrics->refused_connections));
  server->port_ = impl.gate->port();
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  impl.acceptor = builder.experimental().AddExternalConnectionAcceptor(
      grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD, credentials);
  builder.RegisterService(impl.service.get());
  builder.SetMaxReceiveMessageSize(spec.max_message_bytes);
  builder.SetMaxSendMessageSize(spec.max_message_bytes);
  for (const auto& [name, value] : DataPathTransportArguments()) builder.AddChannelArgument(name, value);
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                             static_cast<int>(absl::ToInt64Milliseconds(spec.handshake_timeout)));
  impl.server = builder.BuildAndStart();
  if (impl.server == nullptr) return absl::UnavailableError(absl::StrCat("cannot serve on ", spec.address));
  impl.gate->Start(impl.acceptor.get());
  server->host_ = spec.address.substr(0, spec.address.rfind(':'));

  StepDriver::AgreeFn agree;
  if (impl.coordinator) {
    agree = [&impl](int64_t step, const StepNorm& partial, absl::Time deadline) -> absl::StatusOr<StepNorm> {
      ASSIGN_OR_RETURN(StepNorm agreed, AgreeLocally(impl.coordinator.get(), step, impl.WithHeldSteps(partial),
                                                     deadline));
      impl.LearnCommonSteps(agreed);
      return agreed;
    };
  } else {
    impl.coordinator_stub = v1::ShardService::NewStub(as_server->NewChannel(spec.coordinator_address));
    agree = [&impl, state = server->state_.get(), fingerprint = JobFingerprint(spec.job)](
                int64_t step, const StepNorm& partial, absl::Time deadline) -> absl::StatusOr<StepNorm> {
      ASSIGN_OR_RETURN(StepNorm agreed, AgreeRemotely(impl.coordinator_stub.get(), *state, fingerprint, step,
                                                      impl.WithHeldSteps(partial), deadline));
      impl.LearnCommonSteps(agreed);
      return agreed;
    };
  }
  if (!impl.coordinator) {
    impl.announcer = std::thread([&impl, shard = spec.shard_index, port = server->port_,
                                  advertised = spec.advertise_address, fingerprint = JobFingerprint(spec.job)] {
      Announce(impl.coordinator_stub.get(), shard, port, advertised, fingerprint, impl.stop_announcing);
    });
  }
  StepDriver::AfterStepFn after_step;
  if (!spec.checkpoint_dir.empty() && spec.checkpoint_every > 0) {
    after_step = [server = server.get(), every = spec.checkpoint_every](const StepOutcome& outcome) {
      if ((outcome.step + 1) % every == 0) server->SaveCheckpoint();
    };
  }
  // Only a server that started (and restored) writes checkpoints: one that
  // failed must not put its fresh state next to the files it refused.
  impl.checkpoint_dir = spec.checkpoint_dir;
  impl.agree = std::move(agree);
  impl.after_step = std::move(after_step);
  impl.step_timeout = spec.step_timeout;
  absl::MutexLock lock(&impl.driver_mu);
  impl.StartDriver(server->state_.get());
  return server;
}

ShardServer::~ShardServer() { Shutdown(absl::ZeroDuration()); }

void ShardServer::SaveCheckpoint() {
  Impl& impl = *impl_;
  const int64_t step = state_->current_step();
  // Step 0 is the seed's initialisation: nothing to keep.
  if (impl.checkpoint_dir.empty() || step == 0 || impl.saved_step.load() == step) return;
  // One write at a time: the state is copied once more at most, and a disk
  // slower than the steps holds the steps back rather than piling copies up.
  impl.WaitForWriter();
  impl.Prune(state_->shard_index(), state_->job().num_shards);
  const absl::Time start = absl::Now();
  absl::StatusOr<Checkpoint> snapshot = state_->Snapshot();
  if (!snapshot.ok()) {
    std::fprintf(stderr, "pshard-server: shard %d: checkpoint at step %lld FAILED: %s\n", state_->shard_index(),
                 static_cast<long long>(step), snapshot.status().ToString().c_str());
    return;
  }
  impl.saved_step = step;  // asked for: not again, whatever the write does
  {
    absl::MutexLock lock(&impl.writer_mu);
    impl.writing = true;
  }
  // Written while the next steps train; the norm reports name a step only
  // once its file is complete. Old files are removed on this thread only
  // (Prune), between steps: a step this shard reported holding is removed
  // only after the agreement that reported it, so that the common step the
  // shards learn from it is always still there.
  impl.writer->Post([&impl, shard = state_->shard_index(), step, start, snapshot = *std::move(snapshot)] {
    // The folder was there at start: gone now, it was deleted, and a new
    // empty one would hide that every earlier checkpoint went with it.
    absl::StatusOr<std::string> path =
        std::filesystem::is_directory(impl.checkpoint_dir)
            ? WriteCheckpointFile(impl.checkpoint_dir, snapshot)
            : absl::NotFoundError(absl::StrCat("the checkpoint folder ", impl.checkpoint_dir,
                                               " is gone (deleted while the job ran?); it is not made again"));
    if (!path.ok()) {
      impl.CheckpointFailed(shard, step, path.status());  // the previous checkpoints stay
    } else {
      {
        absl::MutexLock lock(&impl.checkpoints_mu);
        impl.held_steps.insert(std::upper_bound(impl.held_steps.begin(), impl.held_steps.end(), step), step);
        impl.held_steps.erase(std::unique(impl.held_steps.begin(), impl.held_steps.end()), impl.held_steps.end());
      }
      if (impl.metrics) {
        impl.metrics->checkpoint_step.Set(static_cast<double>(step));
        impl.metrics->checkpoint_write_seconds.Increment(absl::ToDoubleSeconds(absl::Now() - start));
      }
      std::fprintf(stderr, "pshard-server: shard %d: checkpoint of step %lld written to %s (%.0f ms)\n", shard,
                   static_cast<long long>(step), path->c_str(), absl::ToDoubleMilliseconds(absl::Now() - start));
    }
    absl::MutexLock lock(&impl.writer_mu);
    impl.writing = false;
  });
}

namespace {

// The shard among `addresses` that restarted from its checkpoint of `step`
// and is still at it (asked with GetStatus): the evidence a rollback needs.
absl::StatusOr<int> RestartedShardAt(int64_t step, const std::vector<std::string>& addresses, int self,
                                     const ClientSecurity& security, uint64_t fingerprint) {
  std::vector<std::string> seen;
  for (const std::string& address : addresses) {
    std::unique_ptr<v1::ShardService::Stub> stub = v1::ShardService::NewStub(security.NewChannel(address));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    v1::StatusResponse status;
    if (const grpc::Status s = stub->GetStatus(&ctx, v1::StatusRequest(), &status); !s.ok()) {
      seen.push_back(absl::StrCat(address, " did not answer (", s.error_message(), ")"));
    } else if (status.job_fingerprint() != fingerprint || status.shard_index() == self) {
      seen.push_back(absl::StrCat(address, " is not another shard of this job"));
    } else if (status.current_step() != step || status.restored_step() != step) {
      seen.push_back(absl::StrCat(address, " (shard ", status.shard_index(), ") is at step ", status.current_step(),
                                  status.restored_step() < 0
                                      ? std::string(", not restored from a checkpoint")
                                      : absl::StrCat(", restored at step ", status.restored_step())));
    } else {
      return status.shard_index();
    }
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "no shard of this job restarted from its checkpoint of step ", step, " and is still there (",
      seen.empty() ? std::string("the rollback names none") : absl::StrJoin(seen, "; "),
      "): a rollback is only for a shard that restarted, once"));
}

}  // namespace

absl::StatusOr<int64_t> ShardServer::RollBack(int64_t step, int rank, const std::vector<std::string>& restarted) {
  Impl& impl = *impl_;
  const int shard = state_->shard_index();
  absl::MutexLock lock(&impl.driver_mu);
  if (!impl.driving) return absl::UnavailableError(absl::StrCat("shard ", shard, " is shutting down"));
  const int64_t from = state_->current_step();
  if (step == from) return from;
  if (step > from) {
    return absl::FailedPreconditionError(absl::StrCat("shard ", shard, " is at step ", from,
                                                      ": it cannot roll forward to step ", step));
  }
  const std::string common = absl::StrCat(
      "; the job cannot resume exactly without it: stop every server and restart them with --resume_step set to "
      "a step every shard holds");
  if (impl.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("shard ", shard, " is at step ", from,
                                                      " and keeps no checkpoints (no --checkpoint_dir), so it "
                                                      "cannot go back to step ", step, common));
  }
  const std::string path =
      (std::filesystem::path(impl.checkpoint_dir) / CheckpointFileName(shard, state_->job().num_shards, step)).string();
  impl.WaitForWriter();  // the checkpoint of `step` may still be being written
  absl::StatusOr<Checkpoint> checkpoint = ReadCheckpoint(path);
  if (!checkpoint.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("shard ", shard, " is at step ", from,
                                                      " and cannot go back to step ", step, ": ",
                                                      checkpoint.status().message(), common));
  }
  absl::StatusOr<int> behind = RestartedShardAt(step, restarted, shard, *impl.as_server, JobFingerprint(state_->job()));
  if (!behind.ok()) {
    impl.metrics->refused_rollbacks.Increment();
    return absl::FailedPreconditionError(absl::StrCat("shard ", shard, " at step ", from, " does not roll back to step ",
                                                      step, " for trainer ", rank, ": ", behind.status().message()));
  }
  impl.driver.reset();  // between steps from here on
  const absl::Status rolled = state_->RollBack(*std::move(checkpoint), rank);
  if (rolled.ok()) {
    if (impl.coordinator) impl.coordinator->ForgetFrom(step);
    impl.saved_step = step;
    impl.metrics->rollbacks.Increment();
    impl.metrics->rolled_back_steps.Increment(static_cast<double>(from - step));
    impl.metrics->step.Set(static_cast<double>(step));
    std::fprintf(stderr,
                 "pshard-server: shard %d rolled back from step %lld to its checkpoint of step %lld (asked by "
                 "trainer %d): shard %d restarted there; the trainers redo the steps since\n",
                 shard, static_cast<long long>(from), static_cast<long long>(step), rank, *behind);
  }
  impl.StartDriver(state_.get());
  if (!rolled.ok()) return rolled;
  return step;
}

absl::Status ShardServer::failure() const {
  absl::MutexLock lock(&impl_->failure_mu);
  return impl_->failure;
}

int64_t ShardServer::common_checkpoint_step() const {
  absl::MutexLock lock(&impl_->checkpoints_mu);
  return impl_->common_steps.empty() ? -1 : impl_->common_steps.back();
}

int ShardServer::metrics_port() const {
  return impl_ && impl_->metrics_server ? impl_->metrics_server->port() : 0;
}

std::string ShardServer::ucx_address() const {
#if PSHARD_WITH_UCX
  if (impl_ && impl_->ucx) return impl_->ucx->address();
#endif
  return "";
}

std::string ShardServer::address() const { return absl::StrCat(host_, ":", port_); }

void ShardServer::Wait() { impl_->shutdown.WaitForNotification(); }

void ShardServer::Shutdown(absl::Duration grace) {
  if (!impl_ || impl_->stopped) return;
  impl_->stopped = true;
  {
    absl::MutexLock lock(&impl_->driver_mu);
    impl_->driver.reset();  // no step is being applied from here on
    impl_->driving = false;
  }
  impl_->stop_announcing.Notify();
  if (impl_->announcer.joinable()) impl_->announcer.join();
  SaveCheckpoint();
  impl_->WaitForWriter();
  if (!impl_->checkpoint_dir.empty()) impl_->Prune(state_->shard_index(), state_->job().num_shards);
  if (impl_->service) impl_->service->StopWaiting();
  impl_->gate.reset();  // no new connections
  if (impl_->server) {  // absent when Start failed part-way
    impl_->server->Shutdown(absl::ToChronoTime(absl::Now() + grace));
    impl_->server->Wait();
  }
#if PSHARD_WITH_UCX
  impl_->ucx.reset();
#endif
  if (!impl_->shutdown.HasBeenNotified()) impl_->shutdown.Notify();
}

}  // namespace pshard
