#include "tests/testutil/cluster_training.h"

#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "pshard/config.h"
#include "tests/testutil/tiny_job.h"
#include "trainer_client/group/host/host_group.h"
#include "trainer_client/data/default_corpus.h"
#include "trainer_client/group/group_collective.h"

namespace pshard::testing {

const TokenDataset& TestCorpus() {
  static const TokenDataset* data = new TokenDataset(TokenDataset::FromText(DefaultCorpus()));
  return *data;
}

std::vector<std::string> EnabledTransports() {
  std::vector<std::string> transports = {"grpc"};
  if (PSHARD_WITH_UCX) transports.push_back("ucx");
  return transports;
}

absl::Status TrainInThreads(const LocalCluster& cluster, int num_trainers, const TokenDataset& data,
                            const ClusterTraining& how) {
  std::vector<std::vector<std::unique_ptr<GroupCollective>>> groups;
  if (how.group_size > 1) {
    for (int g = 0; g < num_trainers / how.group_size; ++g) groups.push_back(CreateHostGroup(how.group_size));
  }
  std::vector<absl::Status> results(num_trainers);
  if (how.reports != nullptr) how.reports->assign(num_trainers, {});
  auto train = [&](int r) -> absl::Status {
    absl::StatusOr<std::unique_ptr<ShardClient>> client = cluster.Connect(r, how.encoding, how.transport, how.error_feedback);
    if (!client.ok()) return client.status();
    for (int s = 0; s < cluster.num_shards(); ++s) {
      if ((*client)->transport_name(s) != how.transport) {
        return absl::InternalError(absl::StrCat("shard ", s, " uses ", (*client)->transport_name(s), ", not ",
                                                how.transport));
      }
    }
    TrainerOptions options = how.trainer;
    if (how.group_size > 1) options.group = groups[r / how.group_size][r % how.group_size].get();
    absl::StatusOr<std::unique_ptr<Trainer>> trainer = absl::InternalError("no trainer");
    if (how.model) {
      absl::StatusOr<std::unique_ptr<UnitModel>> model =
          how.model((*client)->layout().spec, Trainer::ModelOptions(**client, options));
      if (!model.ok()) return model.status();
      trainer = Trainer::Create(client->get(), &data, options, *std::move(model));
    } else {
      trainer = Trainer::Create(client->get(), &data, options);
    }
    if (!trainer.ok()) return trainer.status();
    for (int64_t step = how.first_step; step < how.steps; ++step) {
      absl::StatusOr<StepReport> report = (*trainer)->RunStep(step);
      if (!report.ok()) return report.status();
      if (how.reports != nullptr) (*how.reports)[r].push_back(*report);
    }
    return absl::OkStatus();
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < num_trainers; ++r) threads.emplace_back([&, r] { results[r] = train(r); });
  for (auto& t : threads) t.join();
  for (int r = 0; r < num_trainers; ++r) {
    if (!results[r].ok()) {
      return absl::Status(results[r].code(), absl::StrCat("trainer ", r, ": ", results[r].message()));
    }
  }
  return absl::OkStatus();
}

absl::Status TrainTinySteps(const LocalCluster& cluster, int trainers, int64_t first, int64_t until) {
  ClusterTraining how;
  how.trainer = TinyTrainerOptions(7);
  how.first_step = first;
  how.steps = until;
  return TrainInThreads(cluster, trainers, TestCorpus(), how);
}

}  // namespace pshard::testing
