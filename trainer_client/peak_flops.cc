#include "trainer_client/peak_flops.h"

#include <cblas.h>

#include <algorithm>
#include <vector>

#include "absl/time/clock.h"

namespace pshard {

double MeasureSgemmFlops() {
  // The best of many products over a quarter second: BLAS threads that wake
  // late, or another process's burst, spoil single products (the best of
  // five took 2 of 20 measurements to half the rate here).
  constexpr int kN = 512;
  constexpr int kMinRepeats = 5;
  const absl::Duration kMeasuring = absl::Milliseconds(250);
  std::vector<float> a(kN * kN, 0.5f), b(kN * kN, 0.25f), c(kN * kN, 0.0f);
  double best = 0.0;
  const absl::Time until = absl::Now() + kMeasuring;
  for (int r = 0; r < kMinRepeats || absl::Now() < until; ++r) {
    const absl::Time start = absl::Now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, kN, kN, kN, 1.0f, a.data(), kN, b.data(), kN, 0.0f,
                c.data(), kN);
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    if (seconds > 0) best = std::max(best, 2.0 * kN * kN * kN / seconds);
  }
  return best;
}

}  // namespace pshard
