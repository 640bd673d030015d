// Fetch: each record is a FetchRequest, from the caller the input's
// choices name (the server parses it from its raw frame). A served fetch
// streams the whole slice asked for, in order, with its checksum; in fp32
// the master weights themselves. A fetch of a version still to come waits
// (briefly: kServerWaitLimit) and is refused, one too far ahead or gone at
// once; afterwards the shard still answers.
#include <cstddef>
#include <cstdint>

#include "fuzz/harness.h"
#include "fuzz/in_process_shard.h"
#include "fuzz/service_checks.h"

namespace pshard::fuzz {
namespace {

void FuzzFetch(FuzzInput input) {
  const Caller caller = CallerFrom(input.choices());
  InProcessShard shard;
  for (std::string_view request : input.Records(8)) {
    const RawResult answer =
        shard.Call({.method = Method::kFetch, .requests = {std::string(request)}, .caller = caller});
    CheckFetchAnswer(shard.state(), request, answer);
  }
  shard.StatusOrDie();
}

}  // namespace
}  // namespace pshard::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pshard::fuzz::FuzzFetch(pshard::fuzz::FuzzInput(data, size));
  return 0;
}
