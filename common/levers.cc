#include "common/levers.h"

#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace pshard {

absl::StatusOr<bool> ParseReshardAfterForward(std::string_view value) {
  if (value == "true") return true;
  if (value == "false") return false;
  int group = 0;
  if (absl::SimpleAtoi(std::string(value), &group)) {
    return absl::UnimplementedError(absl::StrCat(
        "--reshard_after_forward=", group,
        ": resharding to a fabric group (the secondary shard) is not implemented yet; use true or false"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--reshard_after_forward=", std::string(value), ": expected true or false"));
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
