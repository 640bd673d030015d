// A running shard server: a handle over the gRPC server, the state and the
// step driver.
#ifndef PSHARD_SHARD_SERVER_SERVER_H_
#define PSHARD_SHARD_SERVER_SERVER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/job_config.h"
#include "common/metrics/metrics.h"
#include "common/security/security.h"
#include "shard_server/shard_state.h"
#include "shard_server/connection_caps.h"

namespace pshard {

class ShardServer {
 public:
  struct Spec {
    JobConfig job;
    int shard_index = 0;
    std::string address = "127.0.0.1:0";  ///< port 0 picks a free port
    /// Address of shard 0 (the norm coordinator); empty on shard 0 itself.
    std::string coordinator_address;
    /// host:port at which others reach this server, announced to shard 0
    /// so that tools given one server find the others; empty: the address
    /// shard 0 sees this server's calls come from, with its port.
    std::string advertise_address;
    absl::Duration fetch_wait_limit = absl::Seconds(120);
    /// Fetches held unanswered, per connection and in all (docs/security.md).
    ConnectionCaps::Limits waiting_fetch_limits{.per_connection = 256, .total = 4096};
    /// Bytes of pushes not yet complete, per connection and in all; zero:
    /// twice the shard's fp32 gradient plus 16 MiB a connection, and that
    /// for each trainer and two more in all.
    ConnectionCaps::Limits push_byte_limits;
    /// Open connections, per peer host and in all (docs/security.md): one
    /// past them is closed unanswered, before its TLS handshake.
    ConnectionCaps::Limits connection_limits{.per_connection = 256, .total = 1024};
    /// A connection that has not finished its TLS handshake and sent its
    /// HTTP/2 settings by then is closed.
    absl::Duration handshake_timeout = absl::Seconds(10);
    absl::Duration step_timeout = absl::Seconds(60);
    int max_message_bytes = 4 << 20;  ///< larger requests are refused
    int64_t fetch_chunk_bytes = 1 << 20;  ///< bytes per streamed fetch chunk
    /// host:port of the Prometheus /metrics endpoint (port 0: any); empty: none.
    std::string metrics_address;
    /// Serve fetches and pushes over UCX too (when this build has UCX); if
    /// UCX fails to start, the server warns and serves gRPC only.
    bool enable_ucx = true;
    /// Folder of this shard's checkpoints; empty: none are written or read.
    /// At start the newest one there (or `resume_step`'s) is restored.
    std::string checkpoint_dir;
    /// Write a checkpoint every this many steps (0: only at shutdown).
    int64_t checkpoint_every = 0;
    /// Checkpoints kept per shard (older ones are removed).
    int checkpoint_keep = 2;
    /// A checkpoint that cannot be written (a full disk, the folder deleted
    /// while the job ran) stops the server (failure() says why) unless
    /// this is set: then it is logged, counted, and training goes on.
    bool continue_on_checkpoint_failure = false;
    /// Restore exactly this step's checkpoint (-1: the newest, if any).
    int64_t resume_step = -1;
    /// Start from step 0 even when the folder holds checkpoints: those this
    /// shard would read or overwrite, and those of other shard counts, are
    /// moved into a subfolder first (nothing is deleted). Without it, a
    /// folder of another layout is refused.
    bool start_fresh = false;
    /// Resume from a checkpoint whose job ended its learning-rate schedule
    /// at another step than `job.optimizer.total_steps` (the schedule is
    /// re-stretched to the new end; without it such a resume is refused).
    bool allow_schedule_change = false;
    /// A safetensors file whose values start the job, in place of the
    /// layout's initialisation rules (fine-tuning, or a layout's "given"
    /// tensors); it must hold exactly the layout's tensors. Its fingerprint
    /// joins the job's, so every server of a job must start from the same
    /// weights. A checkpoint to resume from still wins. Empty: none.
    std::string init_from;
    /// TLS and token settings: how this server serves, which callers it
    /// accepts (common/security), and how it calls shard 0 (as a server).
    SecurityOptions security;
  };

  /// Builds the state, binds, and starts serving and stepping.
  static absl::StatusOr<std::unique_ptr<ShardServer>> Start(Spec spec);
  ~ShardServer();

  int port() const { return port_; }
  std::string address() const;
  ShardState& state() { return *state_; }
  metrics::Registry& registry() { return registry_; }
  /// The UCX worker address trainers are told at Join; empty without UCX.
  std::string ucx_address() const;
  /// Port of the /metrics endpoint, 0 when there is none.
  int metrics_port() const;
  /// Writes the state at the current step to the checkpoint folder (a no-op
  /// without one, or when that step is on disk already). Call between
  /// steps: the step driver does after each `checkpoint_every` steps.
  void SaveCheckpoint();
  /// Blocks until Shutdown() is called from another thread.
  void Wait();
  /// OK, or why this server must stop: a checkpoint it could not write
  /// (unless Spec::continue_on_checkpoint_failure).
  absl::Status failure() const;
  /// The checkpoint restored at start ("" when the state was initialised).
  const std::string& restored_from() const { return restored_from_; }
  /// What starting did with the checkpoint folder that a user should know
  /// (checkpoints set aside, a schedule re-stretched), one line each.
  const std::vector<std::string>& start_notes() const { return start_notes_; }
  /// Goes back to this shard's checkpoint of `step` (asked by trainer
  /// `rank` after another shard restarted there): the step driver stops,
  /// the state is replaced, fetches waiting for later versions end with
  /// Aborted, and stepping resumes at `step`. Returns the step the shard is
  /// at; at `step` already, does nothing. FailedPrecondition, changing
  /// nothing, when `step` is ahead or its checkpoint is not on disk.
  /// Only for a restart: one of `restarted` (addresses) must be a shard of
  /// this job that started from its checkpoint of `step` and is still at
  /// it (GetStatus), else FailedPrecondition, changing nothing; so a
  /// rollback happens once per restart, and never when nothing restarted.
  absl::StatusOr<int64_t> RollBack(int64_t step, int rank, const std::vector<std::string>& restarted);
  /// The newest step whose checkpoint every shard of the job is known to
  /// hold (-1: none known); retention keeps it and the common step before it.
  int64_t common_checkpoint_step() const;
  /// Stops serving: in-flight calls are cancelled after `grace`; with a
  /// checkpoint folder, the state is written there unless it already is.
  void Shutdown(absl::Duration grace = absl::Seconds(1));

 private:
  struct Impl;
  ShardServer() = default;
  metrics::Registry registry_;  // before impl_: the metrics in it outlive their users
  std::unique_ptr<ShardState> state_;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
  std::string restored_from_;
  std::vector<std::string> start_notes_;
  std::string host_;
};

}  // namespace pshard

#endif  // PSHARD_SHARD_SERVER_SERVER_H_
