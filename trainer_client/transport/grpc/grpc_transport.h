// The gRPC data path: chunked server-streaming fetches and client-streaming
// pushes. Their chunks travel as
// raw frames (proto/chunk_frame.h) over the channel's generic stub, so the
// data bytes are moved once on each side.
#ifndef PSHARD_TRAINER_CLIENT_TRANSPORT_GRPC_GRPC_TRANSPORT_H_
#define PSHARD_TRAINER_CLIENT_TRANSPORT_GRPC_GRPC_TRANSPORT_H_

#include <memory>
#include <string>

#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "proto/shard.grpc.pb.h"
#include "trainer_client/transport/transport.h"

namespace pshard {

class GrpcTransport final : public Transport {
 public:
  struct Spec {
    std::shared_ptr<grpc::Channel> channel;  ///< to the shard server
    int shard = 0;
    std::string address;
    absl::Duration rpc_timeout = absl::Seconds(120);
    int64_t chunk_bytes = 1 << 20;    ///< push chunk size
  };
  explicit GrpcTransport(Spec spec);

  std::string name() const override { return "grpc"; }
  void Fetch(const FetchArgs& args, float* dest, TransferDone done) override;
  void Push(const PushArgs& args, std::shared_ptr<const std::vector<float>> grads, TransferDone done) override;

 private:
  const Spec spec_;
  grpc::GenericStub generic_;
};

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_TRANSPORT_GRPC_GRPC_TRANSPORT_H_
