// The CUDA kernels of a GPT-2 forward and backward pass, one launcher per op
// with its backward next to it. The matrix products (linear layers, attention
// scores and values) are cuBLAS calls in cuda_gpt.cc; everything else is here.
//
// Conventions shared by every launcher:
//  * tensors are dense, row-major device arrays with their sizes named;
//    shapes in comments use B = batch, T = seq_len, C = channels, N = rows
//    (usually B * T), V = vocab, BH = batch * heads;
//  * activations are bf16; every sum, mean, variance, exp and log is taken in
//    fp32, and a result is rounded to bf16 once, when it is stored, with
//    round-to-nearest-even exactly as common/bf16.h's FloatToBf16;
//  * parameter gradients are fp32 and are OVERWRITTEN; activation gradients
//    are overwritten too, except where a comment says `+=` (the residual
//    stream, whose backward is the identity, accumulates in place);
//  * every reduction runs in a fixed order (warp butterflies, fixed loops,
//    no atomics), so the same inputs give bit-identical outputs on every run;
//  * a launcher enqueues on `stream` and returns the launch status
//    (cudaGetLastError), never blocking; errors of the kernel itself surface
//    at the next synchronising call.
#ifndef PSHARD_TRAINER_CLIENT_MODEL_CUDA_KERNELS_H_
#define PSHARD_TRAINER_CLIENT_MODEL_CUDA_KERNELS_H_

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace pshard::internal {

using bf16 = __nv_bfloat16;

/// The positions of a batch grouped by token id, built on the host from the
/// batch's tokens: distinct token `token[k]` (k in [0, count), ascending)
/// occurs at the positions position[begin[k]] .. position[begin[k+1] - 1]
/// (ascending) of the flattened [B*T] batch. All three arrays are on the
/// device; begin has count + 1 entries.
struct TokenRows {
  const int32_t* token = nullptr;
  const int32_t* begin = nullptr;
  const int32_t* position = nullptr;
  int count = 0;
};

// ---------------------------------------------------------------- encoder

/// out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]. out [B,T,C], tokens [B,T],
/// wte [V,C], wpe [>=T,C].
cudaError_t EncoderForward(bf16* out, const int32_t* tokens, const bf16* wte, const bf16* wpe,
                           int batch, int seq_len, int channels, cudaStream_t stream);

/// dwpe[t,:] = sum over b of dout[b,t,:] for t < T; dwte[v,:] = sum of
/// dout over the positions holding token v, for the tokens in `rows`. Rows
/// of dwte and dwpe that the batch does not touch are left as they are (the
/// caller zeroes them). Deterministic without atomics: one block per
/// distinct token adds that token's positions in ascending order.
cudaError_t EncoderBackward(float* dwte, float* dwpe, const bf16* dout, TokenRows rows, int batch,
                            int seq_len, int channels, cudaStream_t stream);

// ---------------------------------------------------------------- layernorm

/// Normalises each row of inp [N,C] (eps 1e-5), scales by weight [C] and
/// shifts by bias [C]; saves the fp32 mean [N] and 1/stddev rstd [N].
cudaError_t LayerNormForward(bf16* out, float* mean, float* rstd, const bf16* inp,
                             const bf16* weight, const bf16* bias, int rows, int channels,
                             cudaStream_t stream);

/// dinp [N,C] += gradient wrt inp; dweight [C] and dbias [C] = gradients wrt
/// weight and bias (sums over rows), given dout [N,C] and the saved stats.
cudaError_t LayerNormBackward(bf16* dinp, float* dweight, float* dbias, const bf16* dout,
                              const bf16* inp, const bf16* weight, const float* mean,
                              const float* rstd, int rows, int channels, cudaStream_t stream);

// ---------------------------------------------------------------- bias

/// out[n,:] = bias for every row of out [N,OC]: the linear layers start
/// from the bias and let the GEMM add x W^T on top (beta = 1), so the sum is
/// rounded to bf16 once.
cudaError_t BroadcastBias(bf16* out, const bf16* bias, int rows, int out_features,
                          cudaStream_t stream);

/// dbias [OC] = column sums of dout [N,OC].
cudaError_t BiasBackward(float* dbias, const bf16* dout, int rows, int out_features,
                         cudaStream_t stream);

// ---------------------------------------------------------------- attention softmax

/// For each of the BH*T rows of scores [BH,T,T] (fp32, query i = row % T):
/// att[j] = softmax_j(scale * scores[j]) over the causal part j <= i, and 0
/// above the diagonal; att [BH,T,T] is bf16.
cudaError_t CausalSoftmaxForward(bf16* att, const float* scores, float scale, int batch_heads,
                                 int seq_len, cudaStream_t stream);

/// Gradient wrt the unscaled scores, given datt [BH,T,T] (fp32) and the
/// saved att: dscores[j] = scale * att[j] * (datt[j] - sum_k att[k] datt[k])
/// for j <= i, 0 above the diagonal; dscores is bf16.
cudaError_t CausalSoftmaxBackward(bf16* dscores, const bf16* att, const float* datt, float scale,
                                  int batch_heads, int seq_len, cudaStream_t stream);

// ---------------------------------------------------------------- gelu

/// out[i] = GELU(inp[i]), GPT-2's tanh approximation, evaluated as
/// x * sigmoid(2u) with u = sqrt(2/pi) (x + 0.044715 x^3) like the CPU model.
cudaError_t GeluForward(bf16* out, const bf16* inp, int64_t count, cudaStream_t stream);

/// dinp[i] = GELU'(inp[i]) * dout[i].
cudaError_t GeluBackward(bf16* dinp, const bf16* inp, const bf16* dout, int64_t count,
                         cudaStream_t stream);

// ---------------------------------------------------------------- residual

/// out[i] = a[i] + b[i] (out may alias a or b). Its backward is the
/// identity: the model keeps one gradient of the residual stream and lets
/// LayerNormBackward add each branch's contribution to it (`+=`).
cudaError_t ResidualForward(bf16* out, const bf16* a, const bf16* b, int64_t count,
                            cudaStream_t stream);

// ---------------------------------------------------------------- loss

/// Fused softmax cross-entropy, forward and backward in one pass over the
/// logits [N,V]: losses[n] = -log softmax(logits[n])[targets[n]] (fp32), and
/// logits is overwritten with the gradient of the MEAN loss over the N rows,
/// (softmax - onehot(target)) / N.
cudaError_t SoftmaxCrossEntropy(bf16* logits_to_dlogits, float* losses, const int32_t* targets,
                                int rows, int vocab, cudaStream_t stream);

// ---------------------------------------------------------------- gradient sums

/// a[i] = a[i] + b[i] in fp32, rounded once: bit for bit the sum the host's
/// TreeReducer forms, so micro-batch gradients summed here in the reduction
/// tree's order equal the host's sum.
cudaError_t AddInPlace(float* a, const float* b, int64_t count, cudaStream_t stream);

// ---------------------------------------------------------------- conversion

/// out[i] = in[i] rounded to bf16 to nearest, ties to even; NaN stays a
/// (quiet) NaN with its sign: bit for bit common/bf16.h's FloatToBf16.
cudaError_t Fp32ToBf16(bf16* out, const float* in, int64_t count, cudaStream_t stream);

/// out[i] = in[i] widened exactly.
cudaError_t Bf16ToFp32(float* out, const bf16* in, int64_t count, cudaStream_t stream);

}  // namespace pshard::internal

#endif  // PSHARD_TRAINER_CLIENT_MODEL_CUDA_KERNELS_H_
