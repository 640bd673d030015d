// A shard server of a tiny job served in process, for the request-handler
// harnesses: the real ShardState, NormCoordinator and ShardServiceImpl
// behind a gRPC server with no listening port, reached through its
// in-process channel with raw request bytes, as a client on the network
// could send them. A fresh one per input keeps every input reproducible.
// What ShardServer adds around them is left out (the step driver, the
// checkpoint writer): the harnesses close steps and write checkpoints
// themselves, and RollBack restores the checkpoints they wrote.
#ifndef PSHARD_FUZZ_IN_PROCESS_SHARD_H_
#define PSHARD_FUZZ_IN_PROCESS_SHARD_H_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/job_config.h"
#include "grpcpp/grpcpp.h"
#include "shard_server/server_metrics.h"
#include "shard_server/session_tokens.h"
#include "shard_server/shard_state.h"

namespace pshard::fuzz {

/// Whose credentials a call carries: the server checks tokens by role.
enum class Caller { kTrainer, kServer, kReader, kNoToken, kWrongToken };
/// The caller that the low bits of an input's choices byte name.
Caller CallerFrom(uint8_t choices);

/// The rpcs of proto/shard.proto.
enum class Method { kJoin, kFetch, kPush, kAgreeNorm, kGetStatus, kAnnounce, kReadMaster, kRendezvous, kRollBack };
inline constexpr int kNumMethods = 9;
/// "/pshard.v1.ShardService/Join" and so on.
std::string MethodPath(Method method);

/// One call: its request messages as they go on the wire (a unary call
/// sends one), each cut into slices of `piece_bytes` (0: one slice) so
/// that the server sees a message across several slices, as it does from
/// the network.
struct RawCall {
  Method method = Method::kGetStatus;
  std::vector<std::string> requests;
  Caller caller = Caller::kTrainer;
  size_t piece_bytes = 0;
  /// Far beyond what a call takes, even on a loaded machine (the harnesses
  /// require answers), and below libFuzzer's 10 s for a hang.
  absl::Duration deadline = absl::Seconds(5);
};

/// What came back: the status and the response messages' bytes.
struct RawResult {
  grpc::Status status;
  std::vector<std::string> responses;
};

/// The job the harnesses serve: 2 layers of width 16 (4 units), 2 shards,
/// 2 trainers, small slice alignment so that slices cut tensors.
JobConfig FuzzJob();

/// Waits that a fuzzer's call may start are bounded by these, far below
/// a call's deadline: a fetch of a future version, a norm round, a
/// rendezvous.
inline constexpr absl::Duration kServerWaitLimit = absl::Milliseconds(20);

class InProcessShard {
 public:
  /// Shard 0 of FuzzJob(), the norm coordinator. Every caller must carry a
  /// token of a role (CallerAuthenticator).
  InProcessShard();
  ~InProcessShard();
  InProcessShard(const InProcessShard&) = delete;
  InProcessShard& operator=(const InProcessShard&) = delete;

  ShardState& state() { return *state_; }
  /// The sessions Join hands out (the UCX harness issues its own).
  SessionTokens& tokens();
  /// The metrics the shard counts in (shared by every input's shard).
  ServerMetrics& metrics();

  /// Makes one call and waits for its end.
  RawResult Call(const RawCall& call);
  /// Starts every call at once and waits for all of them; results in the
  /// calls' order. Calls that wait in the server (rendezvous, norm rounds)
  /// meet each other this way.
  std::vector<RawResult> CallTogether(const std::vector<RawCall>& calls);

  /// Closes the current step when every contribution is in, as the step
  /// driver would (this shard's norm stands for the job's: the other
  /// shard's gradient counts as zero). False when it still waits.
  bool CloseStepIfComplete();

  /// Writes the shard's checkpoint of its current step, which RollBack can
  /// then go back to (as a server with --checkpoint_every=1 keeps them).
  void SaveCheckpoint();

  /// GetStatus as a reader; stops the process if the server does not answer.
  std::string StatusOrDie();

 private:
  struct Parts;
  /// The RollBack RPC's work, as ShardServer::RollBack does it without a
  /// step driver to stop: this shard's checkpoint of `step`, restored.
  absl::StatusOr<int64_t> RollBack(int64_t step, int rank);

  std::unique_ptr<ShardState> state_;
  std::unique_ptr<Parts> parts_;
  std::string checkpoint_dir_;  // empty until SaveCheckpoint
};

}  // namespace pshard::fuzz

#endif  // PSHARD_FUZZ_IN_PROCESS_SHARD_H_
