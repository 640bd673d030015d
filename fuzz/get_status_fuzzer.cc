// GetStatus: each record is a StatusRequest (an empty message: any bytes
// that parse at all are one) from the caller the input's choices name.
// Every role may read the status, nobody else; the answer describes shard
// 0 of the job at step 0, with the coordinator's list of shards.
#include <cstddef>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "fuzz/harness.h"
#include "fuzz/in_process_shard.h"
#include "proto/shard.pb.h"

namespace pshard::fuzz {
namespace {

void FuzzGetStatus(FuzzInput input) {
  const Caller caller = CallerFrom(input.choices());
  const bool has_role = caller == Caller::kTrainer || caller == Caller::kServer || caller == Caller::kReader;
  InProcessShard shard;
  for (std::string_view request : input.Records(8)) {
    const RawResult answer =
        shard.Call({.method = Method::kGetStatus, .requests = {std::string(request)}, .caller = caller});
    v1::StatusRequest parsed;
    const bool well_formed = parsed.ParseFromArray(request.data(), static_cast<int>(request.size()));
    Require(answer.status.ok() == (has_role && well_formed),
            absl::StrCat("GetStatus from caller ", static_cast<int>(caller), well_formed ? "" : " (malformed)",
                         " answered \"", answer.status.error_message(), "\""));
    if (!answer.status.ok()) continue;
    v1::StatusResponse status;
    Require(answer.responses.size() == 1 && status.ParseFromString(answer.responses[0]), "an unreadable status");
    Require(status.shard_index() == 0 && status.current_step() == 0 && status.shard_addresses_size() == 2 &&
                status.joined_trainers_size() == 0,
            absl::StrCat("a fresh shard's status: ", status.ShortDebugString()));
  }
}

}  // namespace
}  // namespace pshard::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pshard::fuzz::FuzzGetStatus(pshard::fuzz::FuzzInput(data, size));
  return 0;
}
