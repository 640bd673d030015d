// The sweep's data: a grid of `pshard local` flag values, what each point
// measured (from its trainers' step logs) beside what the planner predicted,
// and the results files (results.json, from which an interrupted sweep
// resumes, and results.csv).
#ifndef PSHARD_LAB_SWEEP_H_
#define PSHARD_LAB_SWEEP_H_

#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/json.h"
#include "lab/plan.h"

namespace pshard {

/// One flag and the values it takes across the grid.
struct SweepAxis {
  std::string flag;  ///< without dashes
  std::vector<std::string> values;
};

/// The grid's flags from `args` ("--name=v1,v2,..."): every argument names
/// a flag for which `is_flag` is true, and none is in `reserved` (flags the
/// sweep sets itself, with why). Errors name the argument: an unknown flag,
/// a reserved one, one given twice, one without values.
absl::StatusOr<std::vector<SweepAxis>> ParseGrid(
    const std::vector<std::string>& args, const std::function<bool(const std::string&)>& is_flag,
    const std::vector<std::pair<std::string, std::string>>& reserved);

/// One point of the grid: a value for every axis, in axis order.
struct SweepPoint {
  std::vector<std::pair<std::string, std::string>> flags;
  /// "link_rate=100mbit prefetch=2": identifies the point in results.
  std::string Key() const;
  /// "--link_rate=100mbit", ...
  std::vector<std::string> Args() const;
};

/// Every combination, the first axis varying slowest.
std::vector<SweepPoint> GridPoints(const std::vector<SweepAxis>& axes);

/// Means over the measured steps (and over the trainers).
struct PointMeasurement {
  int steps = 0;  ///< steps measured per trainer
  double step_seconds = 0;
  double compute_seconds = 0;
  double exposed_seconds = 0;
  double comm_seconds = 0;  ///< some transfer in flight
  double fetched_bytes = 0;  ///< payload, per trainer and step
  double pushed_bytes = 0;
  double tokens_per_second = 0;  ///< the job's
  double loss = 0;  ///< the training loss of the measured steps (a few steps in: levers hardly differ)
  /// Trainer 0's loss on held-out text after `pshard sweep --loss_steps`
  /// steps of the point's job; NaN when not measured.
  double val_loss = std::numeric_limits<double>::quiet_NaN();
};

/// Reads the step logs (`--step_log`, one per trainer) and averages the
/// steps at or after `first_step`. Error when a log is missing, malformed,
/// or has no such step.
absl::StatusOr<PointMeasurement> MeasureStepLogs(const std::vector<std::string>& paths, int64_t first_step);

/// A finished point.
struct SweepResult {
  SweepPoint point;
  PointMeasurement measured;
  StepTime predicted;
  StepBytes predicted_bytes;
  double link_bytes_per_second = 0;  ///< the point's slow-link rate (0: unlimited)
  /// The slow-link rate above which the planner sees this job compute-bound.
  double knee_bytes_per_second = 0;
};

/// What the planner is told about the device for every point.
struct Calibration {
  double device_flops = 0;
  double mfu = 0;
  double step_overhead = 0;  ///< seconds (PlanInput::step_overhead)
  std::string how;           ///< how they were found, in words
};

/// results.json: the calibration used and every result.
struct SweepResults {
  Calibration calibration;
  std::vector<SweepResult> results;
  const SweepResult* Find(const std::string& key) const;
};
JsonValue SweepResultsToJson(const SweepResults& results);
absl::StatusOr<SweepResults> SweepResultsFromJson(const JsonValue& json);

/// results.csv: one row per result; the points' flags as columns (in the
/// order they first appear), then the measured and predicted figures (see
/// docs/slow-links.md for the columns).
std::string SweepResultsToCsv(const SweepResults& results);

}  // namespace pshard

#endif  // PSHARD_LAB_SWEEP_H_
