// Push: the records are PushChunk frames, an empty record ending one push
// and starting the next (FuzzInput, PushCalls), from the caller the
// input's choices name, each frame cut into pieces of the size the
// choices name (the server reads a frame across slices). Pushes run one
// after another; a refused one changes nothing the step waits for. When
// the pushes complete the step (every unit from both trainers), it closes
// as the step driver would, and the shard then serves the new version,
// whose weights are finite whatever the gradients held.
#include <cstddef>
#include <cstdint>

#include "fuzz/harness.h"
#include "fuzz/in_process_shard.h"
#include "fuzz/service_checks.h"

namespace pshard::fuzz {
namespace {

void FuzzPush(FuzzInput input) {
  const Caller caller = CallerFrom(input.choices());
  InProcessShard shard;
  for (const RawCall& push : PushCalls(input, caller, PieceBytesFrom(input.choices()), 16)) {
    const std::string pending = PendingContributions(shard.state());
    CheckPushAnswer(shard.state(), pending, shard.Call(push));
  }
  if (shard.CloseStepIfComplete()) CheckClosedStep(shard, 1);
  shard.StatusOrDie();
}

}  // namespace
}  // namespace pshard::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pshard::fuzz::FuzzPush(pshard::fuzz::FuzzInput(data, size));
  return 0;
}
