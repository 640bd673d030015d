// The slow-link levers' settings as the command lines give them.
#ifndef PSHARD_COMMON_LEVERS_H_
#define PSHARD_COMMON_LEVERS_H_

#include <string_view>

#include "absl/status/statusor.h"
#include "common/wire_encoding.h"

namespace pshard {

/// What `--reshard_after_forward` says happens to a unit's weights between
/// its forward and its backward.
struct ReshardAfterForward {
  bool reshard = true;  ///< false: the whole unit is kept
  /// > 0 (with reshard): each member of the fabric group of this size keeps
  /// the 1/G of the unit it fetched, and backward all-gathers the unit
  /// within the group instead of fetching it again (the secondary shard).
  int group = 0;
};

/// The value of `--reshard_after_forward`: "true" (drop each unit after its
/// forward, fetch it again for backward), "false" (keep every unit from
/// forward to backward) or an integer G >= 2 (FSDP's resharding to a
/// smaller group: the secondary shard within a fabric group of G).
absl::StatusOr<ReshardAfterForward> ParseReshardAfterForward(std::string_view value);

/// The value of `--stage`: 3 (the default: weights fetched pass by pass),
/// 2 (a resident replica on each trainer, fetched once per step) or 1
/// (the same as 2 in pshard, where gradients always go to their owners).
absl::Status CheckStage(int stage);

/// The value of `--error_feedback` for gradients pushed as `grads`: "auto"
/// (on for int8 and int4, which leave a quantization residual), "true"
/// (refused for fp32 and bf16: there is no residual to feed back) or "false".
absl::StatusOr<bool> ParseErrorFeedback(std::string_view value, WireEncoding grads);

}  // namespace pshard

#endif  // PSHARD_COMMON_LEVERS_H_
