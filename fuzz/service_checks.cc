#include "fuzz/service_checks.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "proto/rpc_util.h"
#include "proto/shard.pb.h"

namespace pshard::fuzz {

void CheckFetchAnswer(ShardState& state, std::string_view request_bytes, const RawResult& answer) {
  v1::FetchRequest request;
  const bool parsed = request.ParseFromArray(request_bytes.data(), static_cast<int>(request_bytes.size()));
  if (!answer.status.ok()) {
    Require(parsed || answer.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT ||
                answer.status.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
                answer.status.error_code() == grpc::StatusCode::PERMISSION_DENIED,
            absl::StrCat("a fetch that does not parse was refused with ", answer.status.error_message()));
    return;
  }
  Require(parsed, "a fetch that does not parse was served");
  const absl::StatusOr<WireFormat> format = WeightFormatFromProto(request.encoding(), request.quant_block());
  Require(format.ok(), "a fetch in an encoding weights do not travel in was served");
  Require(request.unit() >= 0 && request.unit() < state.num_units(), "a fetch of an unknown unit was served");
  const size_t length = static_cast<size_t>(state.slice_length(request.unit()));
  std::string bytes;
  uint32_t checksum = 0;
  size_t elements = 0;
  for (size_t i = 0; i < answer.responses.size(); ++i) {
    v1::FetchChunk chunk;
    Require(chunk.ParseFromString(answer.responses[i]), "a fetch chunk that does not parse");
    if (i == 0) {
      Require(chunk.slice_length() == static_cast<int64_t>(length) && chunk.version() == request.version(),
              absl::StrCat("the first chunk of unit ", request.unit(), " says ", chunk.slice_length(),
                           " elements at version ", chunk.version(), "; asked for version ", request.version(),
                           " of a slice of ", length));
      checksum = chunk.checksum();
    }
    Require(chunk.offset() == static_cast<int64_t>(elements),
            absl::StrCat("chunk ", i, " starts at element ", chunk.offset(), " after ", elements));
    const std::optional<size_t> count = format->ElementsIn(chunk.data().size(), length - elements);
    Require(count.has_value() && *count > 0,
            absl::StrCat("chunk ", i, " carries ", chunk.data().size(), " bytes of ", format->ToString()));
    elements += *count;
    bytes += chunk.data();
  }
  Require(elements == length, absl::StrCat("a served fetch ended after ", elements, " of ", length, " elements"));
  Require(bytes.size() == format->EncodedBytes(length), "a served slice of the wrong size");
  Require(Crc32c(bytes.data(), bytes.size()) == checksum, "a served slice does not match its checksum");
  if (format->encoding() == WireEncoding::kFp32) {
    const auto [version, master] = state.ReadMaster(request.unit());
    if (version == request.version()) {
      Require(std::memcmp(bytes.data(), master.data(), bytes.size()) == 0,
              "an fp32 fetch differs from the master weights");
    }
  }
}

std::string PendingContributions(ShardState& state) {
  std::string wait = state.DescribeWait();
  return wait.substr(0, wait.rfind(" for "));  // without the time waited so far
}

void CheckPushAnswer(ShardState& state, const std::string& pending_before, const RawResult& answer) {
  if (answer.status.ok()) {
    v1::PushResponse response;
    Require(answer.responses.size() == 1 && response.ParseFromString(answer.responses[0]) &&
                response.disposition() != v1::PushResponse::DISPOSITION_UNSPECIFIED,
            "an accepted push without a disposition");
    return;
  }
  Require(PendingContributions(state) == pending_before,
          absl::StrCat("a refused push (", answer.status.error_message(), ") changed the step: it waited for \"",
                       pending_before, "\", now for \"", PendingContributions(state), "\""));
}

size_t PieceBytesFrom(uint8_t choices) {
  static constexpr size_t kPieceBytes[4] = {0, 1, 5, 64};
  return kPieceBytes[choices >> 6];
}

std::vector<RawCall> PushCalls(FuzzInput& input, Caller caller, size_t piece_bytes, size_t max_pushes) {
  std::vector<RawCall> pushes;
  RawCall push{.method = Method::kPush, .caller = caller, .piece_bytes = piece_bytes};
  while (!input.done() && pushes.size() < max_pushes) {
    const std::string_view frame = input.NextRecord();
    if (!frame.empty()) {
      push.requests.emplace_back(frame);
      if (!input.done()) continue;
    }
    pushes.push_back(push);
    push.requests.clear();
  }
  return pushes;
}

void CheckClosedStep(InProcessShard& shard, int64_t step) {
  ShardState& state = shard.state();
  Require(state.current_step() == step,
          absl::StrCat("a closed step left the shard at step ", state.current_step(), ", not ", step));
  for (int unit = 0; unit < state.num_units(); ++unit) {
    v1::FetchRequest request;
    request.set_unit(unit);
    request.set_version(step);
    request.set_encoding(v1::ENCODING_FP32);
    request.set_trainer_rank(0);
    const std::string bytes = request.SerializeAsString();
    const RawResult answer = shard.Call(RawCall{.method = Method::kFetch, .requests = {bytes}});
    Require(answer.status.ok(),
            absl::StrCat("unit ", unit, " version ", step, " is not served: ", answer.status.error_message()));
    CheckFetchAnswer(state, bytes, answer);
    for (float w : state.ReadMaster(unit).second) {
      Require(std::isfinite(w), absl::StrCat("unit ", unit, " holds a non-finite weight after the step"));
    }
  }
}

}  // namespace pshard::fuzz
