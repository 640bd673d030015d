#include "common/levers.h"

#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace pshard {

absl::StatusOr<ReshardAfterForward> ParseReshardAfterForward(std::string_view value) {
  if (value == "true") return ReshardAfterForward{true, 0};
  if (value == "false") return ReshardAfterForward{false, 0};
  int group = 0;
  if (absl::SimpleAtoi(std::string(value), &group)) {
    if (group >= 2) return ReshardAfterForward{true, group};
    return absl::InvalidArgumentError(absl::StrCat(
        "--reshard_after_forward=", group,
        ": an integer is the fabric group to reshard to, of 2 or more trainers (false keeps whole units)"));
  }
  return absl::InvalidArgumentError(absl::StrCat("--reshard_after_forward=", std::string(value),
                                                 ": expected true, false or a fabric group size"));
}

absl::Status CheckStage(int stage) {
  if (stage >= 1 && stage <= 3) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "--stage=", stage, ": ZeRO stages are 1, 2 and 3 (1 and 2 coincide in pshard: gradients always go to their "
      "owners)"));
}

absl::StatusOr<bool> ParseErrorFeedback(std::string_view value, WireEncoding grads) {
  if (value == "auto") return IsQuantized(grads);
  if (value == "false") return false;
  if (value == "true") {
    if (IsQuantized(grads)) return true;
    return absl::InvalidArgumentError(absl::StrCat(
        "--error_feedback=true: gradients travel as ", std::string(WireEncodingName(grads)),
        ", which leaves no quantization residual to feed back (int8 and int4 do: --grad_encoding)"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--error_feedback=", std::string(value), ": expected auto, true or false"));
}

}  // namespace pshard
