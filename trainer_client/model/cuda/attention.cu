#include "trainer_client/model/cuda/attention.h"

#include <mma.h>

#include <cmath>
#include <cstdint>

#include "trainer_client/model/cuda/device_math.cuh"

namespace pshard::internal {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kHs = kFusedHeadSize;
constexpr int kTile = 64;                 // queries or keys per tile
constexpr int kWarps = 4;                 // each warp owns 16 rows of a tile
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kFrag = 16;                 // WMMA tile edge
constexpr int kLdH = kHs + 8;             // bf16 tile row stride (padding against bank conflicts)
constexpr int kLdF = kTile + 4;           // fp32 tile row stride
constexpr int kHalfTile = kTile * kLdH;   // elements of a bf16 tile
constexpr int kFloatTile = kTile * kLdF;  // elements of an fp32 tile
static_assert(kHs == kTile, "the fp32 tiles hold scores [kTile x kTile] and outputs [kTile x kHs] alike");
static_assert(kWarps * kFrag == kTile, "each warp owns 16 rows");

using FragA = wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, bf16, wmma::row_major>;
using FragB = wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, bf16, wmma::row_major>;
using FragBt = wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, bf16, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, kFrag, kFrag, kFrag, float>;

// Shared memory of each kernel: `bf16_tiles` tiles of [kTile][kLdH] bf16,
// `float_tiles` of [kTile][kLdF] fp32, and two per-row vectors.
constexpr size_t SharedBytes(int bf16_tiles, int float_tiles) {
  return bf16_tiles * kHalfTile * sizeof(bf16) + float_tiles * kFloatTile * sizeof(float) +
         2 * kTile * sizeof(float);
}

// Copies rows [row0, row0 + kTile) of a head's kHs columns from `src` (row
// stride `ld` elements, 16-byte aligned rows) into `tile`; rows at or past
// `rows` become zero.
__device__ void LoadTile(bf16* tile, const bf16* src, int64_t ld, int row0, int rows) {
  constexpr int kVectors = kHs / 8;  // 16-byte vectors per row
  for (int i = threadIdx.x; i < kTile * kVectors; i += blockDim.x) {
    const int r = i / kVectors;
    const int c = (i % kVectors) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row0 + r < rows) v = *reinterpret_cast<const uint4*>(src + (row0 + r) * ld + c);
    *reinterpret_cast<uint4*>(tile + r * kLdH + c) = v;
  }
}

// A warp's 16 rows of a [.][kLdH] tile (kHs columns) as WMMA A operands,
// one per 16 columns: loaded once where the rows stay for the whole block.
using RowFragments = FragA[kHs / kFrag];

__device__ void LoadRows(RowFragments& a, const bf16* tile, int r0) {
  for (int k = 0; k < kHs / kFrag; ++k) wmma::load_matrix_sync(a[k], tile + r0 * kLdH + k * kFrag, kLdH);
}

// acc[n] (n over kTile / 16 column blocks) = a · bᵀ: a is a warp's 16 rows
// (inner dimension kHs), b a [kTile][kLdH] tile whose rows are the columns
// of the product (transposed on load).
__device__ void WarpProductTransposed(FragC (&acc)[kTile / kFrag], const RowFragments& a, const bf16* b) {
  for (FragC& c : acc) wmma::fill_fragment(c, 0.0f);
  for (int k = 0; k < kHs / kFrag; ++k) {
    for (int n = 0; n < kTile / kFrag; ++n) {
      FragBt fb;
      wmma::load_matrix_sync(fb, b + n * kFrag * kLdH + k * kFrag, kLdH);
      wmma::mma_sync(acc[n], a[k], fb, acc[n]);
    }
  }
}

// acc[n] += rows [r0, r0 + 16) of a ([.][kLdH]) times the row-major b
// ([kTile][kLdH]).
__device__ void WarpProductAdd(FragC (&acc)[kTile / kFrag], const bf16* a, int r0, const bf16* b) {
  for (int k = 0; k < kTile / kFrag; ++k) {
    FragA fa;
    wmma::load_matrix_sync(fa, a + r0 * kLdH + k * kFrag, kLdH);
    for (int n = 0; n < kHs / kFrag; ++n) {
      FragB fb;
      wmma::load_matrix_sync(fb, b + k * kFrag * kLdH + n * kFrag, kLdH);
      wmma::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
}

__device__ void StoreRows(float* tile, int r0, const FragC (&acc)[kTile / kFrag]) {
  for (int n = 0; n < kTile / kFrag; ++n) {
    wmma::store_matrix_sync(tile + r0 * kLdF + n * kFrag, acc[n], kLdF, wmma::mem_row_major);
  }
}

// Writes rows [r0, r0 + 16) of the fp32 `tile` as bf16 to dst rows
// row0 + r (row stride ld), for rows below `rows`.
__device__ void WriteRows(bf16* dst, int64_t ld, int row0, int rows, const float* tile, int r0, float scale) {
  const int lane = threadIdx.x % kWarpSize;
  for (int r = r0; r < r0 + kFrag; ++r) {
    if (row0 + r >= rows) break;
    for (int c = lane; c < kHs; c += kWarpSize) dst[(row0 + r) * ld + c] = ToBf16(tile[r * kLdF + c] * scale);
  }
}

// The head a block works on (blockIdx.y = b · heads + h), where its data
// lives, and the calling thread's place in the block.
struct BlockHead {
  int tiles;           // 64-row tiles of the sequence
  int c;               // model width: row stride of out and dout
  int64_t ld;          // row stride of qkv and dqkv (3C)
  int64_t qkv_offset;  // this head's q columns of row 0 in qkv and dqkv
  int64_t out_offset;  // this head's columns of row 0 in out and dout
  int64_t stats;       // this head's row 0 in lse and delta ([B,H,T])
  int r0;              // first of this warp's 16 rows in a tile
  int lane;
};

__device__ BlockHead ThisBlockHead(int seq_len, int heads) {
  BlockHead head;
  const int b = blockIdx.y / heads;
  const int h = blockIdx.y % heads;
  head.tiles = (seq_len + kTile - 1) / kTile;
  head.c = heads * kHs;
  head.ld = 3 * int64_t{head.c};
  head.qkv_offset = int64_t{b} * seq_len * head.ld + h * kHs;
  head.out_offset = int64_t{b} * seq_len * head.c + h * kHs;
  head.stats = int64_t{blockIdx.y} * seq_len;
  head.r0 = threadIdx.x / kWarpSize * kFrag;
  head.lane = threadIdx.x % kWarpSize;
  return head;
}

// The log-sum-exp and delta of the queries of the tile at q0 (0 past the end).
__device__ void LoadQueryStats(float* tile_lse, float* tile_delta, const float* lse, const float* delta,
                               const BlockHead& head, int q0, int seq_len) {
  for (int i = threadIdx.x; i < kTile; i += blockDim.x) {
    tile_lse[i] = q0 + i < seq_len ? lse[head.stats + q0 + i] : 0.0f;
    tile_delta[i] = q0 + i < seq_len ? delta[head.stats + q0 + i] : 0.0f;
  }
}

// Query tile qt of head (b, h): a block per (query tile, batch·head), the
// longest rows (last tiles) launched first. Each warp owns 16 query rows
// and, after the block has loaded a key tile, works on them alone.
__global__ void __launch_bounds__(kThreads) ForwardKernel(bf16* out, float* lse, const bf16* qkv, int seq_len,
                                                          int heads, float scale) {
  extern __shared__ __align__(128) unsigned char shared[];
  bf16* q = reinterpret_cast<bf16*>(shared);
  bf16* k = q + kHalfTile;
  bf16* v = k + kHalfTile;
  bf16* p = v + kHalfTile;
  float* s = reinterpret_cast<float*>(p + kHalfTile);
  float* o = s + kFloatTile;
  float* row_max = o + kFloatTile;
  float* row_sum = row_max + kTile;

  const BlockHead bh = ThisBlockHead(seq_len, heads);
  const bf16* head = qkv + bh.qkv_offset;
  const int qt = bh.tiles - 1 - static_cast<int>(blockIdx.x);
  const int q0 = qt * kTile;

  LoadTile(q, head, bh.ld, q0, seq_len);
  for (int i = threadIdx.x; i < kFloatTile; i += blockDim.x) o[i] = 0.0f;
  for (int i = threadIdx.x; i < kTile; i += blockDim.x) {
    row_max[i] = -INFINITY;
    row_sum[i] = 0.0f;
  }
  __syncthreads();
  RowFragments q_rows;  // the warp's queries, for every key tile
  LoadRows(q_rows, q, bh.r0);
  for (int kt = 0; kt <= qt; ++kt) {
    __syncthreads();  // every warp is done with the previous key tile
    LoadTile(k, head + bh.c, bh.ld, kt * kTile, seq_len);
    LoadTile(v, head + 2 * bh.c, bh.ld, kt * kTile, seq_len);
    __syncthreads();
    FragC acc[kTile / kFrag];
    WarpProductTransposed(acc, q_rows, k);  // scores of the warp's rows: q kᵀ
    StoreRows(s, bh.r0, acc);
    __syncwarp();
    // Online softmax, one row at a time; each lane holds two of its columns.
    for (int r = bh.r0; r < bh.r0 + kFrag; ++r) {
      const int i = q0 + r;
      float x[2];
      float tile_max = -INFINITY;
      for (int t = 0; t < 2; ++t) {
        const int j = kt * kTile + bh.lane + t * kWarpSize;
        x[t] = j <= i && j < seq_len ? s[r * kLdF + bh.lane + t * kWarpSize] * scale : -INFINITY;
        tile_max = fmaxf(tile_max, x[t]);
      }
      tile_max = WarpMax(tile_max);
      const float old_max = row_max[r];
      const float new_max = fmaxf(old_max, tile_max);
      float tile_sum = 0.0f;
      for (int t = 0; t < 2; ++t) {
        const float e = x[t] == -INFINITY ? 0.0f : expf(x[t] - new_max);
        p[r * kLdH + bh.lane + t * kWarpSize] = ToBf16(e);
        tile_sum += e;
      }
      tile_sum = WarpSum(tile_sum);
      // The first tile holds key 0, which every query sees: from then on
      // the running max is finite.
      const float rescale = old_max == -INFINITY ? 0.0f : expf(old_max - new_max);
      for (int col = bh.lane; col < kHs; col += kWarpSize) o[r * kLdF + col] *= rescale;
      __syncwarp();
      if (bh.lane == 0) {
        row_sum[r] = row_sum[r] * rescale + tile_sum;
        row_max[r] = new_max;
      }
    }
    __syncwarp();
    // o += p v for the warp's rows.
    for (int n = 0; n < kHs / kFrag; ++n) {
      wmma::load_matrix_sync(acc[n], o + bh.r0 * kLdF + n * kFrag, kLdF, wmma::mem_row_major);
    }
    WarpProductAdd(acc, p, bh.r0, v);
    StoreRows(o, bh.r0, acc);
    __syncwarp();
  }
  bf16* dst = out + bh.out_offset;
  for (int r = bh.r0; r < bh.r0 + kFrag; ++r) {
    const int i = q0 + r;
    if (i >= seq_len) break;
    const float inv = 1.0f / row_sum[r];
    for (int col = bh.lane; col < kHs; col += kWarpSize) dst[int64_t{i} * bh.c + col] = ToBf16(o[r * kLdF + col] * inv);
    if (bh.lane == 0) lse[bh.stats + i] = row_max[r] + logf(row_sum[r]);
  }
}

// delta[b,h,i] = sum over the head's columns of dout ⊙ out: one warp per
// (b, h, i), the columns summed by a fixed butterfly.
__global__ void DeltaKernel(float* delta, const bf16* dout, const bf16* out, int batch, int seq_len, int heads) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  if (row >= int64_t{batch} * heads * seq_len) return;
  const int lane = threadIdx.x % kWarpSize;
  const int i = static_cast<int>(row % seq_len);
  const int64_t bh = row / seq_len;
  const int b = static_cast<int>(bh / heads);
  const int h = static_cast<int>(bh % heads);
  const int64_t offset = (int64_t{b} * seq_len + i) * heads * kHs + h * kHs;
  float sum = 0.0f;
  for (int col = lane; col < kHs; col += kWarpSize) sum += ToFloat(dout[offset + col]) * ToFloat(out[offset + col]);
  sum = WarpSum(sum);
  if (lane == 0) delta[row] = sum;
}

// Key tile kt of head (b, h): dK and dV summed over the query tiles at and
// after it, in order. Each warp owns 16 key rows (transposed products:
// sᵀ = k qᵀ, dpᵀ = v doᵀ).
__global__ void __launch_bounds__(kThreads) KeyValueGradKernel(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                                               const float* lse, const float* delta,
                                                               int seq_len, int heads, float scale) {
  extern __shared__ __align__(128) unsigned char shared[];
  bf16* k = reinterpret_cast<bf16*>(shared);
  bf16* v = k + kHalfTile;
  bf16* q = v + kHalfTile;
  bf16* dout_tile = q + kHalfTile;
  bf16* pt = dout_tile + kHalfTile;   // probabilities, transposed, bf16
  bf16* dst = pt + kHalfTile;         // score gradients, transposed, bf16
  float* st = reinterpret_cast<float*>(dst + kHalfTile);
  float* dpt = st + kFloatTile;
  float* tile_lse = dpt + kFloatTile;
  float* tile_delta = tile_lse + kTile;

  const BlockHead bh = ThisBlockHead(seq_len, heads);
  const bf16* head = qkv + bh.qkv_offset;
  const bf16* dout_head = dout + bh.out_offset;
  const int kt = blockIdx.x;  // the first tiles have the most queries after them

  LoadTile(k, head + bh.c, bh.ld, kt * kTile, seq_len);
  LoadTile(v, head + 2 * bh.c, bh.ld, kt * kTile, seq_len);
  __syncthreads();
  RowFragments k_rows, v_rows;  // the warp's keys and values, for every query tile
  LoadRows(k_rows, k, bh.r0);
  LoadRows(v_rows, v, bh.r0);
  FragC dk[kHs / kFrag], dv[kHs / kFrag];
  for (int n = 0; n < kHs / kFrag; ++n) {
    wmma::fill_fragment(dk[n], 0.0f);
    wmma::fill_fragment(dv[n], 0.0f);
  }
  for (int qt = kt; qt < bh.tiles; ++qt) {
    const int q0 = qt * kTile;
    __syncthreads();  // every warp is done with the previous query tile
    LoadTile(q, head, bh.ld, q0, seq_len);
    LoadTile(dout_tile, dout_head, bh.c, q0, seq_len);
    LoadQueryStats(tile_lse, tile_delta, lse, delta, bh, q0, seq_len);
    __syncthreads();
    FragC acc[kTile / kFrag];
    WarpProductTransposed(acc, k_rows, q);  // sᵀ = k qᵀ
    StoreRows(st, bh.r0, acc);
    WarpProductTransposed(acc, v_rows, dout_tile);  // dpᵀ = v doᵀ
    StoreRows(dpt, bh.r0, acc);
    __syncwarp();
    for (int r = bh.r0; r < bh.r0 + kFrag; ++r) {
      const int j = kt * kTile + r;
      for (int col = bh.lane; col < kTile; col += kWarpSize) {
        const int i = q0 + col;
        const bool seen = j <= i && i < seq_len && j < seq_len;
        const float prob = seen ? expf(st[r * kLdF + col] * scale - tile_lse[col]) : 0.0f;
        pt[r * kLdH + col] = ToBf16(prob);
        dst[r * kLdH + col] = ToBf16(prob * (dpt[r * kLdF + col] - tile_delta[col]) * scale);
      }
    }
    __syncwarp();
    WarpProductAdd(dv, pt, bh.r0, dout_tile);  // dv += pᵀ do
    WarpProductAdd(dk, dst, bh.r0, q);         // dk += dsᵀ q
  }
  __syncwarp();
  bf16* dhead = dqkv + bh.qkv_offset;
  StoreRows(st, bh.r0, dk);
  StoreRows(dpt, bh.r0, dv);
  __syncwarp();
  WriteRows(dhead + bh.c, bh.ld, kt * kTile, seq_len, st, bh.r0, 1.0f);
  WriteRows(dhead + 2 * bh.c, bh.ld, kt * kTile, seq_len, dpt, bh.r0, 1.0f);
}

// Query tile qt of head (b, h): dQ summed over the key tiles up to it, in
// order. Each warp owns 16 query rows.
__global__ void __launch_bounds__(kThreads) QueryGradKernel(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                                            const float* lse, const float* delta, int seq_len,
                                                            int heads, float scale) {
  extern __shared__ __align__(128) unsigned char shared[];
  bf16* q = reinterpret_cast<bf16*>(shared);
  bf16* dout_tile = q + kHalfTile;
  bf16* k = dout_tile + kHalfTile;
  bf16* v = k + kHalfTile;
  bf16* ds = v + kHalfTile;  // score gradients, bf16
  float* s = reinterpret_cast<float*>(ds + kHalfTile);
  float* dp = s + kFloatTile;
  float* tile_lse = dp + kFloatTile;
  float* tile_delta = tile_lse + kTile;

  const BlockHead bh = ThisBlockHead(seq_len, heads);
  const bf16* head = qkv + bh.qkv_offset;
  const int qt = bh.tiles - 1 - static_cast<int>(blockIdx.x);
  const int q0 = qt * kTile;

  LoadTile(q, head, bh.ld, q0, seq_len);
  LoadTile(dout_tile, dout + bh.out_offset, bh.c, q0, seq_len);
  LoadQueryStats(tile_lse, tile_delta, lse, delta, bh, q0, seq_len);
  __syncthreads();
  RowFragments q_rows, dout_rows;  // the warp's queries and their output gradients, for every key tile
  LoadRows(q_rows, q, bh.r0);
  LoadRows(dout_rows, dout_tile, bh.r0);
  FragC dq[kHs / kFrag];
  for (FragC& f : dq) wmma::fill_fragment(f, 0.0f);
  for (int kt = 0; kt <= qt; ++kt) {
    __syncthreads();  // every warp is done with the previous key tile
    LoadTile(k, head + bh.c, bh.ld, kt * kTile, seq_len);
    LoadTile(v, head + 2 * bh.c, bh.ld, kt * kTile, seq_len);
    __syncthreads();
    FragC acc[kTile / kFrag];
    WarpProductTransposed(acc, q_rows, k);  // s = q kᵀ
    StoreRows(s, bh.r0, acc);
    WarpProductTransposed(acc, dout_rows, v);  // dp = do vᵀ
    StoreRows(dp, bh.r0, acc);
    __syncwarp();
    for (int r = bh.r0; r < bh.r0 + kFrag; ++r) {
      const int i = q0 + r;
      for (int col = bh.lane; col < kTile; col += kWarpSize) {
        const int j = kt * kTile + col;
        const bool seen = j <= i && i < seq_len && j < seq_len;
        const float prob = seen ? expf(s[r * kLdF + col] * scale - tile_lse[r]) : 0.0f;
        ds[r * kLdH + col] = ToBf16(prob * (dp[r * kLdF + col] - tile_delta[r]) * scale);
      }
    }
    __syncwarp();
    WarpProductAdd(dq, ds, bh.r0, k);  // dq += ds k
  }
  __syncwarp();
  StoreRows(s, bh.r0, dq);
  __syncwarp();
  WriteRows(dqkv + bh.qkv_offset, bh.ld, q0, seq_len, s, bh.r0, 1.0f);
}

// Opts a kernel into more than the default 48 KiB of shared memory.
template <typename... Params, typename... Args>
cudaError_t LaunchWithShared(void (*kernel)(Params...), dim3 grid, size_t shared, cudaStream_t stream,
                             Args... args) {
  if (const cudaError_t e =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared));
      e != cudaSuccess) {
    return e;
  }
  kernel<<<grid, kThreads, shared, stream>>>(args...);
  return cudaGetLastError();
}

}  // namespace

cudaError_t FusedAttentionForward(bf16* out, float* lse, const bf16* qkv, int batch, int seq_len, int heads,
                                  float scale, cudaStream_t stream) {
  const dim3 grid((seq_len + kTile - 1) / kTile, batch * heads);
  return LaunchWithShared(ForwardKernel, grid, SharedBytes(4, 2), stream, out, lse, qkv, seq_len, heads, scale);
}

cudaError_t FusedAttentionBackward(bf16* dqkv, float* delta, const bf16* dout, const bf16* out, const bf16* qkv,
                                   const float* lse, int batch, int seq_len, int heads, float scale,
                                   cudaStream_t stream) {
  const int64_t rows = int64_t{batch} * heads * seq_len;
  constexpr int kRowsPerBlock = 8;
  DeltaKernel<<<static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock), kRowsPerBlock * kWarpSize, 0,
                stream>>>(delta, dout, out, batch, seq_len, heads);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  const dim3 grid((seq_len + kTile - 1) / kTile, batch * heads);
  if (const cudaError_t e = LaunchWithShared(KeyValueGradKernel, grid, SharedBytes(6, 2), stream, dqkv, dout, qkv,
                                             lse, static_cast<const float*>(delta), seq_len, heads, scale);
      e != cudaSuccess) {
    return e;
  }
  return LaunchWithShared(QueryGradKernel, grid, SharedBytes(5, 2), stream, dqkv, dout, qkv, lse,
                          static_cast<const float*>(delta), seq_len, heads, scale);
}

}  // namespace pshard::internal
