#include "common/metrics/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <utility>
#include <variant>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace pshard::metrics {
namespace {

// Misuse of the registry (a bad name, a type clash) is a programming error.
[[noreturn]] void Fatal(absl::string_view message) {
  std::fprintf(stderr, "pshard::metrics: %.*s\n", static_cast<int>(message.size()), message.data());
  std::abort();
}

bool IsAlpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// [a-zA-Z_:][a-zA-Z0-9_:]* for metric names, [a-zA-Z_][a-zA-Z0-9_]* for
// label names; neither may start with "__" (reserved for Prometheus).
bool IsValidName(absl::string_view name, bool allow_colon) {
  if (name.empty() || absl::StartsWith(name, "__")) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok = IsAlpha(c) || (i > 0 && IsDigit(c)) || (allow_colon && c == ':');
    if (!ok) return false;
  }
  return true;
}

void CheckMetricName(const std::string& name) {
  if (!IsValidName(name, /*allow_colon=*/true)) {
    Fatal(absl::StrCat("invalid metric name \"", name,
                       "\": must match [a-zA-Z_:][a-zA-Z0-9_:]* and not start with __"));
  }
}

void CheckLabelNames(const std::string& family, const Labels& labels, MetricType type) {
  for (const auto& [key, value] : labels) {
    if (!IsValidName(key, /*allow_colon=*/false)) {
      Fatal(absl::StrCat("invalid label name \"", key, "\" in metric ", family,
                         ": must match [a-zA-Z_][a-zA-Z0-9_]* and not start with __"));
    }
    if (type == MetricType::kHistogram && key == "le") {
      Fatal(absl::StrCat("label name \"le\" is reserved in histogram ", family));
    }
  }
}

// Strictly ascending finite bounds; a trailing +Inf is dropped (implicit).
std::vector<double> CheckedBounds(std::vector<double> bounds) {
  if (!bounds.empty() && bounds.back() == INFINITY) bounds.pop_back();
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i]) || (i > 0 && !(bounds[i - 1] < bounds[i]))) {
      Fatal("histogram bounds must be finite and strictly ascending");
    }
  }
  return bounds;
}

const char* TypeName(MetricType type) {
  switch (type) {
    case MetricType::kCounter: return "counter";
    case MetricType::kGauge: return "gauge";
    case MetricType::kHistogram: return "histogram";
  }
  return "untyped";
}

// Integers print exactly; other doubles in their shortest round-trip form.
void AppendValue(double v, std::string* out) {
  if (std::isnan(v)) {
    out->append("NaN");
  } else if (std::isinf(v)) {
    out->append(v > 0 ? "+Inf" : "-Inf");
  } else if (v == std::trunc(v) && std::fabs(v) < 9223372036854775808.0) {
    absl::StrAppend(out, static_cast<int64_t>(v));
  } else {
    char buf[32];
    const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
    out->append(buf, end);
  }
}

void AppendEscaped(absl::string_view text, bool escape_quote, std::string* out) {
  for (char c : text) {
    if (c == '\\') {
      out->append("\\\\");
    } else if (c == '\n') {
      out->append("\\n");
    } else if (c == '"' && escape_quote) {
      out->append("\\\"");
    } else {
      out->push_back(c);
    }
  }
}

// `name{k="v",...,le="bound"} value` (no braces when there are no labels).
void AppendSample(absl::string_view name, absl::string_view suffix, const Labels& labels,
                  const double* le, double value, std::string* out) {
  absl::StrAppend(out, name, suffix);
  if (!labels.empty() || le != nullptr) {
    out->push_back('{');
    const char* sep = "";
    for (const auto& [key, label_value] : labels) {
      absl::StrAppend(out, sep, key, "=\"");
      AppendEscaped(label_value, /*escape_quote=*/true, out);
      out->push_back('"');
      sep = ",";
    }
    if (le != nullptr) {
      absl::StrAppend(out, sep, "le=\"");
      AppendValue(*le, out);
      out->push_back('"');
    }
    out->push_back('}');
  }
  out->push_back(' ');
  AppendValue(value, out);
  out->push_back('\n');
}

template <typename T>
void AppendHeader(const Family<T>& family, std::string* out) {
  absl::StrAppend(out, "# HELP ", family.name(), " ");
  AppendEscaped(family.help(), /*escape_quote=*/false, out);
  absl::StrAppend(out, "\n# TYPE ", family.name(), " ", TypeName(family.type()), "\n");
}

template <typename T>  // Counter or Gauge
void AppendFamily(const Family<T>& family, std::string* out) {
  AppendHeader(family, out);
  family.ForEach([&](const Labels& labels, const T& metric) {
    AppendSample(family.name(), "", labels, nullptr, metric.Value(), out);
  });
}

void AppendFamily(const Family<Histogram>& family, std::string* out) {
  AppendHeader(family, out);
  family.ForEach([&](const Labels& labels, const Histogram& histogram) {
    const Histogram::Snapshot s = histogram.Collect();
    for (size_t i = 0; i < s.bounds.size(); ++i) {
      AppendSample(family.name(), "_bucket", labels, &s.bounds[i],
                   static_cast<double>(s.cumulative_counts[i]), out);
    }
    const double inf = INFINITY;
    AppendSample(family.name(), "_bucket", labels, &inf, static_cast<double>(s.count), out);
    AppendSample(family.name(), "_sum", labels, nullptr, s.sum, out);
    AppendSample(family.name(), "_count", labels, nullptr, static_cast<double>(s.count), out);
  });
}

// Finds or creates `name` in `families`, aborting if another type holds it.
template <typename T, typename... Other>
Family<T>& FindOrAdd(std::map<std::string, std::unique_ptr<Family<T>>>& families,
                     const std::string& name, const std::string& help, MetricType type,
                     std::vector<double> bounds, const Other&... others) {
  CheckMetricName(name);
  if ((others.contains(name) || ...)) {
    Fatal(absl::StrCat("metric ", name, " is already registered with a type other than ",
                       TypeName(type)));
  }
  auto& family = families[name];
  if (family == nullptr) {
    family = std::make_unique<Family<T>>(name, help, type, std::move(bounds));
  } else if (family->bounds() != bounds) {
    Fatal(absl::StrCat("histogram ", name, " is already registered with other bounds"));
  }
  return *family;
}

}  // namespace

void Counter::Increment(double v) {
  if (!(v >= 0.0)) return;  // also drops NaN
  value_.fetch_add(v, std::memory_order_relaxed);
}

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(CheckedBounds(std::move(bounds))),
      counts_(std::make_unique<std::atomic<uint64_t>[]>(bounds_.size() + 1)) {}

void Histogram::Observe(double v) {
  // Binary search for the first bound b with v <= b; none (or NaN) is +Inf.
  size_t lo = 0;
  size_t hi = bounds_.size();
  while (lo < hi) {
    const size_t mid = lo + (hi - lo) / 2;
    if (v <= bounds_[mid]) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  counts_[lo].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(v, std::memory_order_relaxed);
}

Histogram::Snapshot Histogram::Collect() const {
  Snapshot s;
  s.bounds = bounds_;
  s.cumulative_counts.resize(bounds_.size() + 1);
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    s.count += counts_[i].load(std::memory_order_relaxed);
    s.cumulative_counts[i] = s.count;
  }
  s.sum = sum_.load(std::memory_order_relaxed);
  return s;
}

std::vector<double> Histogram::ExponentialBounds(double start, double factor, int count) {
  if (!(start > 0.0) || !(factor > 1.0) || count < 1) {
    Fatal(absl::StrCat("ExponentialBounds needs start > 0, factor > 1, count >= 1; got ", start,
                       ", ", factor, ", ", count));
  }
  std::vector<double> bounds(count);
  double bound = start;
  for (double& b : bounds) {
    b = bound;
    bound *= factor;
  }
  return bounds;
}

template <typename T>
T& Family<T>::Add(const Labels& labels) {
  absl::MutexLock lock(&mu_);
  auto it = metrics_.find(labels);
  if (it != metrics_.end()) return *it->second;
  CheckLabelNames(name_, labels, type_);
  std::unique_ptr<T> metric;
  if constexpr (std::is_same_v<T, Histogram>) {
    metric = std::make_unique<Histogram>(bounds_);
  } else {
    metric = std::make_unique<T>();
  }
  return *metrics_.emplace(labels, std::move(metric)).first->second;
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

Family<Counter>& Registry::AddCounter(const std::string& name, const std::string& help) {
  absl::MutexLock lock(&mu_);
  return FindOrAdd(counters_, name, help, MetricType::kCounter, {}, gauges_, histograms_);
}

Family<Gauge>& Registry::AddGauge(const std::string& name, const std::string& help) {
  absl::MutexLock lock(&mu_);
  return FindOrAdd(gauges_, name, help, MetricType::kGauge, {}, counters_, histograms_);
}

Family<Histogram>& Registry::AddHistogram(const std::string& name, const std::string& help,
                                          std::vector<double> bounds) {
  absl::MutexLock lock(&mu_);
  return FindOrAdd(histograms_, name, help, MetricType::kHistogram,
                   CheckedBounds(std::move(bounds)), counters_, gauges_);
}

std::string Registry::Serialize() const {
  using FamilyPtr =
      std::variant<const Family<Counter>*, const Family<Gauge>*, const Family<Histogram>*>;
  std::vector<std::pair<absl::string_view, FamilyPtr>> families;
  {
    // Families are never removed, so the pointers outlive the lock.
    absl::MutexLock lock(&mu_);
    for (const auto& [name, f] : counters_) families.emplace_back(name, f.get());
    for (const auto& [name, f] : gauges_) families.emplace_back(name, f.get());
    for (const auto& [name, f] : histograms_) families.emplace_back(name, f.get());
  }
  std::sort(families.begin(), families.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::string out;
  for (const auto& [name, family] : families) {
    std::visit([&out](const auto* f) { AppendFamily(*f, &out); }, family);
  }
  return out;
}

}  // namespace pshard::metrics
