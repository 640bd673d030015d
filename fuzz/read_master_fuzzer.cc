// ReadMaster: each record is a ReadMasterRequest from the caller the
// input's choices name. A page served is the master weights' own bytes
// from the offset asked for, at most a page (and max_elements) long,
// clamped to the slice, with the slice's length and version.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "fuzz/harness.h"
#include "fuzz/in_process_shard.h"
#include "proto/shard.pb.h"

namespace pshard::fuzz {
namespace {

// Elements per page: one fetch chunk (InProcessShard's 1024 bytes) of fp32.
constexpr int64_t kPageElements = 1024 / 4;

void FuzzReadMaster(FuzzInput input) {
  const Caller caller = CallerFrom(input.choices());
  InProcessShard shard;
  ShardState& state = shard.state();
  for (std::string_view request_bytes : input.Records(8)) {
    const RawResult answer =
        shard.Call({.method = Method::kReadMaster, .requests = {std::string(request_bytes)}, .caller = caller});
    if (!answer.status.ok()) continue;
    v1::ReadMasterRequest request;
    Require(request.ParseFromArray(request_bytes.data(), static_cast<int>(request_bytes.size())),
            "a page request that does not parse was served");
    Require(caller == Caller::kTrainer || caller == Caller::kReader, "a page served to a role that may not read");
    v1::ReadMasterResponse page;
    Require(answer.responses.size() == 1 && page.ParseFromString(answer.responses[0]), "an unreadable page");
    Require(request.unit() >= 0 && request.unit() < state.num_units(), "a page of an unknown unit");
    const int64_t length = state.slice_length(request.unit());
    const int64_t limit = request.max_elements() == 0 ? kPageElements : std::min(kPageElements, request.max_elements());
    const int64_t count = std::min(limit, length - request.offset());
    Require(request.offset() >= 0 && count >= 0 && page.offset() == request.offset() && page.slice_length() == length &&
                page.version() == 0 && page.data().size() == static_cast<size_t>(count) * sizeof(float),
            absl::StrCat("page of ", request.ShortDebugString(), ": ", page.offset(), " +", page.data().size(),
                         " bytes of ", page.slice_length()));
    const std::vector<float> master = state.ReadMaster(request.unit()).second;
    Require(std::memcmp(page.data().data(), master.data() + request.offset(), page.data().size()) == 0,
            "a page differs from the master weights");
  }
  shard.StatusOrDie();
}

}  // namespace
}  // namespace pshard::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pshard::fuzz::FuzzReadMaster(pshard::fuzz::FuzzInput(data, size));
  return 0;
}
