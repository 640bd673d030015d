// RollBack: the shard first closes 0 to 3 steps (the choices' bits 3-4)
// from both trainers' gradients, writing its checkpoint after each as a
// server with --checkpoint_every=1 does; then each record is a
// RollBackRequest from the caller the choices name. A rollback
// answered puts the shard at the step it names, every unit at that
// step's checkpointed weights; the trainer who asked is served at once,
// the other is refused (Aborted) until it joins again. Anything refused
// leaves the shard where it was.
#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fuzz/harness.h"
#include "fuzz/in_process_shard.h"
#include "fuzz/service_checks.h"
#include "proto/shard.pb.h"

namespace pshard::fuzz {
namespace {

// Every unit's master weights, by unit.
std::vector<std::vector<float>> Weights(ShardState& state) {
  std::vector<std::vector<float>> weights;
  for (int u = 0; u < state.num_units(); ++u) weights.push_back(state.ReadMaster(u).second);
  return weights;
}

// Both trainers' gradients of the current step, straight into the state
// (pushes are the push harness's), then the step closed.
void TrainOneStep(InProcessShard& shard) {
  ShardState& state = shard.state();
  const int64_t step = state.current_step();
  for (int trainer = 0; trainer < 2; ++trainer) {
    for (int u = 0; u < state.num_units(); ++u) {
      std::vector<float> gradient(static_cast<size_t>(state.slice_length(u)), 0.01f * static_cast<float>(trainer + 1));
      const ContributionId id{.trainer = trainer, .step = step, .unit = u};
      Require(state.Contribute(id, std::move(gradient)).ok(), "a seed gradient was refused");
    }
  }
  Require(shard.CloseStepIfComplete(), "the step did not close");
}

// Fetches unit 0 at the shard's step as `trainer`.
RawResult FetchAs(InProcessShard& shard, int trainer) {
  v1::FetchRequest request;
  request.set_version(shard.state().current_step());
  request.set_encoding(v1::ENCODING_FP32);
  request.set_trainer_rank(trainer);
  return shard.Call({.method = Method::kFetch, .requests = {request.SerializeAsString()}});
}

void FuzzRollBack(FuzzInput input) {
  const Caller caller = CallerFrom(input.choices());
  InProcessShard shard;
  ShardState& state = shard.state();
  std::map<int64_t, std::vector<std::vector<float>>> saved;  // step -> weights checkpointed
  for (int s = 0; s < ((input.choices() >> 3) & 3); ++s) {
    TrainOneStep(shard);
    shard.SaveCheckpoint();
    saved[state.current_step()] = Weights(state);
  }
  for (std::string_view request_bytes : input.Records(8)) {
    const int64_t before = state.current_step();
    const RawResult answer =
        shard.Call({.method = Method::kRollBack, .requests = {std::string(request_bytes)}, .caller = caller});
    if (!answer.status.ok()) {
      Require(state.current_step() == before, "a refused rollback moved the shard");
      continue;
    }
    v1::RollBackRequest request;
    Require(request.ParseFromArray(request_bytes.data(), static_cast<int>(request_bytes.size())),
            "a rollback that does not parse was done");
    Require(caller == Caller::kTrainer, "a rollback done for a role other than a trainer");
    v1::RollBackResponse response;
    Require(answer.responses.size() == 1 && response.ParseFromString(answer.responses[0]),
            "an unreadable rollback answer");
    Require(response.current_step() == request.step() && state.current_step() == request.step(),
            absl::StrCat("a rollback to step ", request.step(), " left the shard at ", state.current_step(),
                         " and answered ", response.current_step()));
    if (request.step() == before) continue;  // nothing to do
    Require(saved.count(request.step()) == 1 && Weights(state) == saved[request.step()],
            absl::StrCat("after a rollback to step ", request.step(), " the weights are not its checkpoint's"));
    const int asked = request.trainer_rank();
    for (int trainer = 0; trainer < 2; ++trainer) {
      const RawResult fetched = FetchAs(shard, trainer);
      Require(fetched.status.ok() == (trainer == asked),
              absl::StrCat("after a rollback asked by trainer ", asked, ", trainer ", trainer, "'s fetch: ",
                           fetched.status.ok() ? "served" : fetched.status.error_message()));
    }
  }
  shard.StatusOrDie();
}

}  // namespace
}  // namespace pshard::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pshard::fuzz::FuzzRollBack(pshard::fuzz::FuzzInput(data, size));
  return 0;
}
