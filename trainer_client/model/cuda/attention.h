// Causal self-attention without the T×T matrices: the scores of a tile of
// queries against a tile of keys live in shared memory only, the softmax is
// taken online (running max and sum per query), and backward recomputes the
// probabilities from the saved per-query log-sum-exp. Tensor-core products
// (WMMA, bf16 in, fp32 accumulate) on 64×64 tiles; tiles above the diagonal
// are never computed.
//
// Layout as in CudaGpt: qkv [B,T,3C] with q, k, v side by side, each H heads
// of kFusedHeadSize; out [B,T,C] with the heads concatenated. Deterministic:
// every sum runs in a fixed order, and backward computes dK, dV per key tile
// and dQ per query tile in separate kernels instead of adding into dQ with
// atomics.
#ifndef PSHARD_TRAINER_CLIENT_MODEL_CUDA_ATTENTION_H_
#define PSHARD_TRAINER_CLIENT_MODEL_CUDA_ATTENTION_H_

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

namespace pshard::internal {

/// The head size the fused kernels are built for (GPT-2's 768 / 12).
constexpr int kFusedHeadSize = 64;

/// out = softmax(scale · q kᵀ, causal) v per head; lse [B,H,T] (fp32)
/// receives each query's log-sum-exp of its scaled scores, for backward.
cudaError_t FusedAttentionForward(__nv_bfloat16* out, float* lse, const __nv_bfloat16* qkv, int batch,
                                  int seq_len, int heads, float scale, cudaStream_t stream);

/// dqkv [B,T,3C] (overwritten) from dout [B,T,C], the forward's qkv, out and
/// lse. `delta` is scratch of [B,H,T] floats (rowsum of dout ⊙ out).
cudaError_t FusedAttentionBackward(__nv_bfloat16* dqkv, float* delta, const __nv_bfloat16* dout,
                                   const __nv_bfloat16* out, const __nv_bfloat16* qkv, const float* lse,
                                   int batch, int seq_len, int heads, float scale, cudaStream_t stream);

}  // namespace pshard::internal

#endif  // PSHARD_TRAINER_CLIENT_MODEL_CUDA_ATTENTION_H_
