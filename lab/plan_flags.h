// The planner's input as command lines give it: the flags of `pshard local`
// that shape a job (model, counts, levers, the emulated link) and the
// planner's own (a parameter count, the fabric, the device). `pshard plan`
// and `pshard sweep` read their values out of the one flag registry, so a
// sweep point's prediction sees exactly the flags its run gets.
#ifndef PSHARD_LAB_PLAN_FLAGS_H_
#define PSHARD_LAB_PLAN_FLAGS_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lab/plan.h"

namespace pshard {

/// Flag values by name (without dashes).
using FlagValues = std::map<std::string, std::string>;

/// The names PlanInputFromFlags reads; each must be present.
const std::vector<std::string>& PlanFlagNames();

/// A parameter count: digits with an optional exponent ("7.5e9") or a
/// suffix K, M, B (or G), T ("7.5B", "125M").
absl::StatusOr<int64_t> ParseParameterCount(const std::string& text);

/// The input the flags describe. --params (when not empty) replaces the
/// GPT by --layers equal layers of that many parameters in all;
/// --device_flops=auto measures this machine's SGEMM rate. Errors name
/// the flag.
absl::StatusOr<PlanInput> PlanInputFromFlags(const FlagValues& flags);

}  // namespace pshard

#endif  // PSHARD_LAB_PLAN_FLAGS_H_
