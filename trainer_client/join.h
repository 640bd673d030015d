// Joining the shard servers of a job at start. Servers may still be
// starting (their names not yet in DNS, their ports not yet open), so a join
// retries each server until the join deadline, saying every few seconds
// which servers it still waits for and why; what cannot get better (a
// server of another job, a refusal) ends the join at once, and so does a
// name that still does not resolve after a grace period.
#ifndef PSHARD_TRAINER_CLIENT_JOIN_H_
#define PSHARD_TRAINER_CLIENT_JOIN_H_

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/support/status.h"
#include "common/wire_encoding.h"
#include "proto/shard.grpc.pb.h"

namespace pshard {

struct JoinSpec {
  /// One stub per server (not owned), and the address it was made for.
  std::vector<v1::ShardService::Stub*> stubs;
  std::vector<std::string> addresses;
  int trainer_rank = 0;
  std::string metrics_address;
  /// How the trainer pushes gradients (unset: a tool that does not push).
  std::optional<WireFormat> grad_format;
  /// Per address, the session token its server gave this trainer at its
  /// last join (0 or missing: none); the server retires it.
  std::vector<uint64_t> previous_tokens;
  /// The whole join gives up after this.
  absl::Duration timeout = absl::Seconds(60);
  /// A server name that has not resolved for this long is an error (a
  /// name that does not resolve is not a server that is still starting).
  absl::Duration resolve_grace = absl::Minutes(1);
  /// Period of the progress lines while some server has not answered.
  absl::Duration log_every = absl::Seconds(5);
  /// Checks each server's answer as it arrives (same job, shard in range);
  /// an error ends the join with it. May be empty.
  std::function<absl::Status(size_t server, const v1::JoinResponse&)> accept;
  /// Receives the progress lines; empty: they go to stderr.
  std::function<void(const std::string&)> log;
};

/// Joins every server of `spec` and returns their answers in the order of
/// `spec.addresses`. Not thread-safe with respect to `spec`'s callbacks.
absl::StatusOr<std::vector<v1::JoinResponse>> JoinServers(const JoinSpec& spec);

/// Why a Join that failed with `status` has not reached its server, in
/// words a user acts on: "no such name", "connection refused", "TLS
/// handshake failed", "not answering", or the transport's own message.
struct JoinFailure {
  std::string reason;
  bool name_unresolved = false;  ///< the server's name does not resolve
  bool transient = true;         ///< the server may still come up
  /// False when the status says nothing about the server (gRPC gave up an
  /// attempt of its own): an earlier reason stands.
  bool informative = true;
};
JoinFailure ClassifyJoinFailure(const grpc::Status& status);

/// Channel arguments for a trainer's channels to its servers: reconnect and
/// re-resolve within seconds (servers and their DNS names come up late),
/// and receive messages of up to `max_receive_bytes`.
grpc::ChannelArguments ServerChannelArguments(int max_receive_bytes);

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_JOIN_H_
