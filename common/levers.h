// The slow-link levers' settings as the command lines give them.
#ifndef PSHARD_COMMON_LEVERS_H_
#define PSHARD_COMMON_LEVERS_H_

#include <string_view>

#include "absl/status/statusor.h"
#include "common/wire_encoding.h"

namespace pshard {

/// The value of `--reshard_after_forward`: "true" (drop each unit after its
/// forward, fetch it again for backward) or "false" (keep every unit from
/// forward to backward). An integer G (FSDP's resharding to a smaller group:
/// a secondary shard within a fabric group of G) is refused as not
/// implemented yet; anything else as not a value of the flag.
absl::StatusOr<bool> ParseReshardAfterForward(std::string_view value);

/// The value of `--error_feedback` for gradients pushed as `grads`: "auto"
/// (on for int8 and int4, which leave a quantization residual), "true"
/// (refused for fp32 and bf16: there is no residual to feed back) or "false".
absl::StatusOr<bool> ParseErrorFeedback(std::string_view value, WireEncoding grads);

}  // namespace pshard

#endif  // PSHARD_COMMON_LEVERS_H_
