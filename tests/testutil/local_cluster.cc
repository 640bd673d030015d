#include "tests/testutil/local_cluster.h"

#include "common/status_macros.h"

namespace pshard::testing {

absl::StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::Start(const JobConfig& job, Options options) {
  auto cluster = std::make_unique<LocalCluster>();
  cluster->client_security_ = options.client_security;
  for (int s = 0; s < job.num_shards; ++s) {
    ShardServer::Spec spec;
    spec.job = job;
    spec.shard_index = s;
    spec.address = "127.0.0.1:0";
    if (s > 0) spec.coordinator_address = cluster->servers_[0]->address();
    spec.fetch_wait_limit = options.fetch_wait_limit;
    spec.step_timeout = options.step_timeout;
    spec.max_message_bytes = options.max_message_bytes;
    spec.fetch_chunk_bytes = options.fetch_chunk_bytes;
    spec.metrics_address = options.metrics_address;
    spec.checkpoint_dir = options.checkpoint_dir;
    spec.checkpoint_every = options.checkpoint_every;
    spec.resume_step = options.resume_step;
    spec.checkpoint_keep = options.checkpoint_keep;
    spec.continue_on_checkpoint_failure = options.continue_on_checkpoint_failure;
    spec.start_fresh = options.start_fresh;
    spec.allow_schedule_change = options.allow_schedule_change;
    spec.init_from = options.init_from;
    spec.security = options.security;
    ASSIGN_OR_RETURN(std::unique_ptr<ShardServer> server, ShardServer::Start(spec));
    cluster->servers_.push_back(std::move(server));
  }
  return cluster;
}

std::vector<std::string> LocalCluster::addresses() const {
  std::vector<std::string> out;
  for (const auto& s : servers_) out.push_back(s->address());
  return out;
}

absl::StatusOr<std::unique_ptr<ShardClient>> LocalCluster::Connect(int rank, WireEncodings encodings,
                                                                   const std::string& transport,
                                                                   bool error_feedback) const {
  ShardClient::Options options;
  options.server_addresses = addresses();
  options.trainer_rank = rank;
  options.encodings = encodings;
  options.error_feedback = error_feedback;
  options.join_timeout = absl::Seconds(10);
  options.rpc_timeout = absl::Seconds(60);
  options.transport = transport;
  const Role role = rank >= 0 ? Role::kTrainer : Role::kReader;
  ASSIGN_OR_RETURN(options.security, ClientSecurity::Create(client_security_[static_cast<int>(role)], role));
  return ShardClient::Connect(options);
}

absl::StatusOr<std::vector<std::vector<float>>> LocalCluster::ReadMasterWeights(
    std::optional<int64_t> version) const {
  ASSIGN_OR_RETURN(std::unique_ptr<ShardClient> client, Connect(-1, WireEncoding::kFp32));
  std::vector<std::vector<float>> out;
  for (size_t u = 0; u < client->layout().spec.units.size(); ++u) {
    ASSIGN_OR_RETURN(std::vector<float> unit, client->ReadMasterUnit(static_cast<int>(u), version));
    out.push_back(std::move(unit));
  }
  return out;
}

}  // namespace pshard::testing
