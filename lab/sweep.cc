#include "lab/sweep.h"

#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"

namespace pshard {
namespace {

JsonValue Num(double v) { return JsonValue::Number(v); }

absl::StatusOr<double> NumberField(const JsonValue& object, const std::string& key, const std::string& where) {
  const JsonValue* v = object.Find(key);
  if (v == nullptr || !v->is_number()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": no number \"", key, "\""));
  }
  return v->as_number();
}

JsonValue MeasurementToJson(const PointMeasurement& m) {
  return JsonValue::MakeObject({{"steps", Num(m.steps)},
                                {"step_seconds", Num(m.step_seconds)},
                                {"compute_seconds", Num(m.compute_seconds)},
                                {"exposed_seconds", Num(m.exposed_seconds)},
                                {"comm_seconds", Num(m.comm_seconds)},
                                {"fetched_bytes", Num(m.fetched_bytes)},
                                {"pushed_bytes", Num(m.pushed_bytes)},
                                {"tokens_per_second", Num(m.tokens_per_second)},
                                {"loss", Num(m.loss)},
                                {"val_loss", std::isnan(m.val_loss) ? JsonValue() : Num(m.val_loss)}});
}

JsonValue PredictionToJson(const SweepResult& r) {
  return JsonValue::MakeObject({{"step_seconds", Num(r.predicted.step)},
                                {"compute_seconds", Num(r.predicted.compute)},
                                {"exposed_seconds", Num(r.predicted.exposed)},
                                {"comm_seconds", Num(r.predicted.comm)},
                                {"tokens_per_second", Num(r.predicted.tokens_per_second)},
                                {"fetched_bytes", Num(static_cast<double>(r.predicted_bytes.fetched))},
                                {"pushed_bytes", Num(static_cast<double>(r.predicted_bytes.pushed))},
                                {"comm_bound", JsonValue::Bool(r.predicted.comm_bound())}});
}

}  // namespace

absl::StatusOr<std::vector<SweepAxis>> ParseGrid(
    const std::vector<std::string>& args, const std::function<bool(const std::string&)>& is_flag,
    const std::vector<std::pair<std::string, std::string>>& reserved) {
  std::vector<SweepAxis> axes;
  std::set<std::string> seen;
  for (const std::string& arg : args) {
    const size_t eq = arg.find('=');
    if (!absl::StartsWith(arg, "--") || eq == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("'", arg, "' is not --flag=value[,value...]"));
    }
    SweepAxis axis;
    axis.flag = arg.substr(2, eq - 2);
    for (const auto& [name, why] : reserved) {
      if (axis.flag == name) return absl::InvalidArgumentError(absl::StrCat("--", name, " cannot vary: ", why));
    }
    if (!is_flag(axis.flag)) {
      return absl::InvalidArgumentError(absl::StrCat("--", axis.flag, " is not a flag of pshard local"));
    }
    if (!seen.insert(axis.flag).second) {
      return absl::InvalidArgumentError(absl::StrCat("--", axis.flag, " is given twice: give its values as one list"));
    }
    axis.values = absl::StrSplit(arg.substr(eq + 1), ',', absl::SkipEmpty());
    if (axis.values.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--", axis.flag, "= gives no values: the grid would be empty"));
    }
    axes.push_back(std::move(axis));
  }
  if (axes.empty()) {
    return absl::InvalidArgumentError(
        "the grid is empty: give flags of pshard local with values to sweep, e.g. --link_rate=1gbit,100mbit");
  }
  return axes;
}

std::string SweepPoint::Key() const {
  std::vector<std::string> parts;
  for (const auto& [flag, value] : flags) parts.push_back(absl::StrCat(flag, "=", value));
  return absl::StrJoin(parts, " ");
}

std::vector<std::string> SweepPoint::Args() const {
  std::vector<std::string> args;
  for (const auto& [flag, value] : flags) args.push_back(absl::StrCat("--", flag, "=", value));
  return args;
}

std::vector<SweepPoint> GridPoints(const std::vector<SweepAxis>& axes) {
  std::vector<SweepPoint> points(1);
  for (const SweepAxis& axis : axes) {
    std::vector<SweepPoint> next;
    for (const SweepPoint& p : points) {
      for (const std::string& v : axis.values) {
        SweepPoint q = p;
        q.flags.emplace_back(axis.flag, v);
        next.push_back(std::move(q));
      }
    }
    points = std::move(next);
  }
  return points;
}

absl::StatusOr<PointMeasurement> MeasureStepLogs(const std::vector<std::string>& paths, int64_t first_step) {
  PointMeasurement m;
  double steps = 0, tokens = 0;
  for (const std::string& path : paths) {
    std::ifstream in(path);
    if (!in) return absl::NotFoundError(absl::StrCat("no step log ", path));
    std::string line;
    int measured = 0, number = 0;
    while (std::getline(in, line)) {
      ++number;
      if (line.empty()) continue;
      const std::string where = absl::StrCat(path, ":", number);
      absl::StatusOr<JsonValue> record = ParseJson(line);
      if (!record.ok()) return absl::DataLossError(absl::StrCat(where, ": ", record.status().message()));
      ASSIGN_OR_RETURN(const double step, NumberField(*record, "step", where));
      if (step < static_cast<double>(first_step)) continue;
      ++measured;
      ASSIGN_OR_RETURN(const double wall, NumberField(*record, "wall_seconds", where));
      ASSIGN_OR_RETURN(const double compute, NumberField(*record, "compute_seconds", where));
      ASSIGN_OR_RETURN(const double exposed, NumberField(*record, "comm_exposed_seconds", where));
      ASSIGN_OR_RETURN(const double busy, NumberField(*record, "comm_busy_seconds", where));
      ASSIGN_OR_RETURN(const double fetched, NumberField(*record, "payload_fetched", where));
      ASSIGN_OR_RETURN(const double pushed, NumberField(*record, "payload_pushed", where));
      ASSIGN_OR_RETURN(const double t, NumberField(*record, "tokens", where));
      ASSIGN_OR_RETURN(const double loss, NumberField(*record, "loss", where));
      m.step_seconds += wall;
      m.compute_seconds += compute;
      m.exposed_seconds += exposed;
      m.comm_seconds += busy;
      m.fetched_bytes += fetched;
      m.pushed_bytes += pushed;
      m.loss += loss;
      tokens += t;
      steps += 1;
    }
    if (measured == 0) {
      return absl::DataLossError(absl::StrCat(path, " has no step at or after step ", first_step));
    }
    m.steps = measured;
  }
  for (double* v : {&m.step_seconds, &m.compute_seconds, &m.exposed_seconds, &m.comm_seconds, &m.fetched_bytes,
                    &m.pushed_bytes, &m.loss}) {
    *v /= steps;
  }
  // Every trainer's tokens, over the mean step.
  m.tokens_per_second = m.step_seconds > 0 ? tokens / steps * static_cast<double>(paths.size()) / m.step_seconds : 0;
  return m;
}

const SweepResult* SweepResults::Find(const std::string& key) const {
  for (const SweepResult& r : results) {
    if (r.point.Key() == key) return &r;
  }
  return nullptr;
}

JsonValue SweepResultsToJson(const SweepResults& results) {
  JsonValue::Array rows;
  for (const SweepResult& r : results.results) {
    JsonValue::Array flags;
    for (const auto& [flag, value] : r.point.flags) {
      flags.push_back(JsonValue::MakeArray({JsonValue::String(flag), JsonValue::String(value)}));
    }
    rows.push_back(JsonValue::MakeObject({{"flags", JsonValue::MakeArray(std::move(flags))},
                                          {"key", JsonValue::String(r.point.Key())},
                                          {"measured", MeasurementToJson(r.measured)},
                                          {"predicted", PredictionToJson(r)},
                                          {"link_bytes_per_second", Num(r.link_bytes_per_second)},
                                          // null: no rate makes the point compute-bound
                                          {"knee_bytes_per_second", std::isinf(r.knee_bytes_per_second)
                                                                        ? JsonValue()
                                                                        : Num(r.knee_bytes_per_second)}}));
  }
  const Calibration& c = results.calibration;
  return JsonValue::MakeObject({{"device_flops", Num(c.device_flops)},
                                {"mfu", Num(c.mfu)},
                                {"step_overhead_seconds", Num(c.step_overhead)},
                                {"calibration", JsonValue::String(c.how)},
                                {"results", JsonValue::MakeArray(std::move(rows))}});
}

absl::StatusOr<SweepResults> SweepResultsFromJson(const JsonValue& json) {
  SweepResults out;
  Calibration& c = out.calibration;
  ASSIGN_OR_RETURN(c.device_flops, NumberField(json, "device_flops", "results.json"));
  ASSIGN_OR_RETURN(c.mfu, NumberField(json, "mfu", "results.json"));
  ASSIGN_OR_RETURN(c.step_overhead, NumberField(json, "step_overhead_seconds", "results.json"));
  if (const JsonValue* how = json.Find("calibration"); how != nullptr && how->is_string()) c.how = how->as_string();
  const JsonValue* rows = json.Find("results");
  if (rows == nullptr || !rows->is_array()) return absl::InvalidArgumentError("results.json: no \"results\" list");
  for (const JsonValue& row : rows->as_array()) {
    SweepResult r;
    const JsonValue* flags = row.Find("flags");
    const JsonValue* measured = row.Find("measured");
    const JsonValue* predicted = row.Find("predicted");
    if (flags == nullptr || !flags->is_array() || measured == nullptr || predicted == nullptr) {
      return absl::InvalidArgumentError("results.json: a result lacks flags, measured or predicted");
    }
    for (const JsonValue& f : flags->as_array()) {
      if (!f.is_array() || f.as_array().size() != 2 || !f.as_array()[0].is_string() || !f.as_array()[1].is_string()) {
        return absl::InvalidArgumentError("results.json: a flag is not [name, value]");
      }
      r.point.flags.emplace_back(f.as_array()[0].as_string(), f.as_array()[1].as_string());
    }
    const std::string where = absl::StrCat("results.json, ", r.point.Key());
    PointMeasurement& m = r.measured;
    ASSIGN_OR_RETURN(const double steps, NumberField(*measured, "steps", where));
    m.steps = static_cast<int>(steps);
    ASSIGN_OR_RETURN(m.step_seconds, NumberField(*measured, "step_seconds", where));
    ASSIGN_OR_RETURN(m.compute_seconds, NumberField(*measured, "compute_seconds", where));
    ASSIGN_OR_RETURN(m.exposed_seconds, NumberField(*measured, "exposed_seconds", where));
    ASSIGN_OR_RETURN(m.comm_seconds, NumberField(*measured, "comm_seconds", where));
    ASSIGN_OR_RETURN(m.fetched_bytes, NumberField(*measured, "fetched_bytes", where));
    ASSIGN_OR_RETURN(m.pushed_bytes, NumberField(*measured, "pushed_bytes", where));
    ASSIGN_OR_RETURN(m.tokens_per_second, NumberField(*measured, "tokens_per_second", where));
    ASSIGN_OR_RETURN(m.loss, NumberField(*measured, "loss", where));
    if (const JsonValue* val = measured->Find("val_loss"); val != nullptr && !val->is_null()) {
      ASSIGN_OR_RETURN(m.val_loss, NumberField(*measured, "val_loss", where));
    }
    ASSIGN_OR_RETURN(r.predicted.step, NumberField(*predicted, "step_seconds", where));
    ASSIGN_OR_RETURN(r.predicted.compute, NumberField(*predicted, "compute_seconds", where));
    ASSIGN_OR_RETURN(r.predicted.exposed, NumberField(*predicted, "exposed_seconds", where));
    ASSIGN_OR_RETURN(r.predicted.comm, NumberField(*predicted, "comm_seconds", where));
    ASSIGN_OR_RETURN(r.predicted.tokens_per_second, NumberField(*predicted, "tokens_per_second", where));
    ASSIGN_OR_RETURN(const double fetched, NumberField(*predicted, "fetched_bytes", where));
    ASSIGN_OR_RETURN(const double pushed, NumberField(*predicted, "pushed_bytes", where));
    r.predicted_bytes.fetched = static_cast<int64_t>(fetched);
    r.predicted_bytes.pushed = static_cast<int64_t>(pushed);
    ASSIGN_OR_RETURN(r.link_bytes_per_second, NumberField(row, "link_bytes_per_second", where));
    if (const JsonValue* knee = row.Find("knee_bytes_per_second"); knee != nullptr && knee->is_null()) {
      r.knee_bytes_per_second = std::numeric_limits<double>::infinity();
    } else {
      ASSIGN_OR_RETURN(r.knee_bytes_per_second, NumberField(row, "knee_bytes_per_second", where));
    }
    out.results.push_back(std::move(r));
  }
  return out;
}

std::string SweepResultsToCsv(const SweepResults& results) {
  std::vector<std::string> columns;
  for (const SweepResult& r : results.results) {
    for (const auto& [flag, value] : r.point.flags) {
      if (std::find(columns.begin(), columns.end(), flag) == columns.end()) columns.push_back(flag);
    }
  }
  std::string out = absl::StrCat(
      "point,", absl::StrJoin(columns, ","),
      ",link_mbit,measured_step_ms,measured_compute_ms,measured_exposed_ms,measured_comm_ms,measured_fetched_bytes,"
      "measured_pushed_bytes,measured_tokens_per_s,measured_val_loss,predicted_step_ms,predicted_compute_ms,"
      "predicted_exposed_ms,predicted_comm_ms,predicted_fetched_bytes,predicted_pushed_bytes,"
      "predicted_tokens_per_s,predicted_comm_bound,knee_mbit,step_error\n");
  auto ms = [](double s) { return absl::StrFormat("%.3f", s * 1e3); };
  auto mbit = [](double bytes_per_second) { return absl::StrFormat("%.4g", bytes_per_second * 8 / 1e6); };
  for (size_t i = 0; i < results.results.size(); ++i) {
    const SweepResult& r = results.results[i];
    std::map<std::string, std::string> values(r.point.flags.begin(), r.point.flags.end());
    std::vector<std::string> cells = {absl::StrCat(i)};
    for (const std::string& c : columns) cells.push_back(values.count(c) ? values[c] : "");
    const PointMeasurement& m = r.measured;
    const double error = m.step_seconds > 0 ? r.predicted.step / m.step_seconds - 1 : 0;
    for (std::string cell :
         {mbit(r.link_bytes_per_second), ms(m.step_seconds), ms(m.compute_seconds), ms(m.exposed_seconds),
          ms(m.comm_seconds), absl::StrFormat("%.0f", m.fetched_bytes), absl::StrFormat("%.0f", m.pushed_bytes),
          absl::StrFormat("%.1f", m.tokens_per_second), std::isnan(m.val_loss) ? std::string() : absl::StrFormat("%.5f", m.val_loss), ms(r.predicted.step),
          ms(r.predicted.compute), ms(r.predicted.exposed), ms(r.predicted.comm),
          absl::StrCat(r.predicted_bytes.fetched), absl::StrCat(r.predicted_bytes.pushed),
          absl::StrFormat("%.1f", r.predicted.tokens_per_second), std::string(r.predicted.comm_bound() ? "1" : "0"),
          mbit(r.knee_bytes_per_second), absl::StrFormat("%.4f", error)}) {
      cells.push_back(std::move(cell));
    }
    absl::StrAppend(&out, absl::StrJoin(cells, ","), "\n");
  }
  return out;
}

}  // namespace pshard
