// A model that is not a GPT, for showing that servers and trainers know
// nothing of the GPT: a bigram language model as an MLP. Each token's
// embedding goes through `hidden` ReLU layers to logits over the
// vocabulary, trained on the next token.
//
// Units: "embed" (embed.weight [vocab, width]); "hidden<i>"
// (hidden<i>.weight [width, width], hidden<i>.bias [width]); "out"
// (out.weight [vocab, width], out.bias [vocab]). Weights are applied as
// y = x W^T + b.
#ifndef PSHARD_TESTS_TESTUTIL_MLP_MODEL_H_
#define PSHARD_TESTS_TESTUTIL_MLP_MODEL_H_

#include <memory>

#include "absl/status/statusor.h"
#include "common/model_spec.h"
#include "trainer_client/model/unit_model.h"

namespace pshard::testing {

/// The layout, with model words "mlp vocab=V width=W hidden=H".
absl::StatusOr<ModelSpec> MakeMlpSpec(int vocab, int width, int hidden);

/// The model on the CPU, one lane; its layout must be MakeMlpSpec's.
/// Deterministic: the same batch and weights give the same bits.
absl::StatusOr<std::unique_ptr<UnitModel>> CreateCpuMlp(const ModelSpec& spec, const UnitModelOptions& options);

}  // namespace pshard::testing

#endif  // PSHARD_TESTS_TESTUTIL_MLP_MODEL_H_
