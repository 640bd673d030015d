// The gRPC data path: chunked server-streaming fetches and client-streaming
// pushes, with optional in-process link emulation.
#ifndef PSHARD_TRAINER_CLIENT_TRANSPORT_GRPC_GRPC_TRANSPORT_H_
#define PSHARD_TRAINER_CLIENT_TRANSPORT_GRPC_GRPC_TRANSPORT_H_

#include <string>

#include "absl/time/time.h"
#include "common/deadline_timer.h"
#include "proto/shard.grpc.pb.h"
#include "trainer_client/transport/link/link_emulator.h"
#include "trainer_client/transport/transport.h"

namespace pshard {

class GrpcTransport final : public Transport {
 public:
  struct Spec {
    v1::ShardService::Stub* stub = nullptr;  ///< not owned
    int shard = 0;
    std::string address;
    LinkSpec link;                    ///< emulated link (default: none)
    DeadlineTimer* timer = nullptr;   ///< delivers emulated delays; not owned
    absl::Duration rpc_timeout = absl::Seconds(120);
    int64_t chunk_bytes = 1 << 20;    ///< push chunk size
  };
  explicit GrpcTransport(Spec spec);

  std::string name() const override { return "grpc"; }
  void Fetch(const FetchArgs& args, float* dest, TransferDone done) override;
  void Push(const PushArgs& args, std::shared_ptr<const std::vector<float>> grads, TransferDone done) override;

 private:
  const Spec spec_;
  EmulatedLink down_;  // server -> trainer
  EmulatedLink up_;    // trainer -> server
};

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_TRANSPORT_GRPC_GRPC_TRANSPORT_H_
