// Announce: each record is an AnnounceRequest from the caller the input's
// choices name, to shard 0 of a 2-shard job. An address announced is the
// one the status then lists for that shard (the shard's own, 0, stays).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fuzz/harness.h"
#include "fuzz/in_process_shard.h"
#include "proto/shard.pb.h"

namespace pshard::fuzz {
namespace {

void FuzzAnnounce(FuzzInput input) {
  const Caller caller = CallerFrom(input.choices());
  InProcessShard shard;
  std::vector<std::string> expected = {"shard-0.fuzz:7070", ""};
  for (std::string_view request_bytes : input.Records(8)) {
    const RawResult answer =
        shard.Call({.method = Method::kAnnounce, .requests = {std::string(request_bytes)}, .caller = caller});
    if (!answer.status.ok()) continue;
    v1::AnnounceRequest request;
    Require(request.ParseFromArray(request_bytes.data(), static_cast<int>(request_bytes.size())),
            "an announcement that does not parse was taken");
    Require(caller == Caller::kServer && request.shard_index() == 1,
            absl::StrCat("an announcement of shard ", request.shard_index(), " by caller ",
                         static_cast<int>(caller), " was taken"));
    Require(!request.advertised_address().empty(), "an announcement without an address was taken in process");
    expected[1] = request.advertised_address();
  }
  v1::StatusResponse status;
  Require(status.ParseFromString(shard.StatusOrDie()), "an unreadable status");
  Require(std::vector<std::string>(status.shard_addresses().begin(), status.shard_addresses().end()) == expected,
          absl::StrCat("the status lists shards other than announced: ", status.ShortDebugString()));
}

}  // namespace
}  // namespace pshard::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pshard::fuzz::FuzzAnnounce(pshard::fuzz::FuzzInput(data, size));
  return 0;
}
