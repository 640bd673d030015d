// `pshard sweep`: runs a grid of `pshard local` jobs, one after the other,
// each for a few steps after warm-up, and writes what each measured beside
// what the planner predicts (OUT/results.json, OUT/results.csv); figures
// with --plot. A sweep started again with the same OUT skips the points
// results.json already has.
#ifndef PSHARD_TOOLS_SWEEP_H_
#define PSHARD_TOOLS_SWEEP_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "lab/plan.h"
#include "lab/sweep.h"

namespace pshard {

struct SweepSpec {
  std::vector<SweepAxis> axes;
  std::string out_dir;
  std::string pshard_bin;  ///< the pshard executable that runs `local`
  int skip_steps = 3;      ///< warm-up steps of each point, not measured
  int measure_steps = 5;   ///< steps measured after them
  /// > 0: each point then trains this many steps again, links unshaped
  /// (emulated links change no number), evaluating on the point's
  /// --val_data after the last: PointMeasurement::val_loss.
  int loss_steps = 0;
  /// A point still running after this is stopped, and the sweep with it.
  absl::Duration point_timeout = absl::Minutes(30);
  /// Find the MFU and the step overhead the planner assumes from an
  /// unshaped run of the first point (its compute time, and the rest of its
  /// step), instead of `given`'s.
  bool calibrate = true;
  Calibration given;  ///< device FLOP/s always; MFU and overhead without calibrate
  /// The plan of a point's flags with a calibration.
  std::function<absl::StatusOr<Plan>(const SweepPoint&, const Calibration&)> plan;
  bool plot = false;
  std::string plot_script;  ///< tools/plot_sweep.py as built next to pshard
};

/// Runs the grid (see above); returns an error naming the point that
/// failed, or Cancelled on SIGINT/SIGTERM (the running point is stopped;
/// finished points stay in the results).
absl::Status RunSweep(const SweepSpec& spec);

/// Draws OUT's figures from a results.csv with matplotlib (Debian's
/// python3-matplotlib at /usr/bin/python3); returns the PNG paths.
absl::StatusOr<std::vector<std::string>> PlotSweep(const std::string& plot_script, const std::string& csv,
                                                   const std::string& out_dir);

}  // namespace pshard

#endif  // PSHARD_TOOLS_SWEEP_H_
