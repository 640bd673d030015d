// Topology and route planning: which transport each trainer uses to reach
// each shard server. A topology file names the nodes (with their shard
// servers and trainer ranks), the fabric groups, and the kind of link
// between nodes; at start a trainer turns it into a route plan.
//
// Topology file (JSON):
//   {"nodes": [{"name": "a", "servers": ["10.0.0.1:7000"], "trainers": [0, 1]}, ...],
//    "fabric_groups": [[0, 1]],
//    "links": [{"between": ["a", "b"], "kind": "ethernet", "transport": "grpc",
//               "rate": "10gbit", "delay": "1ms"}]}
// kinds: ethernet, rdma, infiniband, nvlink; transport (optional): grpc,
// ucx or auto; rate and delay (optional, tc units and durations): the link
// that trainers emulate between the two nodes, in place of --link_rate and
// --link_delay. A server may be named "shard:K", the K-th of the job's
// --servers (0-based): such a file does not depend on the servers'
// addresses, so `pshard local`, `pshard plan` and `pshard sweep` take it
// too (they take only such names). Without a file: UCX to every server where this build has it
// (UCX itself picks shared memory on the same host, tcp or RDMA elsewhere),
// else gRPC.
#ifndef PSHARD_TRAINER_CLIENT_ROUTE_PLAN_H_
#define PSHARD_TRAINER_CLIENT_ROUTE_PLAN_H_

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace pshard {

struct Topology {
  struct Node {
    std::string name;
    std::vector<std::string> servers;  ///< host:port of the shard servers on this node
    std::vector<int> trainers;         ///< trainer ranks on this node
  };
  struct Link {
    std::string a, b;       ///< node names
    std::string kind;       ///< ethernet, rdma, infiniband, nvlink
    std::string transport;  ///< "", "auto", "grpc" or "ucx"
    std::string rate;       ///< emulated rate ("" when not given)
    std::string delay;      ///< emulated one-way delay ("" when not given)
  };
  std::vector<Node> nodes;
  std::vector<std::vector<int>> fabric_groups;
  std::vector<Link> links;

  /// Parses and validates (unique names, each server and trainer on one
  /// node, groups of known trainers, links between known nodes).
  static absl::StatusOr<Topology> Parse(std::string_view json);
  static absl::StatusOr<Topology> Load(const std::string& path);

  /// The file's JSON; `shaping` false leaves out the links' rates and
  /// delays (a sweep's unshaped calibration run).
  std::string ToJson(bool shaping = true) const;
  /// Replaces every "shard:K" by server_addresses[K]; an error names a K
  /// out of range, or a server then on two nodes.
  absl::Status ResolveShards(const std::vector<std::string>& server_addresses);
  /// Checks a file for a job of `servers` shard servers and `trainers`
  /// trainers that does not know their addresses (`pshard local`, `plan`):
  /// every server named "shard:K", every shard and every trainer rank of
  /// the job on exactly one node, no other ranks.
  absl::Status CheckForJob(int servers, int trainers) const;
  /// The size G of the fabric groups when they are consecutive runs of G
  /// ranks covering all `trainers` (1 when there are none); an error when
  /// they are anything else (what `pshard local` and the planner model).
  absl::StatusOr<int> UniformGroupSize(int trainers) const;
  /// The node holding server "shard:K" or address `server`, and trainer
  /// `rank`; -1 when none does.
  int NodeOfServer(const std::string& server) const;
  int NodeOfTrainer(int rank) const;
};

struct Route {
  std::string address;    ///< the shard server
  std::string transport;  ///< grpc or ucx
  std::string reason;     ///< why, in words
};

struct RoutePlan {
  int rank = 0;
  std::string node;               ///< empty without a topology
  std::vector<Route> routes;      ///< one per server address, in the order given
  std::vector<int> fabric_group;  ///< ranks of this trainer's group; empty: none
  /// Transport per server address, for ShardClient::Options.
  std::map<std::string, std::string> TransportByAddress() const;
  std::string ToString() const;
};

/// The plan for trainer `rank` reaching `server_addresses`. `topology` may
/// be null (defaults). `ucx_built`: whether this build has the UCX transport.
absl::StatusOr<RoutePlan> PlanRoutes(const Topology* topology, int rank,
                                     const std::vector<std::string>& server_addresses, bool ucx_built);

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_ROUTE_PLAN_H_
