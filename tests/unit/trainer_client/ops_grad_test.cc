// Every op's backward against central finite differences of its forward, in
// double precision.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/rng.h"
#include "trainer_client/model/ops.h"

namespace pshard {
namespace {

// Central differences with step h have truncation error h^2/6 * f''' (about
// 1e-11 for our O(1) objectives) and rounding error about eps * |f| / h
// (1e-16 * |f| / 1e-5 = 1e-11 * |f|, with |f| below 100 here), so a correct
// backward agrees to ~1e-9. A tolerance of 1e-6 relative to max(1, |grad|)
// leaves three orders of magnitude of margin yet catches any missing or
// wrong term, which shows up at 1e-3 or more.
constexpr double kStep = 1e-5;
constexpr double kRelTol = 1e-6;
constexpr uint64_t kSeed = 20240611;

std::vector<double> Random(int64_t n, uint64_t stream, double scale = 1.0, double shift = 0.0) {
  std::vector<double> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = shift + scale * NormalAt(kSeed, stream, i);
  return v;
}

double Dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Checks analytic[i] == d objective / d x[i] for every i, perturbing x in place.
void ExpectGradient(const std::function<double()>& objective, std::vector<double>& x,
                    const std::vector<double>& analytic, const std::string& what) {
  ASSERT_EQ(x.size(), analytic.size()) << what;
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + kStep;
    const double plus = objective();
    x[i] = saved - kStep;
    const double minus = objective();
    x[i] = saved;
    const double numeric = (plus - minus) / (2 * kStep);
    EXPECT_NEAR(analytic[i], numeric, kRelTol * std::max(1.0, std::abs(numeric)))
        << what << "[" << i << "]";
  }
}

TEST(OpsGradTest, Encoder) {
  const int batch = 2, seq_len = 3, channels = 4, vocab = 5, context = 4;
  const std::vector<int32_t> tokens = {1, 4, 1, 0, 1, 3};  // token 1 repeats
  std::vector<double> wte = Random(vocab * channels, 1);
  std::vector<double> wpe = Random(context * channels, 2);
  const std::vector<double> dout = Random(batch * seq_len * channels, 3);
  std::vector<double> out(dout.size());
  auto objective = [&] {
    EncoderForward(out.data(), tokens.data(), wte.data(), wpe.data(), batch, seq_len, channels);
    return Dot(out, dout);
  };
  std::vector<double> dwte(wte.size(), 0.0), dwpe(wpe.size(), 0.0);
  EncoderBackward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), batch, seq_len, channels);
  ExpectGradient(objective, wte, dwte, "dwte");
  ExpectGradient(objective, wpe, dwpe, "dwpe");
}

TEST(OpsGradTest, LayerNorm) {
  const int rows = 3, channels = 5;
  std::vector<double> inp = Random(rows * channels, 1, 2.0, 0.5);
  std::vector<double> weight = Random(channels, 2, 0.5, 1.0);
  std::vector<double> bias = Random(channels, 3);
  const std::vector<double> dout = Random(rows * channels, 4);
  std::vector<double> out(inp.size()), mean(rows), rstd(rows);
  auto objective = [&] {
    LayerNormForward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(), bias.data(),
                     rows, channels);
    return Dot(out, dout);
  };
  objective();
  for (int n = 0; n < rows; ++n) {  // the saved mean is the row mean
    double m = 0;
    for (int c = 0; c < channels; ++c) m += inp[n * channels + c];
    EXPECT_NEAR(mean[n], m / channels, 1e-12);
  }
  std::vector<double> dinp(inp.size(), 0.0), dweight(channels, 0.0), dbias(channels, 0.0);
  LayerNormBackward(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(),
                    weight.data(), mean.data(), rstd.data(), rows, channels);
  ExpectGradient(objective, inp, dinp, "dinp");
  ExpectGradient(objective, weight, dweight, "dweight");
  ExpectGradient(objective, bias, dbias, "dbias");
}

TEST(OpsGradTest, Linear) {
  const int rows = 3, in_features = 4, out_features = 5;
  std::vector<double> inp = Random(rows * in_features, 1);
  std::vector<double> weight = Random(out_features * in_features, 2);
  std::vector<double> bias = Random(out_features, 3);
  const std::vector<double> dout = Random(rows * out_features, 4);
  std::vector<double> out(dout.size());
  auto objective = [&] {
    LinearForward(out.data(), inp.data(), weight.data(), bias.data(), rows, in_features,
                  out_features);
    return Dot(out, dout);
  };
  std::vector<double> dinp(inp.size(), 0.0), dweight(weight.size(), 0.0), dbias(bias.size(), 0.0);
  LinearBackward(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(), weight.data(),
                 rows, in_features, out_features);
  ExpectGradient(objective, inp, dinp, "dinp");
  ExpectGradient(objective, weight, dweight, "dweight");
  ExpectGradient(objective, bias, dbias, "dbias");

  // Without bias the output is the plain product.
  LinearForward(out.data(), inp.data(), weight.data(), static_cast<const double*>(nullptr), rows,
                in_features, out_features);
  EXPECT_NEAR(out[1 * out_features + 2],
              inp[4] * weight[8] + inp[5] * weight[9] + inp[6] * weight[10] + inp[7] * weight[11],
              1e-12);
}

TEST(OpsGradTest, LinearBackwardAccumulates) {
  const int rows = 2, in_features = 3, out_features = 2;
  const std::vector<double> inp = Random(rows * in_features, 1);
  const std::vector<double> weight = Random(out_features * in_features, 2);
  const std::vector<double> dout = Random(rows * out_features, 3);
  std::vector<double> fresh_dinp(inp.size(), 0.0), fresh_dweight(weight.size(), 0.0),
      fresh_dbias(out_features, 0.0);
  LinearBackward(fresh_dinp.data(), fresh_dweight.data(), fresh_dbias.data(), dout.data(),
                 inp.data(), weight.data(), rows, in_features, out_features);
  std::vector<double> dinp(inp.size(), 1.0), dweight(weight.size(), 2.0), dbias(out_features, 3.0);
  LinearBackward(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(), weight.data(),
                 rows, in_features, out_features);
  for (size_t i = 0; i < dinp.size(); ++i) EXPECT_NEAR(dinp[i], 1.0 + fresh_dinp[i], 1e-12);
  for (size_t i = 0; i < dweight.size(); ++i)
    EXPECT_NEAR(dweight[i], 2.0 + fresh_dweight[i], 1e-12);
  for (size_t i = 0; i < dbias.size(); ++i) EXPECT_NEAR(dbias[i], 3.0 + fresh_dbias[i], 1e-12);
}

TEST(OpsGradTest, Attention) {
  const int batch = 2, seq_len = 4, channels = 6, num_heads = 2;
  std::vector<double> qkv = Random(batch * seq_len * 3 * channels, 1);
  const std::vector<double> dout = Random(batch * seq_len * channels, 2);
  std::vector<double> out(dout.size());
  std::vector<double> att(batch * num_heads * seq_len * seq_len);
  auto objective = [&] {
    AttentionForward(out.data(), att.data(), qkv.data(), batch, seq_len, channels, num_heads);
    return Dot(out, dout);
  };
  objective();
  for (int row = 0; row < batch * num_heads * seq_len; ++row) {
    const int i = row % seq_len;
    double sum = 0;
    for (int j = 0; j < seq_len; ++j) {
      const double a = att[row * seq_len + j];
      if (j > i) {
        EXPECT_EQ(a, 0.0) << "attention to a future position";
      }
      sum += a;
    }
    EXPECT_NEAR(sum, 1.0, 1e-12);
  }
  std::vector<double> dqkv(qkv.size(), 0.0);
  std::vector<double> scratch(2 * seq_len * seq_len);
  AttentionBackward(dqkv.data(), scratch.data(), dout.data(), qkv.data(), att.data(), batch,
                    seq_len, channels, num_heads);
  ExpectGradient(objective, qkv, dqkv, "dqkv");
}

TEST(OpsGradTest, AttentionIsCausal) {
  const int batch = 1, seq_len = 5, channels = 4, num_heads = 2;
  std::vector<double> qkv = Random(batch * seq_len * 3 * channels, 1);
  std::vector<double> out(batch * seq_len * channels), att(num_heads * seq_len * seq_len);
  AttentionForward(out.data(), att.data(), qkv.data(), batch, seq_len, channels, num_heads);
  const std::vector<double> before = out;
  for (int c = 0; c < 3 * channels; ++c) qkv[(seq_len - 1) * 3 * channels + c] += 1.0;
  AttentionForward(out.data(), att.data(), qkv.data(), batch, seq_len, channels, num_heads);
  for (int i = 0; i < (seq_len - 1) * channels; ++i) EXPECT_EQ(out[i], before[i]) << i;
}

TEST(OpsGradTest, Gelu) {
  const int count = 9;
  std::vector<double> inp = Random(count, 1, 2.0);
  inp[0] = 0.0;
  const std::vector<double> dout = Random(count, 2);
  std::vector<double> out(count);
  auto objective = [&] {
    GeluForward(out.data(), inp.data(), count);
    return Dot(out, dout);
  };
  objective();
  EXPECT_EQ(out[0], 0.0);
  std::vector<double> dinp(count, 0.0);
  GeluBackward(dinp.data(), inp.data(), dout.data(), count);
  ExpectGradient(objective, inp, dinp, "dinp");

  // 0.5 * (1 + tanh(sqrt(2/pi) * 1.044715)), computed by hand.
  const double one = 1.0;
  double gelu_one = 0;
  GeluForward(&gelu_one, &one, 1);
  EXPECT_NEAR(gelu_one, 0.8411919906082768, 1e-12);
}

TEST(OpsGradTest, Residual) {
  const int count = 6;
  std::vector<double> a = Random(count, 1), b = Random(count, 2);
  const std::vector<double> dout = Random(count, 3);
  std::vector<double> out(count);
  auto objective = [&] {
    ResidualForward(out.data(), a.data(), b.data(), count);
    return Dot(out, dout);
  };
  std::vector<double> da(count, 0.0), db(count, 0.0);
  ResidualBackward(da.data(), db.data(), dout.data(), count);
  ExpectGradient(objective, a, da, "da");
  ExpectGradient(objective, b, db, "db");
}

TEST(OpsGradTest, SoftmaxCrossEntropy) {
  const int rows = 3, vocab = 5;
  std::vector<double> logits = Random(rows * vocab, 1, 3.0);
  const std::vector<int32_t> targets = {4, 0, 2};
  const double dloss = 0.7;  // the backward scales by the upstream gradient
  std::vector<double> probs(logits.size());
  auto objective = [&] {
    return dloss *
           SoftmaxCrossEntropyForward(probs.data(), logits.data(), targets.data(), rows, vocab);
  };
  const double loss = objective() / dloss;
  double expected = 0;
  for (int n = 0; n < rows; ++n) {
    double sum = 0;
    for (int v = 0; v < vocab; ++v) sum += std::exp(logits[n * vocab + v]);
    expected -= std::log(std::exp(logits[n * vocab + targets[n]]) / sum);
  }
  EXPECT_NEAR(loss, expected / rows, 1e-12);
  std::vector<double> dlogits(logits.size(), 0.0);
  SoftmaxCrossEntropyBackward(dlogits.data(), probs.data(), targets.data(), dloss, rows, vocab);
  ExpectGradient(objective, logits, dlogits, "dlogits");

  // In place (probs aliasing logits) gives the same loss.
  std::vector<double> in_place = logits;
  EXPECT_EQ(
      SoftmaxCrossEntropyForward(in_place.data(), in_place.data(), targets.data(), rows, vocab),
      loss);
}

}  // namespace
}  // namespace pshard
