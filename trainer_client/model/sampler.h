// Text from a trained GPT: `pshard sample`. Each next token is drawn from
// the model's distribution at the last position of the context window,
// sharpened or flattened by a temperature and cut to the k most likely.
#ifndef PSHARD_TRAINER_CLIENT_MODEL_SAMPLER_H_
#define PSHARD_TRAINER_CLIENT_MODEL_SAMPLER_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_spec.h"

namespace pshard {

struct SampleOptions {
  int tokens = 200;          ///< tokens to generate
  double temperature = 0.8;  ///< > 0; 0: always the most likely token
  int top_k = 0;             ///< draw among the k most likely (0: all)
  uint64_t seed = 1;         ///< the draws are a function of (seed, position)
};

/// The `prompt` tokens (at least one) continued by options.tokens tokens
/// drawn from the GPT of layout `spec` with weights `units` (one unpadded
/// vector per unit). The context is the last `context` tokens. The same
/// inputs give the same tokens. InvalidArgument for a layout that is not a
/// GPT's, weights of the wrong size, bad options or a prompt token outside
/// the vocabulary. `logprobs` (when given) receives, for each drawn token,
/// its natural log-probability under the model (before the temperature and
/// top-k): what a reader of the weights elsewhere can check its model by.
absl::StatusOr<std::vector<int32_t>> SampleGpt(const ModelSpec& spec, const std::vector<std::vector<float>>& units,
                                               std::vector<int32_t> prompt, const SampleOptions& options,
                                               std::vector<double>* logprobs = nullptr);

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_MODEL_SAMPLER_H_
