// `pshard local`: a whole job on this machine — N shard server processes and
// M trainer processes on loopback — started in order, watched, and shut
// down cleanly at the end, on failure, or on Ctrl-C.
#ifndef PSHARD_TOOLS_LOCAL_CLUSTER_H_
#define PSHARD_TOOLS_LOCAL_CLUSTER_H_

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace pshard {

struct LocalClusterSpec {
  int num_servers = 4;
  int num_trainers = 2;
  std::string bin_dir;  ///< holds pshard-server and pshard-trainer
  std::string run_dir;  ///< logs, port files and the emulated nodes' link buckets (links/)
  /// Metrics ports: server s on base + s, trainer r on base + 100 + r; 0:
  /// any free ports. A Prometheus config for them goes to run_dir.
  int metrics_port_base = 0;
  /// Flags passed to every server (model, optimizer, counts are added).
  std::vector<std::string> server_flags;
  /// Flags passed to every trainer (servers and rank are added).
  std::vector<std::string> trainer_flags;
  /// Flags for the trainers that evaluate on held-out data (rank 0, or
  /// every member of rank 0's fabric group: a group evaluates together).
  std::vector<std::string> evaluator_flags;
  /// Trainers in fabric groups of this many consecutive ranks (1: none):
  /// a topology file saying so goes to run_dir and to every trainer.
  int fabric_group_size = 1;
  /// A topology file (servers named shard:K) given to every trainer in
  /// place of the one written for fabric groups or pairs; its groups are
  /// `fabric_group_size`'s.
  std::string topology_file;
  /// Trainer R shares a node with server R (LocalTopology): its own
  /// server's slice does not cross the network, and the node's interface
  /// carries both processes' traffic. Not with fabric groups.
  bool paired = false;
  /// The trainers emulate slow links (trainer_flags has --link_rate or
  /// --link_delay, or the topology links of their own): their nodes' buckets go to run_dir/links, shared by
  /// every trainer (--link_dir).
  bool emulated_links = false;
  /// "kernel": each trainer runs in its own network namespace behind a veth
  /// pair that tc tbf shapes to `kernel_rate` (tools/kernel_links.h);
  /// trainers then reach the servers over gRPC on those links. "" or
  /// "emulated": loopback (with whatever emulation trainer_flags ask for).
  std::string link_mode;
  std::string kernel_rate;
  /// Mutual TLS: a CA and per-role certificates are made in run_dir/tls
  /// (bin_dir/pshard-make-certs.sh); servers, trainers and their calls to
  /// each other use them.
  bool tls = false;
  /// Shared tokens: a token file of random tokens, one per role, is written
  /// to run_dir/tokens (mode 0600) and given to every process.
  bool tokens = false;
  /// A trainer that dies (killed by a signal) is started again, at most this
  /// many times per rank; one that exits with an error ends the job.
  int trainer_restarts = 3;
  /// A server that dies (killed by a signal) is started again on its port,
  /// at most this many times per shard: it restores its newest checkpoint
  /// and the trainers, rejoining, roll the job back to it. Exact only with
  /// checkpoints (--checkpoint_dir); without, its trainers give up.
  int server_restarts = 3;
  /// The step the trainers train to (--steps) and the end of the
  /// learning-rate schedule: the console's note on a resumed job says them.
  int64_t steps = 0;
  int64_t schedule_steps = 0;
  /// The servers' checkpoint folder (server_flags name it too; empty:
  /// none): a job that ends without every shard's checkpoint of its last
  /// step there has not ended cleanly.
  std::string checkpoint_dir;
};

/// A topology file with every server and every trainer on its own node
/// ("server-S", "trainer-R", the nodes the link emulation shapes) or, with
/// `paired`, trainer R on node "node-R" with server R (the nodes past the
/// shorter list hold one process each), and fabric groups of `group_size`
/// consecutive ranks.
std::string LocalTopology(const std::vector<std::string>& server_addresses, int num_trainers, int group_size,
                          bool paired = false);

/// A Prometheus scrape config for the given /metrics endpoints (jobs
/// pshard-server and pshard-trainer, 1 s scrape interval).
std::string LocalPrometheusConfig(const std::vector<std::string>& server_targets,
                                  const std::vector<std::string>& trainer_targets);

/// Runs the job to completion. Every server and trainer writes to its log
/// in run_dir (serverS.log, trainerR.log), and every trainer a JSON line per
/// step to trainerR.steps.jsonl (--step_log); trainer 0's log is also copied
/// to this process's output as it grows. Returns an error
/// naming the process that failed (with the tail of its log).
absl::Status RunLocalCluster(const LocalClusterSpec& spec);

}  // namespace pshard

#endif  // PSHARD_TOOLS_LOCAL_CLUSTER_H_
