// Cost of a metric update on the hot path: Counter::Increment, Gauge::Set and
// Histogram::Observe, from one thread and from two threads sharing the
// metric (the contended case), plus two threads on separate counters.
//
//   build/bin/metrics_overhead_bench
//
// Time is wall time over all threads' updates (1 / items_per_second); with
// two threads, CPU is what one thread pays per update.
#include <cstdint>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "common/metrics/metrics.h"

namespace pshard::metrics {
namespace {

// One registry for the whole run, as in a server: metrics are looked up once.
Registry& BenchRegistry() {
  static Registry* registry = new Registry();
  return *registry;
}

void BM_CounterIncrement(benchmark::State& state) {
  Counter& counter = BenchRegistry().AddCounter("bench_ops_total", "Ops.").Add({});
  for (auto _ : state) counter.Increment();
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_CounterIncrement)->Threads(1)->Threads(2)->UseRealTime();

// Each thread its own counter (different labels): no cache line is shared.
void BM_CounterIncrementPerThread(benchmark::State& state) {
  Counter& counter = BenchRegistry()
                         .AddCounter("bench_thread_ops_total", "Ops per thread.")
                         .Add({{"thread", std::to_string(state.thread_index())}});
  for (auto _ : state) counter.Increment();
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_CounterIncrementPerThread)->Threads(1)->Threads(2)->UseRealTime();

void BM_GaugeSet(benchmark::State& state) {
  Gauge& gauge = BenchRegistry().AddGauge("bench_level", "Level.").Add({});
  double v = 0;
  for (auto _ : state) {
    gauge.Set(v);
    v += 1;
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_GaugeSet)->Threads(1)->Threads(2)->UseRealTime();

// 20 exponential buckets, values spread over all of them and past the last.
void BM_HistogramObserve(benchmark::State& state) {
  Histogram& histogram = BenchRegistry()
                             .AddHistogram("bench_latency_seconds", "Latency.",
                                           Histogram::ExponentialBounds(1e-6, 2, 20))
                             .Add({});
  std::vector<double> values(1024);
  uint32_t seed = 12345 + state.thread_index();
  for (double& v : values) {
    seed = seed * 1664525u + 1013904223u;
    v = 1e-6 * static_cast<double>(seed >> 11) / 1024.0;  // 0 .. ~2 s
  }
  size_t i = 0;
  for (auto _ : state) histogram.Observe(values[i++ & 1023]);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_HistogramObserve)->Threads(1)->Threads(2)->UseRealTime();

}  // namespace
}  // namespace pshard::metrics

BENCHMARK_MAIN();
