// The operations of a GPT-2 forward and backward pass on the CPU, one function
// per op with its backward next to it.
//
// Conventions shared by every op:
//  * tensors are dense, row-major, and passed as raw pointers with their sizes
//    named; shapes in comments use B = batch, T = seq_len, C = channels,
//    H = num_heads, N = rows (usually B * T), V = vocab, IC/OC = in/out
//    features;
//  * forward functions overwrite their outputs;
//  * backward functions ACCUMULATE (+=) into every gradient they write, so the
//    caller zeroes a gradient buffer once before the first contribution;
//  * T is float or double (double is used to check gradients numerically);
//  * nothing here allocates, spawns threads or keeps state, and every loop has
//    a fixed order, so the same inputs always give bit-identical outputs
//    (given a BLAS that is deterministic for a fixed thread count).
#ifndef PSHARD_TRAINER_CLIENT_MODEL_OPS_H_
#define PSHARD_TRAINER_CLIENT_MODEL_OPS_H_

#include <cstdint>

namespace pshard {

/// out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]. out is [B,T,C], tokens [B,T],
/// wte [V,C], wpe [>=T,C]. Token ids must already be validated.
template <typename T>
void EncoderForward(T* out, const int32_t* tokens, const T* wte, const T* wpe, int batch,
                    int seq_len, int channels);

/// dwte[tokens[b,t],:] += dout[b,t,:]; dwpe[t,:] += dout[b,t,:].
template <typename T>
void EncoderBackward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int batch, int seq_len,
                     int channels);

/// Normalises each row of inp [N,C] to zero mean and unit variance (eps
/// 1e-5), then scales by weight [C] and shifts by bias [C]. Saves the per-row
/// mean [N] and reciprocal standard deviation rstd [N] for backward.
template <typename T>
void LayerNormForward(T* out, T* mean, T* rstd, const T* inp, const T* weight, const T* bias,
                      int rows, int channels);

/// Gradients of LayerNormForward wrt inp, weight and bias, given dout [N,C].
template <typename T>
void LayerNormBackward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                       const T* mean, const T* rstd, int rows, int channels);

/// out [N,OC] = inp [N,IC] * weight^T + bias; weight is stored [OC,IC],
/// bias [OC] may be null (no bias).
template <typename T>
void LinearForward(T* out, const T* inp, const T* weight, const T* bias, int rows, int in_features,
                   int out_features);

/// dinp += dout * weight; dweight += dout^T * inp; dbias += column sums of
/// dout. Any of dinp, dweight, dbias may be null to skip that gradient.
template <typename T>
void LinearBackward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                    int rows, int in_features, int out_features);

/// Causal multi-head self-attention. qkv [B,T,3C] holds the query, key and
/// value projections side by side (each C = H * head_size wide); out [B,T,C]
/// is the attention output with the heads concatenated. att [B,H,T,T]
/// receives the softmax probabilities (zero above the diagonal), kept for
/// backward. Scores are scaled by 1/sqrt(head_size).
template <typename T>
void AttentionForward(T* out, T* att, const T* qkv, int batch, int seq_len, int channels,
                      int num_heads);

/// Gradient of AttentionForward wrt qkv, given dout [B,T,C] and the saved
/// att. scratch must hold 2 * T * T elements (overwritten).
template <typename T>
void AttentionBackward(T* dqkv, T* scratch, const T* dout, const T* qkv, const T* att, int batch,
                       int seq_len, int channels, int num_heads);

/// out[i] = GELU(inp[i]) with GPT-2's tanh approximation, for `count` elements.
template <typename T>
void GeluForward(T* out, const T* inp, int64_t count);

/// dinp[i] += GELU'(inp[i]) * dout[i].
template <typename T>
void GeluBackward(T* dinp, const T* inp, const T* dout, int64_t count);

/// out[i] = a[i] + b[i] for `count` elements (out may alias a or b).
template <typename T>
void ResidualForward(T* out, const T* a, const T* b, int64_t count);

/// da[i] += dout[i]; db[i] += dout[i].
template <typename T>
void ResidualBackward(T* da, T* db, const T* dout, int64_t count);

/// Softmax of each row of logits [N,V] into probs [N,V] (may alias logits);
/// returns the mean over rows of the cross-entropy -log probs[n, targets[n]].
/// Target ids must already be validated.
template <typename T>
T SoftmaxCrossEntropyForward(T* probs, const T* logits, const int32_t* targets, int rows,
                             int vocab);

/// dlogits += dloss * (probs - onehot(targets)) / N: the gradient of the mean
/// cross-entropy wrt the logits, times the upstream gradient dloss.
template <typename T>
void SoftmaxCrossEntropyBackward(T* dlogits, const T* probs, const int32_t* targets, T dloss,
                                 int rows, int vocab);

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_MODEL_OPS_H_
