// A GPT-2-style model on the CPU that runs one unit (layer) at a time, so the
// trainer can fetch a unit's weights just before its forward or backward and
// drop them right after. The unit and tensor layout is common/model_spec.h's.
#ifndef PSHARD_TRAINER_CLIENT_MODEL_GPT_H_
#define PSHARD_TRAINER_CLIENT_MODEL_GPT_H_

#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model_spec.h"
#include "trainer_client/model/gpt_layout.h"
#include "trainer_client/model/gpt_spec.h"

namespace pshard {

template <typename T>
class CpuGpt;

/// Convenience for tests and the reference: runs the whole forward and, when
/// `unit_grads` is not null, the whole backward with all weights resident.
/// `unit_weights[u]` must hold at least spec.units[u].numel elements;
/// `unit_grads` is resized to one vector of numel elements per unit.
/// Returns the mean loss, or InvalidArgument on a wrong number or size of
/// weight vectors. (T is deduced from the first two arguments only, so
/// `unit_grads` may be a plain nullptr.)
template <typename T>
absl::StatusOr<T> LossAndGradients(CpuGpt<T>& model,
                                   const std::vector<std::vector<T>>& unit_weights,
                                   std::type_identity_t<std::vector<std::vector<T>>>* unit_grads);

/// Forward and backward of a GPT on micro-batches of fixed shape, unit by
/// unit. The model owns only activations (and gradient scratch), never
/// weights. T is float (training) or double (gradient checks).
///
/// Activation recomputation (`recompute_blocks` in Create): a block's
/// forward then keeps only the block's input (the residual stream entering
/// it), and its backward first recomputes the block's internals (LayerNorm
/// outputs and statistics, qkv, attention probabilities, MLP activations)
/// from that input and the weights it is given, into one scratch set shared
/// by all blocks. The last block's internals are still in the scratch when
/// its backward runs, so L-1 of L blocks are recomputed. Losses and
/// gradients are bit-identical with and without recomputation (the same ops
/// run in the same order on the same values); what changes is
/// ActivationBytes() and the FLOPs run (RecomputeFlopsPerMicroBatch()).
///
/// Results are deterministic: the same batch and weights give bit-identical
/// losses and gradients on every call. Single-threaded apart from whatever
/// threads BLAS uses; not thread-safe (one caller at a time). Misuse that
/// the void methods cannot report (a unit out of order, spans that are too
/// short) aborts with a message.
template <typename T>
class CpuGpt {
 public:
  /// Allocates activations for micro-batches of `batch` sequences of
  /// `seq_len` (<= context) tokens; with `recompute_blocks`, internals for
  /// one block only (see above). InvalidArgument on bad sizes or a spec
  /// whose units do not follow the GPT layout of MakeGptSpec.
  static absl::StatusOr<CpuGpt> Create(const ModelSpec& spec, int batch, int seq_len,
                                       bool recompute_blocks = false);

  /// Sets the micro-batch: tokens and next-token targets, each batch*seq_len
  /// ints in [0, vocab). Returns InvalidArgument on bad sizes/ids. The
  /// activations of the previous batch become invalid: a full forward must
  /// run before the next BackwardUnit.
  absl::Status SetBatch(std::span<const int32_t> tokens, std::span<const int32_t> targets);

  /// Runs unit `unit`'s forward with its flat weights (exactly
  /// spec.units[unit].numel elements; extra trailing padding allowed and
  /// ignored). Must be called for units 0..K-1 in order (calling unit 0
  /// starts a new pass). The last unit also computes the loss.
  void ForwardUnit(int unit, std::span<const T> weights);

  /// Backward of `unit` (called for K-1..0 after a full forward), with the
  /// same weights (a recomputed block's forward runs again on them); writes
  /// the gradient of the mean loss wrt the unit's flat weights into `grads`
  /// (numel elements; overwritten, not accumulated; padding untouched).
  void BackwardUnit(int unit, std::span<const T> weights, std::span<T> grads);

  /// Mean cross-entropy of the last forward, in nats.
  T loss() const { return loss_; }

  /// The next-token distribution the last forward gave at position
  /// `position` of sequence `sequence` (vocab probabilities).
  std::span<const T> Probabilities(int sequence, int position) const {
    const size_t row = static_cast<size_t>(sequence) * seq_len_ + position;
    return std::span<const T>(probs_).subspan(row * config_.vocab, config_.vocab);
  }

  /// Bytes held by saved activations, gradient scratch and the batch: all
  /// allocated by Create, so known before any forward.
  int64_t ActivationBytes() const;

  int num_units() const { return static_cast<int>(spec_.units.size()); }
  bool recompute_blocks() const { return recompute_; }

  /// Model FLOPs of one forward+backward of a micro-batch (for MFU/tok/s
  /// reporting): 6 * (matmul weights: block linears and the LM head) *
  /// tokens, plus 12 * layers * batch * seq_len^2 * d_model for the attention
  /// score and value products (counted over the full T x T square, as run).
  /// The same with or without recomputation: MFU conventionally counts the
  /// FLOPs the model needs, not the ones a memory-saving schedule adds.
  double FlopsPerMicroBatch() const;

  /// FLOPs that recomputation adds to one forward+backward (0 when off), so
  /// that FlopsPerMicroBatch() + this is what actually runs (hardware
  /// FLOPs). Per recomputed block: 2 * tokens * 8 * d_model^2 for the qkv,
  /// attention projection and MLP fc linears (the MLP's output projection
  /// is not needed by backward, so it is not rerun), plus
  /// 4 * batch * seq_len^2 * d_model for the attention products.
  double RecomputeFlopsPerMicroBatch() const;

 private:
  // Offsets of each tensor inside its unit's flat vector.
  using EmbedLayout = GptLayout::Embed;
  using BlockLayout = GptLayout::Block;
  using HeadLayout = GptLayout::Head;
  // What one block's backward reads: saved by its forward, or, with
  // recomputation, rebuilt in the one set shared by all blocks.
  struct BlockActivations {
    std::vector<T> ln1, ln1_mean, ln1_rstd;  // [N,C], [N], [N]
    std::vector<T> qkv;                      // [N,3C]
    std::vector<T> att;                      // [B,H,T,T] softmax probabilities
    std::vector<T> atty;                     // [N,C] attention output, heads concatenated
    std::vector<T> residual2;                // [N,C] block input + attention branch
    std::vector<T> ln2, ln2_mean, ln2_rstd;  // [N,C], [N], [N]
    std::vector<T> fch, fch_gelu;            // [N,4C]
  };

  CpuGpt() = default;

  void EmbedForward(const T* w);
  void BlockForward(int layer, const T* w);
  // The block's forward up to everything its backward reads, into `a`
  // (all of BlockForward but the MLP output projection and residual).
  void BlockInternalsForward(int layer, const T* w, BlockActivations& a);
  void HeadForward(const T* w);
  void EmbedBackward(T* dw);
  void BlockBackward(int layer, const T* w, T* dw);
  void HeadBackward(const T* w, T* dw);

  int rows() const { return batch_ * seq_len_; }
  // Where block `layer`'s internals live: its own set, or the shared scratch.
  BlockActivations& Internals(int layer) { return blocks_[recompute_ ? 0 : layer]; }

  ModelSpec spec_;
  GptConfig config_;
  int batch_ = 0;
  int seq_len_ = 0;
  EmbedLayout embed_{};
  std::vector<BlockLayout> block_layouts_;
  HeadLayout head_{};

  std::vector<int32_t> tokens_;   // [B,T]
  std::vector<int32_t> targets_;  // [B,T]
  // residuals_[l] is the input of block l; residuals_[L] is the head's input.
  std::vector<std::vector<T>> residuals_;
  // One set per block, or a single scratch set when recompute_ is on.
  std::vector<BlockActivations> blocks_;
  bool recompute_ = false;
  int scratch_layer_ = -1;  // with recompute_: the block whose internals blocks_[0] holds
  std::vector<T> lnf_, lnf_mean_, lnf_rstd_;  // [N,C], [N], [N]
  std::vector<T> probs_;                      // [N,V] softmax of the logits
  T loss_ = 0;

  // Gradient scratch, reused by every unit's backward.
  std::vector<T> dresidual_;  // [N,C] gradient wrt the current unit's output
  std::vector<T> dln_;        // [N,C]
  std::vector<T> datty_;      // [N,C]
  std::vector<T> dqkv_;       // [N,3C]
  std::vector<T> dfch_gelu_;  // [N,4C]
  std::vector<T> dfch_;       // [N,4C]
  std::vector<T> datt_;       // [2,T,T] attention backward scratch
  std::vector<T> dlogits_;    // [N,V]

  int next_forward_ = 0;    // unit the next ForwardUnit must run (0 restarts)
  int next_backward_ = -1;  // unit the next BackwardUnit must run; -1: none

  friend absl::StatusOr<T> LossAndGradients<T>(
      CpuGpt<T>& model, const std::vector<std::vector<T>>& unit_weights,
      std::type_identity_t<std::vector<std::vector<T>>>* unit_grads);
};

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_MODEL_GPT_H_
