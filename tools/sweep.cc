#include "tools/sweep.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/signals.h"
#include "common/status_macros.h"
#include "tools/process.h"
#include "trainer_client/route_plan.h"

namespace pshard {
namespace {

std::atomic<int> g_stop{0};

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string LastLines(const std::string& path, size_t n) {
  std::vector<std::string> lines = absl::StrSplit(ReadAll(path), '\n');
  const size_t first = lines.size() > n ? lines.size() - n : 0;
  std::string out;
  for (size_t i = first; i < lines.size(); ++i) absl::StrAppend(&out, lines[i], "\n");
  return out;
}

absl::Status WriteAtomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    if (!out.flush()) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  }
  std::error_code error;
  std::filesystem::rename(tmp, path, error);
  if (error) return absl::InternalError(absl::StrCat("cannot rename ", tmp, " to ", path, ": ", error.message()));
  return absl::OkStatus();
}

std::string Clock(absl::Duration d) {
  const int64_t s = absl::ToInt64Seconds(d);
  return s >= 3600 ? absl::StrFormat("%dh%02dm", s / 3600, s / 60 % 60) : absl::StrFormat("%dm%02ds", s / 60, s % 60);
}

std::string Bar(size_t done, size_t total) {
  const size_t width = 20, filled = total == 0 ? width : done * width / total;
  return absl::StrCat("[", std::string(filled, '#'), std::string(width - filled, '.'), "]");
}

// The point's flags with no slow link, emulated or kernel's, and its
// topology's links without their rates and delays (a copy in the results
// folder): the calibration run.
absl::StatusOr<SweepPoint> Unshaped(const SweepSpec& spec, const SweepPoint& p) {
  static const std::set<std::string> kLinkFlags = {"link_rate", "link_delay", "link_jitter", "link_mode"};
  SweepPoint q;
  for (const auto& [flag, value] : p.flags) {
    if (kLinkFlags.count(flag)) continue;
    if (flag == "topology" && !value.empty()) {
      ASSIGN_OR_RETURN(const Topology topology, Topology::Load(value));
      const std::string copy = spec.out_dir + "/topology-unshaped.json";
      RETURN_IF_ERROR(WriteAtomically(copy, topology.ToJson(/*shaping=*/false)));
      q.flags.emplace_back(flag, copy);
      continue;
    }
    q.flags.emplace_back(flag, value);
  }
  for (const char* f : {"link_rate", "link_delay", "link_jitter"}) q.flags.emplace_back(f, "");
  q.flags.emplace_back("link_mode", "emulated");
  return q;
}

// Runs `pshard local` with the point's flags and `extra` in `run_dir`
// (output in run_dir/launcher.log) to its end; its exit code. Stopped, and
// an error, at --point_timeout or on SIGINT/SIGTERM.
absl::StatusOr<int> RunLocal(const SweepSpec& spec, const SweepPoint& point, const std::vector<std::string>& extra,
                             const std::string& run_dir) {
  std::error_code error;
  std::filesystem::create_directories(run_dir, error);
  if (error) return absl::InternalError(absl::StrCat("cannot create ", run_dir, ": ", error.message()));
  const std::string log = run_dir + "/launcher.log";
  std::remove(log.c_str());
  std::vector<std::string> argv = {spec.pshard_bin, "local"};
  for (std::string& a : point.Args()) argv.push_back(std::move(a));
  argv.insert(argv.end(), extra.begin(), extra.end());
  for (std::string a : {std::string("--log_every=0"), std::string("--metrics_port_base=0"),
                        absl::StrCat("--run_dir=", run_dir)}) {
    argv.push_back(std::move(a));
  }
  ASSIGN_OR_RETURN(ChildProcess child, ChildProcess::Spawn(argv, log));
  const absl::Time deadline = absl::Now() + spec.point_timeout;
  std::optional<int> code;
  while (!(code = child.WaitUntil(absl::Now() + absl::Milliseconds(200)))) {
    const bool late = absl::Now() > deadline;
    if (g_stop != 0 || late) {
      child.Signal(SIGINT);  // pshard local stops its servers and trainers
      child.WaitUntil(absl::Now() + absl::Seconds(30));
      if (late) {
        return absl::DeadlineExceededError(absl::StrCat("pshard local ", point.Key(), " ran past --point_timeout=",
                                                        absl::FormatDuration(spec.point_timeout), " (", log,
                                                        "):\n", LastLines(log, 8)));
      }
      return absl::CancelledError(absl::StrCat("interrupted while running ", point.Key()));
    }
  }
  return *code;
}

// Trainer 0's held-out loss after spec.loss_steps steps of the point's job,
// run unshaped in `run_dir`.
absl::StatusOr<double> HeldOutLoss(const SweepSpec& spec, const SweepPoint& point, const std::string& run_dir) {
  const std::vector<std::string> extra = {absl::StrCat("--steps=", spec.loss_steps),
                                          absl::StrCat("--eval_every=", spec.loss_steps)};
  ASSIGN_OR_RETURN(const SweepPoint unshaped, Unshaped(spec, point));
  ASSIGN_OR_RETURN(const int code, RunLocal(spec, unshaped, extra, run_dir));
  const std::string log = run_dir + "/launcher.log";
  if (code != 0) {
    return absl::InternalError(absl::StrCat("pshard local ", point.Key(), " (the held-out loss run) exited with code ",
                                            code, " (", log, "):\n", LastLines(log, 8)));
  }
  std::ifstream in(run_dir + "/trainer0.log");
  const std::string marker = absl::StrCat("eval after step ", spec.loss_steps, " | val loss ");
  for (std::string line; std::getline(in, line);) {
    const size_t at = line.find(marker);
    double loss = 0;
    if (at != std::string::npos &&
        absl::SimpleAtod(line.substr(at + marker.size(), line.find(' ', at + marker.size()) - at - marker.size()),
                         &loss)) {
      return loss;
    }
  }
  return absl::InternalError(absl::StrCat("the held-out loss run of ", point.Key(), " printed no \"", marker,
                                          "\" (", run_dir, "/trainer0.log)"));
}

// Runs one point's job in `run_dir` and measures it.
absl::StatusOr<PointMeasurement> RunPoint(const SweepSpec& spec, const SweepPoint& point, int trainers,
                                          const std::string& run_dir, bool with_loss = true) {
  // Timed without evaluating: --val_data is for the held-out loss run.
  SweepPoint timed;
  for (const auto& flag : point.flags) {
    if (flag.first != "val_data") timed.flags.push_back(flag);
  }
  ASSIGN_OR_RETURN(const int code,
                   RunLocal(spec, timed, {absl::StrCat("--steps=", spec.skip_steps + spec.measure_steps)}, run_dir));
  if (code != 0) {
    const std::string log = run_dir + "/launcher.log";
    return absl::InternalError(absl::StrCat("pshard local ", point.Key(), " exited with code ", code, " (", log,
                                            "):\n", LastLines(log, 8)));
  }
  std::vector<std::string> logs;
  for (int r = 0; r < trainers; ++r) logs.push_back(absl::StrCat(run_dir, "/trainer", r, ".steps.jsonl"));
  ASSIGN_OR_RETURN(PointMeasurement m, MeasureStepLogs(logs, spec.skip_steps));
  if (with_loss && spec.loss_steps > 0) {
    ASSIGN_OR_RETURN(m.val_loss, HeldOutLoss(spec, point, run_dir + "/loss"));
  }
  return m;
}

SweepResult ResultOf(const SweepPoint& point, const PointMeasurement& measured, const Plan& plan) {
  SweepResult r;
  r.point = point;
  r.measured = measured;
  r.predicted = plan.time;
  r.predicted_bytes = plan.bytes;
  r.link_bytes_per_second = plan.input.slow.bytes_per_second;
  r.knee_bytes_per_second = plan.knee.rate_bytes_per_second;
  return r;
}

absl::Status WriteResults(const SweepSpec& spec, const SweepResults& results) {
  RETURN_IF_ERROR(WriteAtomically(spec.out_dir + "/results.json", FormatJson(SweepResultsToJson(results))));
  return WriteAtomically(spec.out_dir + "/results.csv", SweepResultsToCsv(results));
}

}  // namespace

absl::Status RunSweep(const SweepSpec& spec) {
  if (spec.skip_steps < 0 || spec.measure_steps < 1) {
    return absl::InvalidArgumentError("a point needs --skip_steps >= 0 and --measure_steps >= 1");
  }
  const std::vector<SweepPoint> points = GridPoints(spec.axes);
  // Every point's flags are checked (by planning it) before anything runs.
  std::vector<Plan> plans;
  for (const SweepPoint& p : points) {
    absl::StatusOr<Plan> plan = spec.plan(p, spec.given);
    if (!plan.ok()) return absl::InvalidArgumentError(absl::StrCat(p.Key(), ": ", plan.status().message()));
    plans.push_back(std::move(*plan));
  }
  std::error_code error;
  std::filesystem::create_directories(spec.out_dir + "/points", error);
  if (error) return absl::InvalidArgumentError(absl::StrCat("cannot create ", spec.out_dir, ": ", error.message()));
  CallOnTerminationSignal([](int signo) { g_stop = signo; });

  SweepResults results;
  const std::string json_path = spec.out_dir + "/results.json";
  if (std::filesystem::exists(json_path)) {
    absl::StatusOr<JsonValue> json = ParseJson(ReadAll(json_path));
    if (!json.ok()) return absl::DataLossError(absl::StrCat(json_path, ": ", json.status().message()));
    ASSIGN_OR_RETURN(results, SweepResultsFromJson(*json));
    const Calibration& c = results.calibration;
    std::fprintf(stderr,
                 "pshard sweep: resuming: %zu points in %s already; device %.4g GFLOP/s, MFU %.3f, step overhead "
                 "%.1f ms (%s)\n",
                 results.results.size(), json_path.c_str(), c.device_flops / 1e9, c.mfu, c.step_overhead * 1e3,
                 c.how.c_str());
  } else {
    Calibration& c = results.calibration;
    c = spec.given;
    c.how = "MFU and step overhead as given (--mfu, --step_overhead)";
    if (spec.calibrate) {
      // The first point without link emulation: what the device achieves,
      // and what of the step the event model does not see.
      ASSIGN_OR_RETURN(const SweepPoint unshaped, Unshaped(spec, points[0]));
      std::fprintf(stderr, "pshard sweep: calibrating the device on an unshaped run of %s\n", points[0].Key().c_str());
      ASSIGN_OR_RETURN(const Plan at_peak, spec.plan(unshaped, Calibration{c.device_flops, 1.0, 0.0, ""}));
      ASSIGN_OR_RETURN(const PointMeasurement measured,
                       RunPoint(spec, unshaped, at_peak.input.trainers, spec.out_dir + "/points/calibration",
                                              /*with_loss=*/false));
      if (!(measured.compute_seconds > 0) || !(at_peak.time.compute > 0)) {
        return absl::InternalError("the calibration run measured no compute time");
      }
      c.mfu = std::min(1.0, at_peak.time.compute / measured.compute_seconds);
      ASSIGN_OR_RETURN(const Plan calibrated, spec.plan(unshaped, Calibration{c.device_flops, c.mfu, 0.0, ""}));
      c.step_overhead = std::max(0.0, measured.step_seconds - calibrated.time.step);
      c.how = absl::StrFormat(
          "from an unshaped run of the first point: %.1f ms of compute and %.1f ms of step per step",
          measured.compute_seconds * 1e3, measured.step_seconds * 1e3);
      std::fprintf(stderr, "pshard sweep: calibrated %s: MFU %.3f of %.4g GFLOP/s, step overhead %.1f ms\n",
                   c.how.c_str(), c.mfu, c.device_flops / 1e9, c.step_overhead * 1e3);
    }
    RETURN_IF_ERROR(WriteResults(spec, results));
  }

  const absl::Time start = absl::Now();
  size_t ran = 0, remaining = 0;
  for (const SweepPoint& p : points) remaining += results.Find(p.Key()) == nullptr ? 1 : 0;
  for (size_t i = 0; i < points.size(); ++i) {
    const SweepPoint& point = points[i];
    if (results.Find(point.Key()) != nullptr) continue;
    const absl::Duration elapsed = absl::Now() - start;
    const std::string eta = ran == 0 ? std::string("?") : Clock(elapsed / static_cast<double>(ran) *
                                                                 static_cast<double>(remaining - ran));
    std::fprintf(stderr, "%s %zu/%zu | elapsed %s | ETA %s | %s\n", Bar(i, points.size()).c_str(), i + 1,
                 points.size(), Clock(elapsed).c_str(), eta.c_str(), point.Key().c_str());
    ASSIGN_OR_RETURN(const Plan plan, spec.plan(point, results.calibration));
    ASSIGN_OR_RETURN(const PointMeasurement measured,
                     RunPoint(spec, point, plan.input.trainers, absl::StrCat(spec.out_dir, "/points/", i)));
    results.results.push_back(ResultOf(point, measured, plan));
    RETURN_IF_ERROR(WriteResults(spec, results));
    ++ran;
    std::fprintf(stderr, "  step %.1f ms (predicted %.1f ms, %+.1f%%), exposed %.1f ms (predicted %.1f ms)\n",
                 measured.step_seconds * 1e3, plan.time.step * 1e3,
                 100.0 * (plan.time.step / measured.step_seconds - 1), measured.exposed_seconds * 1e3,
                 plan.time.exposed * 1e3);
  }
  std::fprintf(stderr, "%s %zu/%zu | elapsed %s | done: %s/results.csv\n", Bar(points.size(), points.size()).c_str(),
               points.size(), points.size(), Clock(absl::Now() - start).c_str(), spec.out_dir.c_str());
  if (spec.plot) {
    ASSIGN_OR_RETURN(const std::vector<std::string> figures,
                     PlotSweep(spec.plot_script, spec.out_dir + "/results.csv", spec.out_dir));
    for (const std::string& f : figures) std::fprintf(stderr, "pshard sweep: figure %s\n", f.c_str());
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> PlotSweep(const std::string& plot_script, const std::string& csv,
                                                   const std::string& out_dir) {
  if (!std::filesystem::exists(csv)) return absl::NotFoundError(absl::StrCat("no results file ", csv));
  if (!std::filesystem::exists(plot_script)) {
    return absl::NotFoundError(absl::StrCat("the plotting script ", plot_script, " is missing (build pshard)"));
  }
  std::error_code error;
  std::filesystem::create_directories(out_dir, error);
  if (error) return absl::InvalidArgumentError(absl::StrCat("cannot create ", out_dir, ": ", error.message()));
  const std::string python = std::filesystem::exists("/usr/bin/python3") ? "/usr/bin/python3" : "python3";
  const std::string log = out_dir + "/plot.log";
  std::remove(log.c_str());
  ASSIGN_OR_RETURN(ChildProcess child, ChildProcess::Spawn({python, plot_script, csv, out_dir}, log));
  std::optional<int> code = child.WaitUntil(absl::Now() + absl::Minutes(5));
  if (!code) {
    child.Signal(SIGKILL);
    return absl::DeadlineExceededError(absl::StrCat("plotting ", csv, " took over 5 minutes (", log, ")"));
  }
  const std::string output = ReadAll(log);
  if (*code != 0) {
    // The hint where it applies: a missing matplotlib, not a CSV with nothing to plot.
    const bool no_matplotlib = absl::StrContains(output, "No module named 'matplotlib'");
    return absl::InternalError(absl::StrCat("plotting ", csv, " failed (code ", *code,
                                            no_matplotlib ? "; python3-matplotlib is tools/setup.sh's to install" : "",
                                            "):\n", output));
  }
  std::vector<std::string> figures;
  for (absl::string_view line : absl::StrSplit(output, '\n', absl::SkipEmpty())) {
    if (absl::EndsWith(line, ".png")) figures.emplace_back(line);
  }
  if (figures.empty()) return absl::InternalError(absl::StrCat("plotting ", csv, " drew no figure:\n", output));
  return figures;
}

}  // namespace pshard
