// Join: each record is a JoinRequest, from the caller the input's choices
// name. A join answers with the job as the shard runs it (its fingerprint
// that of the job it describes), and the shard's status then lists every
// trainer that joined with a rank, with the metrics address it gave last.
#include <cstddef>
#include <cstdint>
#include <map>

#include "absl/strings/str_cat.h"
#include "fuzz/harness.h"
#include "fuzz/in_process_shard.h"
#include "proto/rpc_util.h"
#include "proto/shard.pb.h"

namespace pshard::fuzz {
namespace {

void FuzzJoin(FuzzInput input) {
  const Caller caller = CallerFrom(input.choices());
  InProcessShard shard;
  std::map<int, std::string> joined;  // rank -> metrics address
  for (std::string_view request_bytes : input.Records(8)) {
    const RawResult answer =
        shard.Call({.method = Method::kJoin, .requests = {std::string(request_bytes)}, .caller = caller});
    v1::JoinRequest request;
    const bool parsed = request.ParseFromArray(request_bytes.data(), static_cast<int>(request_bytes.size()));
    // A trainer joining in its place with nothing unusual is always let in.
    if (parsed && caller == Caller::kTrainer && request.trainer_rank() >= 0 && request.trainer_rank() < 2 &&
        request.metrics_address().size() <= 64 && request.grad_encoding() == v1::ENCODING_UNSPECIFIED) {
      Require(answer.status.ok(), absl::StrCat("a plain join refused: ", answer.status.error_message()));
    }
    if (!answer.status.ok()) continue;
    Require(parsed, "a join that does not parse was answered");
    v1::JoinResponse response;
    Require(answer.responses.size() == 1 && response.ParseFromString(answer.responses[0]), "an unreadable join answer");
    const absl::StatusOr<JobConfig> job = JobFromProto(response.job());
    Require(job.ok(), absl::StrCat("a join answered with a job that does not validate: ", job.status().message()));
    Require(JobFingerprint(*job) == response.job_fingerprint() && JobFingerprint(*job) == JobFingerprint(FuzzJob()),
            "a join answered with another job than the shard's");
    Require(response.unit_numels_size() == shard.state().num_units() && response.session_token() != 0,
            "a join answer without the units or a session");
    Require(caller == Caller::kTrainer || request.trainer_rank() < 0, "a join with a rank from a non-trainer");
    if (request.trainer_rank() >= 0) joined[request.trainer_rank()] = request.metrics_address();
  }
  v1::StatusResponse status;
  Require(status.ParseFromString(shard.StatusOrDie()), "an unreadable status");
  std::map<int, std::string> listed;
  for (const v1::JoinedTrainer& t : status.joined_trainers()) listed[t.rank()] = t.metrics_address();
  Require(listed == joined, absl::StrCat("the status lists other trainers than joined: ", status.ShortDebugString()));
}

}  // namespace
}  // namespace pshard::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pshard::fuzz::FuzzJoin(pshard::fuzz::FuzzInput(data, size));
  return 0;
}
