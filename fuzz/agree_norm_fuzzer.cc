// AgreeNorm: each record is a NormReport, all sent at once from the caller
// the input's choices name to shard 0, the coordinator of a 2-shard job.
// A round completes once both shards reported its step (briefly waited
// for: kServerWaitLimit); every report answered for a step gets the same
// agreement, for that step, with the common checkpoint steps ascending.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fuzz/harness.h"
#include "fuzz/in_process_shard.h"
#include "proto/shard.pb.h"

namespace pshard::fuzz {
namespace {

void FuzzAgreeNorm(FuzzInput input) {
  const Caller caller = CallerFrom(input.choices());
  InProcessShard shard;
  std::vector<RawCall> calls;
  for (std::string_view report : input.Records(8)) {
    calls.push_back({.method = Method::kAgreeNorm, .requests = {std::string(report)}, .caller = caller});
  }
  const std::vector<RawResult> answers = shard.CallTogether(calls);
  std::map<int64_t, std::string> agreed;  // step -> the agreement, serialised
  for (size_t i = 0; i < answers.size(); ++i) {
    if (!answers[i].status.ok()) continue;
    v1::NormReport report;
    Require(report.ParseFromString(calls[i].requests[0]), "a norm report that does not parse was answered");
    Require(caller == Caller::kServer, "a norm report from another role than a server was answered");
    v1::NormAgreement agreement;
    Require(answers[i].responses.size() == 1 && agreement.ParseFromString(answers[i].responses[0]),
            "an unreadable agreement");
    Require(agreement.step() == report.step(),
            absl::StrCat("a report for step ", report.step(), " got the agreement of step ", agreement.step()));
    Require(std::is_sorted(agreement.common_checkpoint_steps().begin(), agreement.common_checkpoint_steps().end()),
            "common checkpoint steps out of order");
    const std::string bytes = agreement.SerializeAsString();
    const auto [it, first] = agreed.emplace(report.step(), bytes);
    Require(first || it->second == bytes, absl::StrCat("two agreements for step ", report.step()));
  }
  shard.StatusOrDie();
}

}  // namespace
}  // namespace pshard::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pshard::fuzz::FuzzAgreeNorm(pshard::fuzz::FuzzInput(data, size));
  return 0;
}
