#include "trainer_client/model/cuda/kernels.h"

#include <algorithm>
#include <cmath>

#include "trainer_client/model/cuda/device_math.cuh"

namespace pshard::internal {
namespace {

constexpr int kThreads = 256;                        // element-wise and per-row kernels
constexpr int kRowsPerBlock = kThreads / kWarpSize;  // warp-per-row kernels
constexpr int kColumnTile = 32;                      // columns per column-sum block
constexpr int kColumnSumRows = 16;                   // row lanes per column-sum block
constexpr int64_t kMaxElementwiseBlocks = 65536;     // grid-stride beyond this
constexpr float kLayerNormEps = 1e-5f;
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

// ---------------------------------------------------------------- helpers

// Sum or max over a whole block (blockDim.x a multiple of 32, at most 1024);
// every thread gets the result. Each warp reduces its values, then every warp
// reduces the per-warp partials again, in the same order.
template <bool kMax>
__device__ float BlockReduce(float v) {
  __shared__ float partials[kWarpSize];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  const float identity = kMax ? -INFINITY : 0.0f;
  v = kMax ? WarpMax(v) : WarpSum(v);
  if (lane == 0) partials[warp] = v;
  __syncthreads();
  v = lane < num_warps ? partials[lane] : identity;
  v = kMax ? WarpMax(v) : WarpSum(v);
  __syncthreads();  // partials may be reused by the next call
  return v;
}

// Deterministic column sums of a [rows, cols] matrix, two at a time:
// (*out0)[c] = sum_n term(n, c).x and, when out1 is not null,
// (*out1)[c] = sum_n term(n, c).y. Block (kColumnTile, kColumnSumRows) per
// tile of kColumnTile columns: thread (x, y) adds rows y, y + kColumnSumRows,
// ... in order, then thread (x, 0) adds the kColumnSumRows partials in order.
template <typename Term>
__device__ void ColumnSums(float* out0, float* out1, Term term, int rows, int cols) {
  __shared__ float partial0[kColumnSumRows][kColumnTile + 1];
  __shared__ float partial1[kColumnSumRows][kColumnTile + 1];
  const int c = blockIdx.x * kColumnTile + threadIdx.x;
  float sum0 = 0.0f;
  float sum1 = 0.0f;
  if (c < cols) {
    for (int n = threadIdx.y; n < rows; n += kColumnSumRows) {
      const float2 t = term(n, c);
      sum0 += t.x;
      sum1 += t.y;
    }
  }
  partial0[threadIdx.y][threadIdx.x] = sum0;
  partial1[threadIdx.y][threadIdx.x] = sum1;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total0 = 0.0f;
    float total1 = 0.0f;
    for (int y = 0; y < kColumnSumRows; ++y) {
      total0 += partial0[y][threadIdx.x];
      total1 += partial1[y][threadIdx.x];
    }
    out0[c] = total0;
    if (out1 != nullptr) out1[c] = total1;
  }
}

int ElementwiseBlocks(int64_t count) {
  return static_cast<int>(
      std::clamp<int64_t>((count + kThreads - 1) / kThreads, 1, kMaxElementwiseBlocks));
}

int WarpPerRowBlocks(int64_t rows) {
  return static_cast<int>(std::max<int64_t>((rows + kRowsPerBlock - 1) / kRowsPerBlock, 1));
}

dim3 ColumnSumGrid(int cols) { return dim3((cols + kColumnTile - 1) / kColumnTile); }
dim3 ColumnSumBlock() { return dim3(kColumnTile, kColumnSumRows); }

// Grid-stride loop over [0, count).
#define PSHARD_FOR_EACH_ELEMENT(i, count)                                                    \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (count); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// The warp-per-row kernels: this warp's row and lane. The row is the same for
// the whole warp, so a warp past the end returns as a whole and the full-mask
// shuffles stay valid.
__device__ __forceinline__ int64_t WarpRow() {
  return static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
}
__device__ __forceinline__ int Lane() { return threadIdx.x % kWarpSize; }

// ---------------------------------------------------------------- encoder

__global__ void EncoderForwardKernel(bf16* out, const int32_t* tokens, const bf16* wte,
                                     const bf16* wpe, int seq_len, int channels, int64_t count) {
  PSHARD_FOR_EACH_ELEMENT(i, count) {
    const int64_t n = i / channels;
    const int c = static_cast<int>(i % channels);
    const int t = static_cast<int>(n % seq_len);
    const float sum = ToFloat(wte[static_cast<int64_t>(tokens[n]) * channels + c]) +
                      ToFloat(wpe[static_cast<int64_t>(t) * channels + c]);
    out[i] = ToBf16(sum);
  }
}

__global__ void EncoderBackwardWpeKernel(float* dwpe, const bf16* dout, int batch, int seq_len,
                                         int channels) {
  const int64_t count = static_cast<int64_t>(seq_len) * channels;
  PSHARD_FOR_EACH_ELEMENT(i, count) {  // i = t * C + c
    float sum = 0.0f;
    for (int b = 0; b < batch; ++b) sum += ToFloat(dout[b * count + i]);
    dwpe[i] = sum;
  }
}

// One block per distinct token of the batch, threads across the channels.
__global__ void EncoderBackwardWteKernel(float* dwte, const bf16* dout, TokenRows rows,
                                         int channels) {
  const int k = blockIdx.x;
  const int64_t token = rows.token[k];
  const int first = rows.begin[k];
  const int last = rows.begin[k + 1];
  for (int c = threadIdx.x; c < channels; c += blockDim.x) {
    float sum = 0.0f;
    for (int p = first; p < last; ++p) {
      sum += ToFloat(dout[static_cast<int64_t>(rows.position[p]) * channels + c]);
    }
    dwte[token * channels + c] = sum;
  }
}

// ---------------------------------------------------------------- layernorm

// One warp per row; two passes (mean, then variance about the mean).
__global__ void LayerNormForwardKernel(bf16* out, float* mean, float* rstd, const bf16* inp,
                                       const bf16* weight, const bf16* bias, int rows,
                                       int channels) {
  const int64_t row = WarpRow();
  if (row >= rows) return;
  const int lane = Lane();
  const bf16* x = inp + row * channels;
  bf16* y = out + row * channels;
  float sum = 0.0f;
  for (int c = lane; c < channels; c += kWarpSize) sum += ToFloat(x[c]);
  const float m = WarpSum(sum) / channels;
  float squares = 0.0f;
  for (int c = lane; c < channels; c += kWarpSize) {
    const float d = ToFloat(x[c]) - m;
    squares += d * d;
  }
  const float s = 1.0f / sqrtf(WarpSum(squares) / channels + kLayerNormEps);
  for (int c = lane; c < channels; c += kWarpSize) {
    y[c] = ToBf16((ToFloat(x[c]) - m) * s * ToFloat(weight[c]) + ToFloat(bias[c]));
  }
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = s;
  }
}

// dinp, one warp per row. With norm = (x - m) * s and dnorm = dy * weight:
// dx = s * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)).
__global__ void LayerNormBackwardInputKernel(bf16* dinp, const bf16* dout, const bf16* inp,
                                             const bf16* weight, const float* mean,
                                             const float* rstd, int rows, int channels) {
  const int64_t row = WarpRow();
  if (row >= rows) return;
  const int lane = Lane();
  const bf16* x = inp + row * channels;
  const bf16* dy = dout + row * channels;
  bf16* dx = dinp + row * channels;
  const float m = mean[row];
  const float s = rstd[row];
  float dnorm_sum = 0.0f;
  float dnorm_norm_sum = 0.0f;
  for (int c = lane; c < channels; c += kWarpSize) {
    const float norm = (ToFloat(x[c]) - m) * s;
    const float dnorm = ToFloat(dy[c]) * ToFloat(weight[c]);
    dnorm_sum += dnorm;
    dnorm_norm_sum += dnorm * norm;
  }
  const float dnorm_mean = WarpSum(dnorm_sum) / channels;
  const float dnorm_norm_mean = WarpSum(dnorm_norm_sum) / channels;
  for (int c = lane; c < channels; c += kWarpSize) {
    const float norm = (ToFloat(x[c]) - m) * s;
    const float dnorm = ToFloat(dy[c]) * ToFloat(weight[c]);
    dx[c] = ToBf16(ToFloat(dx[c]) + s * (dnorm - dnorm_mean - norm * dnorm_norm_mean));
  }
}

__global__ void LayerNormBackwardParamsKernel(float* dweight, float* dbias, const bf16* dout,
                                              const bf16* inp, const float* mean, const float* rstd,
                                              int rows, int channels) {
  ColumnSums(
      dweight, dbias,
      [=](int n, int c) {
        const int64_t i = static_cast<int64_t>(n) * channels + c;
        const float dy = ToFloat(dout[i]);
        const float norm = (ToFloat(inp[i]) - mean[n]) * rstd[n];
        return make_float2(norm * dy, dy);
      },
      rows, channels);
}

// ---------------------------------------------------------------- bias

__global__ void BroadcastBiasKernel(bf16* out, const bf16* bias, int out_features, int64_t count) {
  PSHARD_FOR_EACH_ELEMENT(i, count) { out[i] = bias[i % out_features]; }
}

__global__ void BiasBackwardKernel(float* dbias, const bf16* dout, int rows, int out_features) {
  ColumnSums(
      dbias, static_cast<float*>(nullptr),
      [=](int n, int c) {
        return make_float2(ToFloat(dout[static_cast<int64_t>(n) * out_features + c]), 0.0f);
      },
      rows, out_features);
}

// ---------------------------------------------------------------- attention softmax

// One warp per row of [BH*T, T]. The exponentials are recomputed in the last
// pass instead of being stored, so a row needs no scratch.
__global__ void CausalSoftmaxForwardKernel(bf16* att, const float* scores, float scale,
                                           int64_t total_rows, int seq_len) {
  const int64_t row = WarpRow();
  if (row >= total_rows) return;
  const int lane = Lane();
  const int query = static_cast<int>(row % seq_len);
  const float* s = scores + row * seq_len;
  bf16* a = att + row * seq_len;
  float max_score = -INFINITY;
  for (int j = lane; j <= query; j += kWarpSize) max_score = fmaxf(max_score, s[j]);
  max_score = WarpMax(max_score);  // finite: j = 0 is always in the causal part
  float sum = 0.0f;
  for (int j = lane; j <= query; j += kWarpSize) sum += expf(scale * (s[j] - max_score));
  const float inv_sum = 1.0f / WarpSum(sum);
  for (int j = lane; j < seq_len; j += kWarpSize) {
    a[j] = j <= query ? ToBf16(expf(scale * (s[j] - max_score)) * inv_sum) : ToBf16(0.0f);
  }
}

__global__ void CausalSoftmaxBackwardKernel(bf16* dscores, const bf16* att, const float* datt,
                                            float scale, int64_t total_rows, int seq_len) {
  const int64_t row = WarpRow();
  if (row >= total_rows) return;
  const int lane = Lane();
  const int query = static_cast<int>(row % seq_len);
  const bf16* a = att + row * seq_len;
  const float* da = datt + row * seq_len;
  bf16* ds = dscores + row * seq_len;
  float dot = 0.0f;
  for (int j = lane; j <= query; j += kWarpSize) dot += ToFloat(a[j]) * da[j];
  dot = WarpSum(dot);
  for (int j = lane; j < seq_len; j += kWarpSize) {
    ds[j] = j <= query ? ToBf16(scale * ToFloat(a[j]) * (da[j] - dot)) : ToBf16(0.0f);
  }
}

// ---------------------------------------------------------------- gelu

// 0.5 (1 + tanh(u)) = sigmoid(2u), as in the CPU model.
__device__ __forceinline__ float GeluGate(float x) {
  const float u = kGeluScale * (x + kGeluCubic * x * x * x);
  return 1.0f / (1.0f + expf(-2.0f * u));
}

__global__ void GeluForwardKernel(bf16* out, const bf16* inp, int64_t count) {
  PSHARD_FOR_EACH_ELEMENT(i, count) {
    const float x = ToFloat(inp[i]);
    out[i] = ToBf16(x * GeluGate(x));
  }
}

__global__ void GeluBackwardKernel(bf16* dinp, const bf16* inp, const bf16* dout, int64_t count) {
  PSHARD_FOR_EACH_ELEMENT(i, count) {
    const float x = ToFloat(inp[i]);
    const float gate = GeluGate(x);
    const float du_dx = kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
    // d/dx [x sigmoid(2u)] = sigmoid(2u) + 2 x sigmoid(2u) (1 - sigmoid(2u)) du/dx
    dinp[i] = ToBf16((gate + 2.0f * x * gate * (1.0f - gate) * du_dx) * ToFloat(dout[i]));
  }
}

// ---------------------------------------------------------------- residual

__global__ void ResidualForwardKernel(bf16* out, const bf16* a, const bf16* b, int64_t count) {
  PSHARD_FOR_EACH_ELEMENT(i, count) { out[i] = ToBf16(ToFloat(a[i]) + ToFloat(b[i])); }
}

// ---------------------------------------------------------------- gradient sums

// __fadd_rn: a plain IEEE sum, never contracted into anything else.
__global__ void AddInPlaceKernel(float* a, const float* b, int64_t count) {
  PSHARD_FOR_EACH_ELEMENT(i, count) { a[i] = __fadd_rn(a[i], b[i]); }
}

// ---------------------------------------------------------------- loss

// One block per row: max, sum of exponentials, then loss and gradient.
__global__ void SoftmaxCrossEntropyKernel(bf16* logits, float* losses, const int32_t* targets,
                                          int vocab, float dlogit_scale) {
  const int64_t row = blockIdx.x;
  bf16* z = logits + row * vocab;
  const int target = targets[row];
  // Read before the last pass overwrites the row (the reductions between
  // them synchronise the block).
  const float target_logit = ToFloat(z[target]);
  float max_logit = -INFINITY;
  for (int v = threadIdx.x; v < vocab; v += blockDim.x) max_logit = fmaxf(max_logit, ToFloat(z[v]));
  max_logit = BlockReduce<true>(max_logit);
  float sum = 0.0f;
  for (int v = threadIdx.x; v < vocab; v += blockDim.x) sum += expf(ToFloat(z[v]) - max_logit);
  sum = BlockReduce<false>(sum);
  // -log softmax(z)[target] = log(sum) + max - z[target], exact even when the
  // target's probability underflows.
  if (threadIdx.x == 0) losses[row] = logf(sum) + max_logit - target_logit;
  const float inv_sum = 1.0f / sum;
  for (int v = threadIdx.x; v < vocab; v += blockDim.x) {
    const float p = expf(ToFloat(z[v]) - max_logit) * inv_sum;
    const float indicator = v == target ? 1.0f : 0.0f;
    z[v] = ToBf16((p - indicator) * dlogit_scale);
  }
}

// ---------------------------------------------------------------- conversion

__global__ void Fp32ToBf16Kernel(bf16* out, const float* in, int64_t count) {
  PSHARD_FOR_EACH_ELEMENT(i, count) { out[i] = ToBf16(in[i]); }
}

__global__ void Bf16ToFp32Kernel(float* out, const bf16* in, int64_t count) {
  PSHARD_FOR_EACH_ELEMENT(i, count) { out[i] = ToFloat(in[i]); }
}

#undef PSHARD_FOR_EACH_ELEMENT

}  // namespace

// ---------------------------------------------------------------- launchers

cudaError_t EncoderForward(bf16* out, const int32_t* tokens, const bf16* wte, const bf16* wpe,
                           int batch, int seq_len, int channels, cudaStream_t stream) {
  const int64_t count = static_cast<int64_t>(batch) * seq_len * channels;
  EncoderForwardKernel<<<ElementwiseBlocks(count), kThreads, 0, stream>>>(out, tokens, wte, wpe,
                                                                          seq_len, channels, count);
  return cudaGetLastError();
}

cudaError_t EncoderBackward(float* dwte, float* dwpe, const bf16* dout, TokenRows rows, int batch,
                            int seq_len, int channels, cudaStream_t stream) {
  const int64_t wpe_count = static_cast<int64_t>(seq_len) * channels;
  EncoderBackwardWpeKernel<<<ElementwiseBlocks(wpe_count), kThreads, 0, stream>>>(
      dwpe, dout, batch, seq_len, channels);
  if (const cudaError_t error = cudaGetLastError(); error != cudaSuccess) return error;
  if (rows.count == 0) return cudaSuccess;
  EncoderBackwardWteKernel<<<rows.count, kThreads, 0, stream>>>(dwte, dout, rows, channels);
  return cudaGetLastError();
}

cudaError_t LayerNormForward(bf16* out, float* mean, float* rstd, const bf16* inp,
                             const bf16* weight, const bf16* bias, int rows, int channels,
                             cudaStream_t stream) {
  LayerNormForwardKernel<<<WarpPerRowBlocks(rows), kThreads, 0, stream>>>(
      out, mean, rstd, inp, weight, bias, rows, channels);
  return cudaGetLastError();
}

cudaError_t LayerNormBackward(bf16* dinp, float* dweight, float* dbias, const bf16* dout,
                              const bf16* inp, const bf16* weight, const float* mean,
                              const float* rstd, int rows, int channels, cudaStream_t stream) {
  LayerNormBackwardInputKernel<<<WarpPerRowBlocks(rows), kThreads, 0, stream>>>(
      dinp, dout, inp, weight, mean, rstd, rows, channels);
  if (const cudaError_t error = cudaGetLastError(); error != cudaSuccess) return error;
  LayerNormBackwardParamsKernel<<<ColumnSumGrid(channels), ColumnSumBlock(), 0, stream>>>(
      dweight, dbias, dout, inp, mean, rstd, rows, channels);
  return cudaGetLastError();
}

cudaError_t BroadcastBias(bf16* out, const bf16* bias, int rows, int out_features,
                          cudaStream_t stream) {
  const int64_t count = static_cast<int64_t>(rows) * out_features;
  BroadcastBiasKernel<<<ElementwiseBlocks(count), kThreads, 0, stream>>>(out, bias, out_features,
                                                                         count);
  return cudaGetLastError();
}

cudaError_t BiasBackward(float* dbias, const bf16* dout, int rows, int out_features,
                         cudaStream_t stream) {
  BiasBackwardKernel<<<ColumnSumGrid(out_features), ColumnSumBlock(), 0, stream>>>(
      dbias, dout, rows, out_features);
  return cudaGetLastError();
}

cudaError_t CausalSoftmaxForward(bf16* att, const float* scores, float scale, int batch_heads,
                                 int seq_len, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(batch_heads) * seq_len;
  CausalSoftmaxForwardKernel<<<WarpPerRowBlocks(rows), kThreads, 0, stream>>>(att, scores, scale,
                                                                              rows, seq_len);
  return cudaGetLastError();
}

cudaError_t CausalSoftmaxBackward(bf16* dscores, const bf16* att, const float* datt, float scale,
                                  int batch_heads, int seq_len, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(batch_heads) * seq_len;
  CausalSoftmaxBackwardKernel<<<WarpPerRowBlocks(rows), kThreads, 0, stream>>>(
      dscores, att, datt, scale, rows, seq_len);
  return cudaGetLastError();
}

cudaError_t GeluForward(bf16* out, const bf16* inp, int64_t count, cudaStream_t stream) {
  GeluForwardKernel<<<ElementwiseBlocks(count), kThreads, 0, stream>>>(out, inp, count);
  return cudaGetLastError();
}

cudaError_t GeluBackward(bf16* dinp, const bf16* inp, const bf16* dout, int64_t count,
                         cudaStream_t stream) {
  GeluBackwardKernel<<<ElementwiseBlocks(count), kThreads, 0, stream>>>(dinp, inp, dout, count);
  return cudaGetLastError();
}

cudaError_t ResidualForward(bf16* out, const bf16* a, const bf16* b, int64_t count,
                            cudaStream_t stream) {
  ResidualForwardKernel<<<ElementwiseBlocks(count), kThreads, 0, stream>>>(out, a, b, count);
  return cudaGetLastError();
}

cudaError_t SoftmaxCrossEntropy(bf16* logits_to_dlogits, float* losses, const int32_t* targets,
                                int rows, int vocab, cudaStream_t stream) {
  SoftmaxCrossEntropyKernel<<<rows, kThreads, 0, stream>>>(logits_to_dlogits, losses, targets,
                                                           vocab, 1.0f / rows);
  return cudaGetLastError();
}

cudaError_t AddInPlace(float* a, const float* b, int64_t count, cudaStream_t stream) {
  AddInPlaceKernel<<<ElementwiseBlocks(count), kThreads, 0, stream>>>(a, b, count);
  return cudaGetLastError();
}

cudaError_t Fp32ToBf16(bf16* out, const float* in, int64_t count, cudaStream_t stream) {
  Fp32ToBf16Kernel<<<ElementwiseBlocks(count), kThreads, 0, stream>>>(out, in, count);
  return cudaGetLastError();
}

cudaError_t Bf16ToFp32(float* out, const bf16* in, int64_t count, cudaStream_t stream) {
  Bf16ToFp32Kernel<<<ElementwiseBlocks(count), kThreads, 0, stream>>>(out, in, count);
  return cudaGetLastError();
}

}  // namespace pshard::internal
