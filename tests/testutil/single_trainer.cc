#include "tests/testutil/single_trainer.h"

#include <algorithm>
#include <utility>

#include "common/status_macros.h"
#include "tests/testutil/local_cluster.h"
#include "tests/testutil/reference_training.h"
#include "tests/testutil/tiny_job.h"

namespace pshard::testing {

absl::StatusOr<SingleTrainerRun> TrainSingleTrainer(const JobConfig& job, const TrainerOptions& options, int steps,
                                                    const ModelMaker& make_model) {
  ASSIGN_OR_RETURN(std::unique_ptr<LocalCluster> cluster, LocalCluster::Start(job));
  ASSIGN_OR_RETURN(std::unique_ptr<ShardClient> client, cluster->Connect(0, WireEncoding::kFp32));
  std::unique_ptr<Trainer> trainer;
  if (make_model) {
    ASSIGN_OR_RETURN(std::unique_ptr<UnitModel> model, make_model(*client, options));
    ASSIGN_OR_RETURN(trainer, Trainer::Create(client.get(), &TestCorpus(), options, std::move(model)));
  } else {
    ASSIGN_OR_RETURN(trainer, Trainer::Create(client.get(), &TestCorpus(), options));
  }
  SingleTrainerRun run;
  run.memory = trainer->model().Memory();
  run.lanes = trainer->model().lanes();
  run.device_name = trainer->model().DeviceName();
  for (const UnitSpec& unit : client->layout().spec.units) run.largest_unit = std::max(run.largest_unit, unit.numel);
  for (int64_t step = 0; step < steps; ++step) {
    ASSIGN_OR_RETURN(StepReport report, trainer->RunStep(step));
    run.losses.push_back(report.loss);
    run.reports.push_back(std::move(report));
  }
  ASSIGN_OR_RETURN(run.final_weights, cluster->ReadMasterWeights(steps));
  return run;
}

bool SameTraining(const SingleTrainerRun& a, const SingleTrainerRun& b) {
  return a.losses == b.losses && BitIdentical(a.final_weights, b.final_weights);
}

}  // namespace pshard::testing
