// Rendezvous: each record is a RendezvousRequest, all sent at once from the
// caller the input's choices name, with a short deadline (a group that
// does not fill waits that long). A member answered gets its group's
// payloads in member order, one per member, its own among them, each one
// posted by that member of that group.
#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fuzz/harness.h"
#include "fuzz/in_process_shard.h"
#include "proto/shard.pb.h"

namespace pshard::fuzz {
namespace {

void FuzzRendezvous(FuzzInput input) {
  const Caller caller = CallerFrom(input.choices());
  InProcessShard shard;
  std::vector<RawCall> calls;
  for (std::string_view request : input.Records(8)) {
    calls.push_back({.method = Method::kRendezvous,
                     .requests = {std::string(request)},
                     .caller = caller,
                     .deadline = absl::Milliseconds(50)});
  }
  const std::vector<RawResult> answers = shard.CallTogether(calls);
  std::vector<v1::RendezvousRequest> requests(calls.size());
  // (group, size, member) -> the payloads posted as that member.
  std::map<std::tuple<std::string, int, int>, std::set<std::string>> posted;
  for (size_t i = 0; i < calls.size(); ++i) {
    if (requests[i].ParseFromString(calls[i].requests[0])) {
      posted[{requests[i].group(), requests[i].size(), requests[i].member()}].insert(requests[i].payload());
    }
  }
  for (size_t i = 0; i < answers.size(); ++i) {
    if (!answers[i].status.ok()) continue;
    Require(caller == Caller::kTrainer, "a rendezvous answered to a role other than a trainer");
    const v1::RendezvousRequest& request = requests[i];
    v1::RendezvousResponse response;
    Require(answers[i].responses.size() == 1 && response.ParseFromString(answers[i].responses[0]),
            "an unreadable rendezvous answer");
    Require(response.payloads_size() == request.size() && request.member() >= 0 &&
                request.member() < request.size() && response.payloads(request.member()) == request.payload(),
            absl::StrCat("member ", request.member(), " of ", request.size(), " got ", response.payloads_size(),
                         " payloads, not its own among them"));
    for (int m = 0; m < response.payloads_size(); ++m) {
      Require(posted[{request.group(), request.size(), m}].count(response.payloads(m)) == 1,
              absl::StrCat("group ", request.group(), ": member ", m, "'s payload was never posted"));
    }
  }
  shard.StatusOrDie();
}

}  // namespace
}  // namespace pshard::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pshard::fuzz::FuzzRendezvous(pshard::fuzz::FuzzInput(data, size));
  return 0;
}
