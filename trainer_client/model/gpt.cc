#include "trainer_client/model/gpt.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "trainer_client/model/gpt_layout.h"
#include "trainer_client/model/ops.h"

namespace pshard {
namespace {

// Programming errors the void methods cannot return as a Status.
[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "pshard::CpuGpt: %s\n", what.c_str());
  std::abort();
}

// Offset of the tensor of `unit` named "<unit>.<name>", which must have
// `numel` elements.
template <typename T>
void Zero(std::vector<T>& v) {
  std::fill(v.begin(), v.end(), T(0));
}

}  // namespace

template <typename T>
absl::StatusOr<CpuGpt<T>> CpuGpt<T>::Create(const ModelSpec& spec, int batch, int seq_len,
                                            bool recompute_blocks) {
  ASSIGN_OR_RETURN(const GptConfig cfg, GptConfigFromSpec(spec));
  if (batch < 1 || seq_len < 1 || seq_len > cfg.context) {
    return absl::InvalidArgumentError(
        absl::StrCat("micro-batch of ", batch, " x ", seq_len,
                     " tokens; need batch >= 1 and 1 <= seq_len <= ", cfg.context));
  }
  const int layers = cfg.num_layers;
  const int64_t c = cfg.d_model;
  const int64_t v = cfg.vocab;
  CpuGpt model;
  model.spec_ = spec;
  model.config_ = cfg;
  model.batch_ = batch;
  model.seq_len_ = seq_len;
  model.recompute_ = recompute_blocks;

  ASSIGN_OR_RETURN(GptLayout layout, MakeGptLayout(spec));
  model.embed_ = layout.embed;
  model.block_layouts_ = std::move(layout.blocks);
  model.head_ = layout.head;

  // Every buffer is zero-filled here so no output ever depends on
  // uninitialised memory.
  const int64_t n = int64_t{batch} * seq_len;
  const int64_t att_size = int64_t{batch} * cfg.num_heads * seq_len * seq_len;
  model.tokens_.assign(n, 0);
  model.targets_.assign(n, 0);
  model.residuals_.assign(layers + 1, std::vector<T>(n * c));
  model.blocks_.resize(recompute_blocks ? std::min(layers, 1) : layers);
  for (BlockActivations& a : model.blocks_) {
    a.ln1.assign(n * c, 0);
    a.ln1_mean.assign(n, 0);
    a.ln1_rstd.assign(n, 0);
    a.qkv.assign(n * 3 * c, 0);
    a.att.assign(att_size, 0);
    a.atty.assign(n * c, 0);
    a.residual2.assign(n * c, 0);
    a.ln2.assign(n * c, 0);
    a.ln2_mean.assign(n, 0);
    a.ln2_rstd.assign(n, 0);
    a.fch.assign(n * 4 * c, 0);
    a.fch_gelu.assign(n * 4 * c, 0);
  }
  model.lnf_.assign(n * c, 0);
  model.lnf_mean_.assign(n, 0);
  model.lnf_rstd_.assign(n, 0);
  model.probs_.assign(n * v, 0);
  model.dresidual_.assign(n * c, 0);
  model.dln_.assign(n * c, 0);
  model.datty_.assign(n * c, 0);
  model.dqkv_.assign(n * 3 * c, 0);
  model.dfch_gelu_.assign(n * 4 * c, 0);
  model.dfch_.assign(n * 4 * c, 0);
  model.datt_.assign(2 * int64_t{seq_len} * seq_len, 0);
  model.dlogits_.assign(n * v, 0);
  return model;
}

template <typename T>
absl::Status CpuGpt<T>::SetBatch(std::span<const int32_t> tokens,
                                 std::span<const int32_t> targets) {
  const size_t n = static_cast<size_t>(rows());
  if (tokens.size() != n || targets.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("expected ", n, " tokens and targets, got ",
                                                   tokens.size(), " and ", targets.size()));
  }
  const int vocab = config_.vocab;
  for (size_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab || targets[i] < 0 || targets[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("token ", tokens[i], " or target ", targets[i],
                                                     " at position ", i, " is outside [0, ", vocab,
                                                     ")"));
    }
  }
  std::copy(tokens.begin(), tokens.end(), tokens_.begin());
  std::copy(targets.begin(), targets.end(), targets_.begin());
  // Saved activations belong to the previous batch: a new forward must come first.
  next_forward_ = 0;
  next_backward_ = -1;
  scratch_layer_ = -1;
  return absl::OkStatus();
}

template <typename T>
void CpuGpt<T>::ForwardUnit(int unit, std::span<const T> weights) {
  if (unit < 0 || unit >= num_units() || (unit != 0 && unit != next_forward_)) {
    Die(absl::StrCat("ForwardUnit(", unit, ") out of order; expected unit ", next_forward_));
  }
  if (static_cast<int64_t>(weights.size()) < spec_.units[unit].numel) {
    Die(absl::StrCat("unit ", unit, " needs ", spec_.units[unit].numel, " weights, got ",
                     weights.size()));
  }
  const int last = num_units() - 1;
  if (unit == 0) {
    EmbedForward(weights.data());
  } else if (unit == last) {
    HeadForward(weights.data());
  } else {
    BlockForward(unit - 1, weights.data());
  }
  next_forward_ = unit + 1;
  next_backward_ = unit == last ? last : -1;
}

template <typename T>
void CpuGpt<T>::BackwardUnit(int unit, std::span<const T> weights, std::span<T> grads) {
  if (unit < 0 || unit != next_backward_) {
    Die(absl::StrCat("BackwardUnit(", unit, ") out of order; expected unit ", next_backward_,
                     " (-1: run a full forward first)"));
  }
  const int64_t numel = spec_.units[unit].numel;
  if (static_cast<int64_t>(weights.size()) < numel || static_cast<int64_t>(grads.size()) < numel) {
    Die(absl::StrCat("unit ", unit, " needs ", numel, " weights and gradients, got ",
                     weights.size(), " and ", grads.size()));
  }
  std::fill(grads.begin(), grads.begin() + numel, T(0));
  if (unit == 0) {
    EmbedBackward(grads.data());
  } else if (unit == num_units() - 1) {
    HeadBackward(weights.data(), grads.data());
  } else {
    BlockBackward(unit - 1, weights.data(), grads.data());
  }
  next_backward_ = unit - 1;
}

template <typename T>
void CpuGpt<T>::EmbedForward(const T* w) {
  EncoderForward(residuals_[0].data(), tokens_.data(), w + embed_.wte, w + embed_.wpe, batch_,
                 seq_len_, config_.d_model);
}

template <typename T>
void CpuGpt<T>::BlockForward(int layer, const T* w) {
  const BlockLayout& p = block_layouts_[layer];
  BlockActivations& a = Internals(layer);
  BlockInternalsForward(layer, w, a);
  scratch_layer_ = layer;
  // out = residual2 + proj(gelu(fc(ln2(residual2)))).
  const int n = rows();
  const int c = config_.d_model;
  T* out = residuals_[layer + 1].data();
  LinearForward(out, a.fch_gelu.data(), w + p.mlp_proj_w, w + p.mlp_proj_b, n, 4 * c, c);
  ResidualForward(out, out, a.residual2.data(), int64_t{n} * c);
}

template <typename T>
void CpuGpt<T>::BlockInternalsForward(int layer, const T* w, BlockActivations& a) {
  const BlockLayout& p = block_layouts_[layer];
  const int n = rows();
  const int c = config_.d_model;
  const T* in = residuals_[layer].data();
  // Attention branch: residual2 = in + proj(attention(qkv(ln1(in)))).
  LayerNormForward(a.ln1.data(), a.ln1_mean.data(), a.ln1_rstd.data(), in, w + p.ln1_w, w + p.ln1_b,
                   n, c);
  LinearForward(a.qkv.data(), a.ln1.data(), w + p.qkv_w, w + p.qkv_b, n, c, 3 * c);
  AttentionForward(a.atty.data(), a.att.data(), a.qkv.data(), batch_, seq_len_, c,
                   config_.num_heads);
  LinearForward(a.residual2.data(), a.atty.data(), w + p.attn_proj_w, w + p.attn_proj_b, n, c, c);
  ResidualForward(a.residual2.data(), a.residual2.data(), in, int64_t{n} * c);
  // MLP branch up to its hidden activation: gelu(fc(ln2(residual2))).
  LayerNormForward(a.ln2.data(), a.ln2_mean.data(), a.ln2_rstd.data(), a.residual2.data(),
                   w + p.ln2_w, w + p.ln2_b, n, c);
  LinearForward(a.fch.data(), a.ln2.data(), w + p.fc_w, w + p.fc_b, n, c, 4 * c);
  GeluForward(a.fch_gelu.data(), a.fch.data(), int64_t{n} * 4 * c);
}

template <typename T>
void CpuGpt<T>::HeadForward(const T* w) {
  const int n = rows();
  const int c = config_.d_model;
  const int v = config_.vocab;
  LayerNormForward(lnf_.data(), lnf_mean_.data(), lnf_rstd_.data(), residuals_.back().data(),
                   w + head_.lnf_w, w + head_.lnf_b, n, c);
  // The logits are written into probs_ and replaced there by their softmax.
  LinearForward(probs_.data(), lnf_.data(), w + head_.lm_head_w, static_cast<const T*>(nullptr), n,
                c, v);
  loss_ = SoftmaxCrossEntropyForward(probs_.data(), probs_.data(), targets_.data(), n, v);
}

// The backward functions keep the gradient wrt the current unit's output in
// dresidual_ and turn it, in place, into the gradient wrt the unit's input:
// a residual connection's backward is the identity, so each branch's
// LayerNormBackward simply accumulates its contribution on top.

template <typename T>
void CpuGpt<T>::HeadBackward(const T* w, T* dw) {
  const int n = rows();
  const int c = config_.d_model;
  const int v = config_.vocab;
  Zero(dlogits_);
  SoftmaxCrossEntropyBackward(dlogits_.data(), probs_.data(), targets_.data(), T(1), n, v);
  Zero(dln_);
  LinearBackward(dln_.data(), dw + head_.lm_head_w, static_cast<T*>(nullptr), dlogits_.data(),
                 lnf_.data(), w + head_.lm_head_w, n, c, v);
  Zero(dresidual_);
  LayerNormBackward(dresidual_.data(), dw + head_.lnf_w, dw + head_.lnf_b, dln_.data(),
                    residuals_.back().data(), w + head_.lnf_w, lnf_mean_.data(), lnf_rstd_.data(),
                    n, c);
}

template <typename T>
void CpuGpt<T>::BlockBackward(int layer, const T* w, T* dw) {
  const BlockLayout& p = block_layouts_[layer];
  BlockActivations& a = Internals(layer);
  if (recompute_ && scratch_layer_ != layer) {
    BlockInternalsForward(layer, w, a);
    scratch_layer_ = layer;
  }
  const int n = rows();
  const int c = config_.d_model;
  T* dres = dresidual_.data();
  // MLP branch; afterwards dres holds the gradient wrt residual2.
  Zero(dfch_gelu_);
  LinearBackward(dfch_gelu_.data(), dw + p.mlp_proj_w, dw + p.mlp_proj_b, dres, a.fch_gelu.data(),
                 w + p.mlp_proj_w, n, 4 * c, c);
  Zero(dfch_);
  GeluBackward(dfch_.data(), a.fch.data(), dfch_gelu_.data(), int64_t{n} * 4 * c);
  Zero(dln_);
  LinearBackward(dln_.data(), dw + p.fc_w, dw + p.fc_b, dfch_.data(), a.ln2.data(), w + p.fc_w, n,
                 c, 4 * c);
  LayerNormBackward(dres, dw + p.ln2_w, dw + p.ln2_b, dln_.data(), a.residual2.data(), w + p.ln2_w,
                    a.ln2_mean.data(), a.ln2_rstd.data(), n, c);
  // Attention branch; afterwards dres holds the gradient wrt the block input.
  Zero(datty_);
  LinearBackward(datty_.data(), dw + p.attn_proj_w, dw + p.attn_proj_b, dres, a.atty.data(),
                 w + p.attn_proj_w, n, c, c);
  Zero(dqkv_);
  AttentionBackward(dqkv_.data(), datt_.data(), datty_.data(), a.qkv.data(), a.att.data(), batch_,
                    seq_len_, c, config_.num_heads);
  Zero(dln_);
  LinearBackward(dln_.data(), dw + p.qkv_w, dw + p.qkv_b, dqkv_.data(), a.ln1.data(), w + p.qkv_w,
                 n, c, 3 * c);
  LayerNormBackward(dres, dw + p.ln1_w, dw + p.ln1_b, dln_.data(), residuals_[layer].data(),
                    w + p.ln1_w, a.ln1_mean.data(), a.ln1_rstd.data(), n, c);
}

template <typename T>
void CpuGpt<T>::EmbedBackward(T* dw) {
  EncoderBackward(dw + embed_.wte, dw + embed_.wpe, dresidual_.data(), tokens_.data(), batch_,
                  seq_len_, config_.d_model);
}

template <typename T>
int64_t CpuGpt<T>::ActivationBytes() const {
  int64_t elements = 0;
  auto add = [&elements](const std::vector<T>& v) { elements += static_cast<int64_t>(v.size()); };
  for (const std::vector<T>& r : residuals_) add(r);
  for (const BlockActivations& a : blocks_) {
    for (const std::vector<T>* v :
         {&a.ln1, &a.ln1_mean, &a.ln1_rstd, &a.qkv, &a.att, &a.atty, &a.residual2, &a.ln2,
          &a.ln2_mean, &a.ln2_rstd, &a.fch, &a.fch_gelu}) {
      add(*v);
    }
  }
  for (const std::vector<T>* v : {&lnf_, &lnf_mean_, &lnf_rstd_, &probs_, &dresidual_, &dln_,
                                  &datty_, &dqkv_, &dfch_gelu_, &dfch_, &datt_, &dlogits_}) {
    add(*v);
  }
  const int64_t batch_bytes =
      static_cast<int64_t>(tokens_.size() + targets_.size()) * sizeof(int32_t);
  return elements * static_cast<int64_t>(sizeof(T)) + batch_bytes;
}

template <typename T>
double CpuGpt<T>::FlopsPerMicroBatch() const {
  return GptModelFlops(config_, batch_, seq_len_);
}

template <typename T>
double CpuGpt<T>::RecomputeFlopsPerMicroBatch() const {
  if (!recompute_) return 0.0;
  const GptConfig& cfg = config_;
  const double c = cfg.d_model;
  // The last block's backward finds its internals still in the scratch.
  const int recomputed = cfg.num_layers - 1;
  const double linears = 2.0 * 8.0 * c * c * rows();  // qkv 3C^2, attention projection C^2, fc 4C^2
  const double attention = 4.0 * batch_ * static_cast<double>(seq_len_) * seq_len_ * c;
  return recomputed * (linears + attention);
}

template <typename T>
absl::StatusOr<T> LossAndGradients(CpuGpt<T>& model,
                                   const std::vector<std::vector<T>>& unit_weights,
                                   std::type_identity_t<std::vector<std::vector<T>>>* unit_grads) {
  const int units = model.num_units();
  if (static_cast<int>(unit_weights.size()) != units) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected weights for ", units, " units, got ", unit_weights.size()));
  }
  for (int u = 0; u < units; ++u) {
    if (static_cast<int64_t>(unit_weights[u].size()) < model.spec_.units[u].numel) {
      return absl::InvalidArgumentError(absl::StrCat("unit ", u, " needs ",
                                                     model.spec_.units[u].numel, " weights, got ",
                                                     unit_weights[u].size()));
    }
  }
  for (int u = 0; u < units; ++u) model.ForwardUnit(u, unit_weights[u]);
  if (unit_grads != nullptr) {
    unit_grads->resize(units);
    for (int u = units - 1; u >= 0; --u) {
      (*unit_grads)[u].assign(model.spec_.units[u].numel, T(0));
      model.BackwardUnit(u, unit_weights[u], (*unit_grads)[u]);
    }
  }
  return model.loss();
}

template class CpuGpt<float>;
template class CpuGpt<double>;
template absl::StatusOr<float> LossAndGradients(CpuGpt<float>&,
                                                const std::vector<std::vector<float>>&,
                                                std::vector<std::vector<float>>*);
template absl::StatusOr<double> LossAndGradients(CpuGpt<double>&,
                                                 const std::vector<std::vector<double>>&,
                                                 std::vector<std::vector<double>>*);

}  // namespace pshard
