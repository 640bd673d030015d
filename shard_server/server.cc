#include "shard_server/server.h"

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "proto/rpc_util.h"
#include "shard_server/norm_coordinator.h"
#include "shard_server/service.h"
#include "shard_server/step_driver.h"

namespace pshard {

struct ShardServer::Impl {
  std::unique_ptr<NormCoordinator> coordinator;  // shard 0 only
  std::unique_ptr<v1::ShardService::Stub> coordinator_stub;  // other shards
  std::unique_ptr<ShardServiceImpl> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<StepDriver> driver;
  absl::Notification shutdown;
  bool stopped = false;
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
  report.set_sum_of_squares(partial.total_sum_of_squares);
  report.set_non_finite(partial.non_finite);
  report.set_job_fingerprint(fingerprint);
  v1::NormAgreement agreement;
  grpc::Status s = stub->AgreeNorm(&ctx, report, &agreement);
  if (!s.ok()) {
    return absl::Status(FromGrpcStatus(s).code(),
                        absl::StrCat("norm agreement with the coordinator (shard 0): ", s.error_message()));
  }
  return StepNorm{agreement.total_sum_of_squares(), agreement.non_finite()};
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShardServer>> ShardServer::Start(Spec spec) {
  if (spec.shard_index != 0 && spec.coordinator_address.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard ", spec.shard_index, " needs the address of shard 0 (the coordinator)"));
  }
  std::unique_ptr<ShardServer> server(new ShardServer());
  ASSIGN_OR_RETURN(server->state_, ShardState::Create(spec.job, spec.shard_index));
  server->impl_ = std::make_unique<Impl>();
  Impl& impl = *server->impl_;
  if (spec.shard_index == 0) impl.coordinator = std::make_unique<NormCoordinator>(spec.job.num_shards);
  ShardServiceImpl::Options options;
  options.fetch_wait_limit = spec.fetch_wait_limit;
  options.norm_wait_limit = spec.step_timeout;
  options.fetch_chunk_bytes = spec.fetch_chunk_bytes;
  impl.service = std::make_unique<ShardServiceImpl>(server->state_.get(), impl.coordinator.get(), options);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(spec.address, grpc::InsecureServerCredentials(), &server->port_);
  builder.RegisterService(impl.service.get());
  builder.SetMaxReceiveMessageSize(spec.max_message_bytes);
  builder.SetMaxSendMessageSize(spec.max_message_bytes);
  impl.server = builder.BuildAndStart();
  if (impl.server == nullptr || server->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", spec.address));
  }
  server->host_ = spec.address.substr(0, spec.address.rfind(':'));

  StepDriver::AgreeFn agree;
  if (impl.coordinator) {
    agree = [coordinator = impl.coordinator.get()](int64_t step, const StepNorm& partial,
                                                    absl::Time deadline) {
      return AgreeLocally(coordinator, step, partial, deadline);
    };
  } else {
    impl.coordinator_stub = v1::ShardService::NewStub(
        grpc::CreateChannel(spec.coordinator_address, grpc::InsecureChannelCredentials()));
    agree = [stub = impl.coordinator_stub.get(), state = server->state_.get(),
             fingerprint = JobFingerprint(spec.job)](int64_t step, const StepNorm& partial,
                                                      absl::Time deadline) {
      return AgreeRemotely(stub, *state, fingerprint, step, partial, deadline);
    };
  }
  impl.driver = std::make_unique<StepDriver>(server->state_.get(), std::move(agree), spec.step_timeout);
  return server;
}

ShardServer::~ShardServer() { Shutdown(absl::ZeroDuration()); }

std::string ShardServer::address() const { return absl::StrCat(host_, ":", port_); }

void ShardServer::Wait() { impl_->shutdown.WaitForNotification(); }

void ShardServer::Shutdown(absl::Duration grace) {
  if (!impl_ || impl_->stopped) return;
  impl_->stopped = true;
  impl_->driver.reset();
  impl_->server->Shutdown(absl::ToChronoTime(absl::Now() + grace));
  impl_->server->Wait();
  if (!impl_->shutdown.HasBeenNotified()) impl_->shutdown.Notify();
}

}  // namespace pshard
