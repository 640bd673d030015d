// Byte-level token data for the trainer: a text held in memory and a pure
// sampler of micro-batches from it.
#ifndef PSHARD_TRAINER_CLIENT_DATA_DATASET_H_
#define PSHARD_TRAINER_CLIENT_DATA_DATASET_H_

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pshard {

/// A text whose bytes are the tokens (vocab 256). Immutable after
/// construction, so const methods are safe to call from any thread.
class TokenDataset {
 public:
  /// Vocabulary of byte-level tokens.
  static constexpr int kVocab = 256;

  /// Reads the whole file as bytes. NotFound when it cannot be opened;
  /// InvalidArgument when it holds fewer than 2 bytes (no token/target pair).
  static absl::StatusOr<TokenDataset> FromFile(const std::string& path);

  /// Takes the bytes of `text`. A text too short for a requested sequence
  /// length makes SampleBatch fail.
  static TokenDataset FromText(std::string text);

  /// Number of tokens (bytes).
  int64_t size() const { return static_cast<int64_t>(bytes_.size()); }

  /// Fills tokens/targets (batch*seq_len each) for micro-batch `micro` of
  /// trainer `rank` at `step`: a pure function of (seed, step, rank, micro,
  /// batch, seq_len) built on pshard::CounterHash. Each sequence starts at an
  /// offset drawn uniformly from [0, size-seq_len-1]; targets are the tokens
  /// shifted by one. InvalidArgument on negative step/rank/micro, batch < 1,
  /// seq_len < 1, seq_len >= size, or spans of the wrong size.
  absl::Status SampleBatch(uint64_t seed, int64_t step, int rank, int micro, int batch, int seq_len,
                           std::span<int32_t> tokens, std::span<int32_t> targets) const;

  /// Entropy of the byte unigram distribution, in nats (the loss a model
  /// that knows only byte frequencies gets). 0 for an empty text.
  double UnigramEntropyNats() const;

 private:
  explicit TokenDataset(std::string bytes) : bytes_(std::move(bytes)) {}

  std::string bytes_;
};

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_DATA_DATASET_H_
