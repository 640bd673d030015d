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

}  // namespace pshard
