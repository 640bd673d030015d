#include "trainer_client/model/ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>

namespace pshard {
namespace {

// Row-major C = alpha * op(A) * op(B) + beta * C, with op(A) [m,k] and
// op(B) [k,n]; one overload per element type.
void Gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
          const float* b, int ldb, float beta, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void Gemm(bool trans_a, bool trans_b, int m, int n, int k, double alpha, const double* a, int lda,
          const double* b, int ldb, double beta, double* c, int ldc) {
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

constexpr double kLayerNormEps = 1e-5;
constexpr double kGeluScale = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluCubic = 0.044715;

}  // namespace

// ---------------------------------------------------------------- encoder

template <typename T>
void EncoderForward(T* out, const int32_t* tokens, const T* wte, const T* wpe, int batch,
                    int seq_len, int channels) {
  for (int b = 0; b < batch; ++b) {
    for (int t = 0; t < seq_len; ++t) {
      T* out_bt = out + (static_cast<int64_t>(b) * seq_len + t) * channels;
      const T* wte_row = wte + static_cast<int64_t>(tokens[b * seq_len + t]) * channels;
      const T* wpe_row = wpe + static_cast<int64_t>(t) * channels;
      for (int c = 0; c < channels; ++c) out_bt[c] = wte_row[c] + wpe_row[c];
    }
  }
}

template <typename T>
void EncoderBackward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int batch, int seq_len,
                     int channels) {
  for (int b = 0; b < batch; ++b) {
    for (int t = 0; t < seq_len; ++t) {
      const T* dout_bt = dout + (static_cast<int64_t>(b) * seq_len + t) * channels;
      T* dwte_row = dwte + static_cast<int64_t>(tokens[b * seq_len + t]) * channels;
      T* dwpe_row = dwpe + static_cast<int64_t>(t) * channels;
      for (int c = 0; c < channels; ++c) {
        dwte_row[c] += dout_bt[c];
        dwpe_row[c] += dout_bt[c];
      }
    }
  }
}

// ---------------------------------------------------------------- layernorm

template <typename T>
void LayerNormForward(T* out, T* mean, T* rstd, const T* inp, const T* weight, const T* bias,
                      int rows, int channels) {
  for (int n = 0; n < rows; ++n) {
    const T* x = inp + static_cast<int64_t>(n) * channels;
    T* y = out + static_cast<int64_t>(n) * channels;
    T m = 0;
    for (int c = 0; c < channels; ++c) m += x[c];
    m /= channels;
    T var = 0;
    for (int c = 0; c < channels; ++c) var += (x[c] - m) * (x[c] - m);
    var /= channels;
    const T s = T(1) / std::sqrt(var + static_cast<T>(kLayerNormEps));
    for (int c = 0; c < channels; ++c) y[c] = (x[c] - m) * s * weight[c] + bias[c];
    mean[n] = m;
    rstd[n] = s;
  }
}

template <typename T>
void LayerNormBackward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                       const T* mean, const T* rstd, int rows, int channels) {
  for (int n = 0; n < rows; ++n) {
    const T* x = inp + static_cast<int64_t>(n) * channels;
    const T* dy = dout + static_cast<int64_t>(n) * channels;
    T* dx = dinp + static_cast<int64_t>(n) * channels;
    const T m = mean[n];
    const T s = rstd[n];
    // With norm = (x - m) * s and dnorm = dy * weight:
    // dx = s * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)).
    T dnorm_mean = 0;
    T dnorm_norm_mean = 0;
    for (int c = 0; c < channels; ++c) {
      const T norm = (x[c] - m) * s;
      const T dnorm = dy[c] * weight[c];
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * norm;
    }
    dnorm_mean /= channels;
    dnorm_norm_mean /= channels;
    for (int c = 0; c < channels; ++c) {
      const T norm = (x[c] - m) * s;
      const T dnorm = dy[c] * weight[c];
      dbias[c] += dy[c];
      dweight[c] += norm * dy[c];
      dx[c] += s * (dnorm - dnorm_mean - norm * dnorm_norm_mean);
    }
  }
}

// ---------------------------------------------------------------- linear

template <typename T>
void LinearForward(T* out, const T* inp, const T* weight, const T* bias, int rows, int in_features,
                   int out_features) {
  T beta = 0;
  if (bias != nullptr) {
    for (int n = 0; n < rows; ++n) {
      std::copy(bias, bias + out_features, out + static_cast<int64_t>(n) * out_features);
    }
    beta = 1;
  }
  Gemm(false, true, rows, out_features, in_features, T(1), inp, in_features, weight, in_features,
       beta, out, out_features);
}

template <typename T>
void LinearBackward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                    int rows, int in_features, int out_features) {
  if (dinp != nullptr) {
    // dinp [N,IC] += dout [N,OC] * weight [OC,IC]
    Gemm(false, false, rows, in_features, out_features, T(1), dout, out_features, weight,
         in_features, T(1), dinp, in_features);
  }
  if (dweight != nullptr) {
    // dweight [OC,IC] += dout^T [OC,N] * inp [N,IC]
    Gemm(true, false, out_features, in_features, rows, T(1), dout, out_features, inp, in_features,
         T(1), dweight, in_features);
  }
  if (dbias != nullptr) {
    for (int n = 0; n < rows; ++n) {
      const T* dy = dout + static_cast<int64_t>(n) * out_features;
      for (int o = 0; o < out_features; ++o) dbias[o] += dy[o];
    }
  }
}

// ---------------------------------------------------------------- attention

template <typename T>
void AttentionForward(T* out, T* att, const T* qkv, int batch, int seq_len, int channels,
                      int num_heads) {
  const int head_size = channels / num_heads;
  const int qkv_stride = 3 * channels;
  const T scale = T(1) / std::sqrt(static_cast<T>(head_size));
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < num_heads; ++h) {
      const T* q = qkv + static_cast<int64_t>(b) * seq_len * qkv_stride + h * head_size;
      const T* k = q + channels;
      const T* v = q + 2 * channels;
      T* att_bh = att + (static_cast<int64_t>(b) * num_heads + h) * seq_len * seq_len;
      T* out_bh = out + static_cast<int64_t>(b) * seq_len * channels + h * head_size;
      // Scores [T,T] = scale * q [T,hs] * k^T; the part above the diagonal is
      // computed too (one GEMM is faster than T dot-product loops) and then
      // masked out by the softmax below.
      Gemm(false, true, seq_len, seq_len, head_size, scale, q, qkv_stride, k, qkv_stride, T(0),
           att_bh, seq_len);
      for (int i = 0; i < seq_len; ++i) {
        T* row = att_bh + static_cast<int64_t>(i) * seq_len;
        T max_score = row[0];
        for (int j = 1; j <= i; ++j) max_score = std::max(max_score, row[j]);
        T sum = 0;
        for (int j = 0; j <= i; ++j) {
          row[j] = std::exp(row[j] - max_score);
          sum += row[j];
        }
        const T inv_sum = T(1) / sum;
        for (int j = 0; j <= i; ++j) row[j] *= inv_sum;
        for (int j = i + 1; j < seq_len; ++j) row[j] = 0;
      }
      // out [T,hs] = att [T,T] * v [T,hs]
      Gemm(false, false, seq_len, head_size, seq_len, T(1), att_bh, seq_len, v, qkv_stride, T(0),
           out_bh, channels);
    }
  }
}

template <typename T>
void AttentionBackward(T* dqkv, T* scratch, const T* dout, const T* qkv, const T* att, int batch,
                       int seq_len, int channels, int num_heads) {
  const int head_size = channels / num_heads;
  const int qkv_stride = 3 * channels;
  const T scale = T(1) / std::sqrt(static_cast<T>(head_size));
  T* datt = scratch;                                               // d loss / d att
  T* dscores = scratch + static_cast<int64_t>(seq_len) * seq_len;  // d loss / d (q k^T)
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < num_heads; ++h) {
      const int64_t head_offset = static_cast<int64_t>(b) * seq_len * qkv_stride + h * head_size;
      const T* q = qkv + head_offset;
      const T* k = q + channels;
      const T* v = q + 2 * channels;
      T* dq = dqkv + head_offset;
      T* dk = dq + channels;
      T* dv = dq + 2 * channels;
      const T* att_bh = att + (static_cast<int64_t>(b) * num_heads + h) * seq_len * seq_len;
      const T* dout_bh = dout + static_cast<int64_t>(b) * seq_len * channels + h * head_size;
      // datt [T,T] = dout [T,hs] * v^T;  dv [T,hs] += att^T * dout.
      Gemm(false, true, seq_len, seq_len, head_size, T(1), dout_bh, channels, v, qkv_stride, T(0),
           datt, seq_len);
      Gemm(true, false, seq_len, head_size, seq_len, T(1), att_bh, seq_len, dout_bh, channels, T(1),
           dv, qkv_stride);
      // Softmax backward on the causal part: ds_ij = a_ij (da_ij - sum_k a_ik da_ik).
      for (int i = 0; i < seq_len; ++i) {
        const T* a = att_bh + static_cast<int64_t>(i) * seq_len;
        const T* da = datt + static_cast<int64_t>(i) * seq_len;
        T* ds = dscores + static_cast<int64_t>(i) * seq_len;
        T dot = 0;
        for (int j = 0; j <= i; ++j) dot += a[j] * da[j];
        for (int j = 0; j <= i; ++j) ds[j] = a[j] * (da[j] - dot);
        for (int j = i + 1; j < seq_len; ++j) ds[j] = 0;
      }
      // scores = scale * q k^T:  dq += scale * ds * k;  dk += scale * ds^T * q.
      Gemm(false, false, seq_len, head_size, seq_len, scale, dscores, seq_len, k, qkv_stride, T(1),
           dq, qkv_stride);
      Gemm(true, false, seq_len, head_size, seq_len, scale, dscores, seq_len, q, qkv_stride, T(1),
           dk, qkv_stride);
    }
  }
}

// ---------------------------------------------------------------- gelu

// GPT-2's GELU is 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3).
// Since 0.5 (1 + tanh(u)) = sigmoid(2u), it is evaluated as x * sigmoid(2u):
// one exp instead of a tanh, which in libm costs several times as much.
namespace {

template <typename T>
T GeluGate(T x) {
  const T u = static_cast<T>(kGeluScale) * (x + static_cast<T>(kGeluCubic) * x * x * x);
  return T(1) / (T(1) + std::exp(T(-2) * u));  // an overflowing exp gives the right limit 0
}

}  // namespace

template <typename T>
void GeluForward(T* out, const T* inp, int64_t count) {
  for (int64_t i = 0; i < count; ++i) out[i] = inp[i] * GeluGate(inp[i]);
}

template <typename T>
void GeluBackward(T* dinp, const T* inp, const T* dout, int64_t count) {
  const T scale = static_cast<T>(kGeluScale);
  const T cubic = static_cast<T>(kGeluCubic);
  for (int64_t i = 0; i < count; ++i) {
    const T x = inp[i];
    const T gate = GeluGate(x);
    const T du_dx = scale * (T(1) + T(3) * cubic * x * x);
    // d/dx [x sigmoid(2u)] = sigmoid(2u) + 2 x sigmoid(2u) (1 - sigmoid(2u)) du/dx
    dinp[i] += (gate + T(2) * x * gate * (T(1) - gate) * du_dx) * dout[i];
  }
}

// ---------------------------------------------------------------- residual

template <typename T>
void ResidualForward(T* out, const T* a, const T* b, int64_t count) {
  for (int64_t i = 0; i < count; ++i) out[i] = a[i] + b[i];
}

template <typename T>
void ResidualBackward(T* da, T* db, const T* dout, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    da[i] += dout[i];
    db[i] += dout[i];
  }
}

// ---------------------------------------------------------------- loss

template <typename T>
T SoftmaxCrossEntropyForward(T* probs, const T* logits, const int32_t* targets, int rows,
                             int vocab) {
  double loss_sum = 0;  // summed in double so the mean does not drift with N
  for (int n = 0; n < rows; ++n) {
    const T* z = logits + static_cast<int64_t>(n) * vocab;
    T* p = probs + static_cast<int64_t>(n) * vocab;
    const T max_logit = *std::max_element(z, z + vocab);
    const T target_logit = z[targets[n]];  // read before p (may alias z) is written
    T sum = 0;
    for (int v = 0; v < vocab; ++v) {
      p[v] = std::exp(z[v] - max_logit);
      sum += p[v];
    }
    const T inv_sum = T(1) / sum;
    for (int v = 0; v < vocab; ++v) p[v] *= inv_sum;
    // -log softmax(z)[target] = log(sum) + max - z[target], exact even when
    // the target's probability underflows.
    loss_sum += static_cast<double>(std::log(sum) + max_logit - target_logit);
  }
  return static_cast<T>(loss_sum / rows);
}

template <typename T>
void SoftmaxCrossEntropyBackward(T* dlogits, const T* probs, const int32_t* targets, T dloss,
                                 int rows, int vocab) {
  const T row_scale = dloss / static_cast<T>(rows);
  for (int n = 0; n < rows; ++n) {
    const T* p = probs + static_cast<int64_t>(n) * vocab;
    T* dz = dlogits + static_cast<int64_t>(n) * vocab;
    for (int v = 0; v < vocab; ++v) {
      const T indicator = v == targets[n] ? T(1) : T(0);
      dz[v] += (p[v] - indicator) * row_scale;
    }
  }
}

// ---------------------------------------------------------------- instantiations

#define PSHARD_INSTANTIATE_OPS(T)                                                                  \
  template void EncoderForward<T>(T*, const int32_t*, const T*, const T*, int, int, int);          \
  template void EncoderBackward<T>(T*, T*, const T*, const int32_t*, int, int, int);               \
  template void LayerNormForward<T>(T*, T*, T*, const T*, const T*, const T*, int, int);           \
  template void LayerNormBackward<T>(T*, T*, T*, const T*, const T*, const T*, const T*, const T*, \
                                     int, int);                                                    \
  template void LinearForward<T>(T*, const T*, const T*, const T*, int, int, int);                 \
  template void LinearBackward<T>(T*, T*, T*, const T*, const T*, const T*, int, int, int);        \
  template void AttentionForward<T>(T*, T*, const T*, int, int, int, int);                         \
  template void AttentionBackward<T>(T*, T*, const T*, const T*, const T*, int, int, int, int);    \
  template void GeluForward<T>(T*, const T*, int64_t);                                             \
  template void GeluBackward<T>(T*, const T*, const T*, int64_t);                                  \
  template void ResidualForward<T>(T*, const T*, const T*, int64_t);                               \
  template void ResidualBackward<T>(T*, T*, const T*, int64_t);                                    \
  template T SoftmaxCrossEntropyForward<T>(T*, const T*, const int32_t*, int, int);                \
  template void SoftmaxCrossEntropyBackward<T>(T*, const T*, const int32_t*, T, int, int);

PSHARD_INSTANTIATE_OPS(float)
PSHARD_INSTANTIATE_OPS(double)
#undef PSHARD_INSTANTIATE_OPS

}  // namespace pshard
