// A trainer that outlives its servers' faults. When a step fails for a reason
// a rejoin can cure (a server went away, restarted or rolled back; a
// connection was reset), it drops its client, whose transfers are cancelled,
// joins the servers again with backoff, letting them roll back to one step
// if they differ, and goes on at the servers' step. Steps are functions of
// the weights and of (seed, step, rank) and the servers take each
// contribution once, so the steps redone give the bits they gave before.
#ifndef PSHARD_TRAINER_CLIENT_REJOINING_TRAINER_H_
#define PSHARD_TRAINER_CLIENT_REJOINING_TRAINER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "trainer_client/shard_client.h"
#include "trainer_client/trainer.h"

namespace pshard {

class RejoiningTrainer {
 public:
  struct Options {
    /// How to join (again); roll_back_to_common_step is set for rejoins.
    ShardClient::Options client;
    TrainerOptions trainer;
    /// Rejoining gives up this long after the first failure of an outage
    /// (an outage ends with a step that succeeds). Zero: never rejoin.
    absl::Duration retry_limit = absl::Minutes(10);
    /// Lines about failures and rejoins (empty: stderr).
    std::function<void(const std::string&)> log;
    /// Polled while rejoining: true stops it (a termination signal).
    std::function<bool()> stopping;
  };
  /// Takes over a client and a trainer made from `options` (the first join
  /// is the caller's: it may need the client before the trainer exists).
  /// `data` must outlive this.
  RejoiningTrainer(Options options, const TokenDataset* data, std::unique_ptr<ShardClient> client,
                   std::unique_ptr<Trainer> trainer);

  /// The step the next Step() trains.
  int64_t next_step() const { return next_step_; }
  /// Trains next_step(). After a recoverable failure, rejoins and trains the
  /// step the servers are at instead (the report says which), as often as
  /// it takes within the retry limit. The error that ended it otherwise.
  absl::StatusOr<StepReport> Step();

  ShardClient& client() { return *client_; }
  Trainer& trainer() { return *trainer_; }
  /// Rejoins so far.
  int rejoins() const { return rejoins_; }

 private:
  /// Drops the client and joins again; the step to resume at.
  absl::StatusOr<int64_t> Rejoin(const absl::Status& failure, absl::Time give_up);
  void Log(const std::string& line) const;

  const Options options_;
  const TokenDataset* const data_;
  const uint64_t fingerprint_;
  std::unique_ptr<ShardClient> client_;
  std::unique_ptr<Trainer> trainer_;
  /// Server address -> this trainer's session there, as of the last client.
  absl::flat_hash_map<std::string, uint64_t> previous_sessions_;
  int64_t next_step_ = 0;
  int rejoins_ = 0;
};

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_REJOINING_TRAINER_H_
