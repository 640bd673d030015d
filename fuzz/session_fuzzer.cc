// A session: calls of any rpc one after another to one shard, so that
// one call's effect meets the next (joins, pushes that close a step and
// checkpoint it, fetches of the new version, a rollback, rejoins). Each
// record is one call: its first byte names the rpc (in proto order,
// modulo their number), its second is a choices byte as the rpc's own
// harness reads it (the caller; for a push, the piece size), the rest is
// the request; a push's rest is its frames as records (FuzzInput).
// Fetches and pushes are checked as in their own harnesses, every closed
// step serves its new version, and the shard answers at the end.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/harness.h"
#include "fuzz/in_process_shard.h"
#include "fuzz/service_checks.h"

namespace pshard::fuzz {
namespace {

void FuzzSession(FuzzInput input) {
  InProcessShard shard;
  for (std::string_view record : input.Records(16)) {
    if (record.size() < 2) continue;
    const Method method = static_cast<Method>(static_cast<uint8_t>(record[0]) % kNumMethods);
    const uint8_t choices = static_cast<uint8_t>(record[1]);
    const Caller caller = CallerFrom(choices);
    const std::string_view request = record.substr(2);
    if (method == Method::kPush) {
      FuzzInput frames(record.substr(1));
      for (const RawCall& push : PushCalls(frames, caller, PieceBytesFrom(choices), 1)) {
        const std::string pending = PendingContributions(shard.state());
        CheckPushAnswer(shard.state(), pending, shard.Call(push));
      }
      const int64_t step = shard.state().current_step();
      if (shard.CloseStepIfComplete()) {
        CheckClosedStep(shard, step + 1);
        shard.SaveCheckpoint();
      }
      continue;
    }
    RawCall call{.method = method, .requests = {std::string(request)}, .caller = caller};
    if (method == Method::kRendezvous || method == Method::kAgreeNorm) call.deadline = absl::Milliseconds(50);
    const RawResult answer = shard.Call(call);
    if (method == Method::kFetch) CheckFetchAnswer(shard.state(), request, answer);
  }
  shard.StatusOrDie();
}

}  // namespace
}  // namespace pshard::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pshard::fuzz::FuzzSession(pshard::fuzz::FuzzInput(data, size));
  return 0;
}
