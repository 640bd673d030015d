#include "common/rng.h"

#include <cmath>

namespace pshard {

double NormalAt(uint64_t seed, uint64_t stream, uint64_t index) {
  // Two independent uniforms from disjoint counters; u1 in (0, 1].
  const double u1 = 1.0 - UniformAt(seed, stream, 2 * index);
  const double u2 = UniformAt(seed, stream, 2 * index + 1);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

}  // namespace pshard
