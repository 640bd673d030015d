// A small Prometheus client in the shape of prometheus-cpp: a Registry holds
// Families; a Family holds one metric per label set; Counter, Gauge and
// Histogram are updated lock-free. Text exposition format 0.0.4.
//
// Usage:
//   Registry registry;
//   auto& bytes = registry.AddCounter("pshard_fetch_bytes_total", "Bytes fetched.");
//   Counter& grpc_bytes = bytes.Add({{"transport", "grpc"}});  // once, at setup
//   grpc_bytes.Increment(n);                                   // hot path: one atomic add
//
// Thread-safety: everything is thread-safe. Family::Add takes the family's
// lock and may allocate: call it at setup, keep the reference (it stays
// valid for the registry's lifetime). Observations never lock or allocate.
#ifndef PSHARD_COMMON_METRICS_METRICS_H_
#define PSHARD_COMMON_METRICS_METRICS_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace pshard::metrics {

using Labels = std::map<std::string, std::string>;

/// A monotonically increasing value (a `_total` metric).
class Counter {
 public:
  /// Adds `v` (must be >= 0; negative and NaN values are ignored).
  void Increment(double v = 1.0);
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

/// A value that goes up and down.
class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Increment(double v = 1.0) { value_.fetch_add(v, std::memory_order_relaxed); }
  void Decrement(double v = 1.0) { value_.fetch_sub(v, std::memory_order_relaxed); }
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

/// Observations counted into fixed buckets (upper bounds, strictly
/// ascending; +Inf is implicit and dropped if given), with their sum and
/// count. A value v falls in the first bucket whose bound b has v <= b.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double v);

  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> cumulative_counts;  ///< one per bound, then +Inf
    double sum = 0.0;
    uint64_t count = 0;
  };
  Snapshot Collect() const;

  /// `count` bounds start, start*factor, start*factor^2, ...
  static std::vector<double> ExponentialBounds(double start, double factor, int count);

 private:
  const std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // bounds_.size() + 1
  std::atomic<double> sum_{0.0};
};

enum class MetricType { kCounter, kGauge, kHistogram };

/// The metrics of one name: one per distinct label set.
template <typename T>
class Family {
 public:
  Family(std::string name, std::string help, MetricType type, std::vector<double> bounds = {})
      : name_(std::move(name)), help_(std::move(help)), type_(type), bounds_(std::move(bounds)) {}

  /// The metric with these labels, created on first use. Stable reference.
  T& Add(const Labels& labels);

  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  MetricType type() const { return type_; }
  /// The bucket bounds given to each Histogram (empty for other types).
  const std::vector<double>& bounds() const { return bounds_; }
  /// Visits every (labels, metric) pair in label order.
  template <typename Fn>
  void ForEach(Fn fn) const {
    absl::MutexLock lock(&mu_);
    for (const auto& [labels, metric] : metrics_) fn(labels, *metric);
  }

 private:
  const std::string name_;
  const std::string help_;
  const MetricType type_;
  const std::vector<double> bounds_;
  mutable absl::Mutex mu_;
  std::map<Labels, std::unique_ptr<T>> metrics_ ABSL_GUARDED_BY(mu_);
};

/// Owns families and renders them. Registering a name twice returns the
/// same family (and aborts if the type differs: a programming error).
class Registry {
 public:
  Family<Counter>& AddCounter(const std::string& name, const std::string& help);
  Family<Gauge>& AddGauge(const std::string& name, const std::string& help);
  Family<Histogram>& AddHistogram(const std::string& name, const std::string& help,
                                  std::vector<double> bounds);

  /// All families in the Prometheus text exposition format 0.0.4, sorted by name.
  std::string Serialize() const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<Family<Counter>>> counters_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::unique_ptr<Family<Gauge>>> gauges_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::unique_ptr<Family<Histogram>>> histograms_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pshard::metrics

#endif  // PSHARD_COMMON_METRICS_METRICS_H_
