// Device helpers shared by the CUDA kernels: bf16 conversion exactly as
// common/bf16.h does it on the host, and fixed-order warp reductions.
#ifndef PSHARD_TRAINER_CLIENT_MODEL_CUDA_DEVICE_MATH_CUH_
#define PSHARD_TRAINER_CLIENT_MODEL_CUDA_DEVICE_MATH_CUH_

#include <cuda_bf16.h>

#include <cstdint>

namespace pshard::internal {

using bf16 = __nv_bfloat16;

namespace {

constexpr int kWarpSize = 32;

__device__ __forceinline__ float ToFloat(bf16 x) { return __bfloat162float(x); }

// Rounds to bf16 with exactly the bit operations of common/bf16.h's
// FloatToBf16 (ties to even; NaN keeps its sign and gets the quiet bit).
__device__ __forceinline__ bf16 ToBf16(float x) {
  const uint32_t bits = __float_as_uint(x);
  uint32_t rounded;
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    rounded = (bits >> 16) | 0x0040u;
  } else {
    rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  }
  return __ushort_as_bfloat16(static_cast<unsigned short>(rounded));
}

// Butterfly reductions over a full warp. Every lane ends with the same bits:
// at each step the two partners add the same two values, and fp32 addition
// is commutative.
__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

}  // namespace
}  // namespace pshard::internal

#endif  // PSHARD_TRAINER_CLIENT_MODEL_CUDA_DEVICE_MATH_CUH_
