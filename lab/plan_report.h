// A plan as `pshard plan` prints it: a table for people, JSON for tools.
#ifndef PSHARD_LAB_PLAN_REPORT_H_
#define PSHARD_LAB_PLAN_REPORT_H_

#include <string>

#include "common/json.h"
#include "lab/plan.h"

namespace pshard {

/// The plan as text tables: memory (with data parallelism and ZeRO's stages
/// on N devices beside it, in GB of 10^9 bytes), bytes per step on each
/// link, the predicted step and the levers ranked at the given link.
std::string FormatPlan(const Plan& plan);

/// The same figures as a JSON object; bytes in bytes, times in seconds.
JsonValue PlanToJson(const Plan& plan);

}  // namespace pshard

#endif  // PSHARD_LAB_PLAN_REPORT_H_
