#include "trainer_client/model/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/rng.h"
#include "common/status_macros.h"
#include "trainer_client/model/gpt.h"

namespace pshard {
namespace {

// Picks a token from `probs` as the options say, with uniform draw `u`.
int32_t Draw(std::span<const float> probs, const SampleOptions& options, double u) {
  const int vocab = static_cast<int>(probs.size());
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  // Most likely first; ties keep token order.
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return probs[a] > probs[b]; });
  if (options.temperature == 0.0) return order[0];
  const int keep = options.top_k > 0 ? std::min(options.top_k, vocab) : vocab;
  std::vector<double> weight(keep);
  double total = 0.0;
  for (int i = 0; i < keep; ++i) {
    const double p = probs[order[i]];
    weight[i] = p > 0.0 ? std::exp(std::log(p) / options.temperature) : 0.0;
    total += weight[i];
  }
  if (!(total > 0.0)) return order[0];
  double at = u * total;
  for (int i = 0; i < keep; ++i) {
    if (at < weight[i]) return order[i];
    at -= weight[i];
  }
  return order[keep - 1];
}

}  // namespace

absl::StatusOr<std::vector<int32_t>> SampleGpt(const ModelSpec& spec, const std::vector<std::vector<float>>& units,
                                               std::vector<int32_t> prompt, const SampleOptions& options,
                                               std::vector<double>* logprobs) {
  ASSIGN_OR_RETURN(const GptConfig config, GptConfigFromSpec(spec));
  if (options.tokens < 0 || !(options.temperature >= 0.0) || !std::isfinite(options.temperature) ||
      options.top_k < 0) {
    return absl::InvalidArgumentError(absl::StrCat("sampling needs tokens >= 0, a finite temperature >= 0 and "
                                                   "top_k >= 0; got ", options.tokens, ", ", options.temperature,
                                                   ", ", options.top_k));
  }
  if (prompt.empty()) return absl::InvalidArgumentError("sampling needs a prompt of at least one token");
  for (int32_t t : prompt) {
    if (t < 0 || t >= config.vocab) {
      return absl::InvalidArgumentError(absl::StrCat("prompt token ", t, " is outside the vocabulary [0, ",
                                                     config.vocab, ")"));
    }
  }
  if (units.size() != spec.units.size()) {
    return absl::InvalidArgumentError(absl::StrCat(units.size(), " units of weights for a layout of ",
                                                   spec.units.size()));
  }
  for (size_t u = 0; u < units.size(); ++u) {
    if (static_cast<int64_t>(units[u].size()) < spec.units[u].numel) {
      return absl::InvalidArgumentError(absl::StrCat("unit ", spec.units[u].name, " has ", units[u].size(),
                                                     " weights, not ", spec.units[u].numel));
    }
  }
  const int window = config.context;
  ASSIGN_OR_RETURN(CpuGpt<float> model, CpuGpt<float>::Create(spec, 1, window));
  std::vector<int32_t> tokens(window), targets(window, 0);
  const size_t prompt_length = prompt.size();
  for (int i = 0; i < options.tokens; ++i) {
    // The last `window` tokens, from position 0; the positions after them
    // (zeros) cannot change the earlier ones' outputs (causal attention).
    const size_t length = std::min(prompt.size(), static_cast<size_t>(window));
    std::fill(tokens.begin(), tokens.end(), 0);
    std::copy(prompt.end() - static_cast<std::ptrdiff_t>(length), prompt.end(), tokens.begin());
    RETURN_IF_ERROR(model.SetBatch(tokens, targets));
    for (int u = 0; u < model.num_units(); ++u) model.ForwardUnit(u, units[u]);
    const double draw = UniformAt(options.seed, 0, prompt.size() - prompt_length);
    const std::span<const float> probs = model.Probabilities(0, static_cast<int>(length) - 1);
    prompt.push_back(Draw(probs, options, draw));
    if (logprobs != nullptr) logprobs->push_back(std::log(static_cast<double>(probs[prompt.back()])));
  }
  return prompt;
}

}  // namespace pshard
