#include "trainer_client/model/gpt_spec.h"

#include <cmath>
#include <map>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"

namespace pshard {

absl::Status GptConfig::Validate() const {
  if (num_layers < 1 || d_model < 1 || num_heads < 1 || context < 1 || vocab < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GPT sizes must be positive: layers=", num_layers, " width=", d_model,
        " heads=", num_heads, " context=", context, " vocab=", vocab));
  }
  if (d_model % num_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("width ", d_model, " is not divisible by heads ", num_heads));
  }
  return absl::OkStatus();
}

std::string GptModelName(const GptConfig& config) {
  return absl::StrCat("gpt layers=", config.num_layers, " d_model=", config.d_model, " heads=", config.num_heads,
                      " context=", config.context, " vocab=", config.vocab);
}

absl::StatusOr<ModelSpec> MakeGptSpec(const GptConfig& config) {
  RETURN_IF_ERROR(config.Validate());
  const int64_t c = config.d_model;
  const double kStd = 0.02;
  // GPT-2 scales the residual projections by 1/sqrt(2 * layers).
  const double residual_std = kStd / std::sqrt(2.0 * config.num_layers);
  ModelSpecBuilder b(GptModelName(config));
  std::string unit;
  // Matrices decay, vectors do not.
  auto add = [&](const std::string& name, std::vector<int64_t> shape, InitKind init, double std = 0.0) {
    const bool decay = shape.size() >= 2;
    b.AddTensor(absl::StrCat(unit, ".", name), std::move(shape), init, std, decay);
  };
  auto start = [&](std::string name) {
    unit = std::move(name);
    b.AddUnit(unit);
  };

  start("embed");
  add("wte", {config.vocab, c}, InitKind::kNormal, kStd);
  add("wpe", {config.context, c}, InitKind::kNormal, 0.01);

  for (int l = 0; l < config.num_layers; ++l) {
    start(absl::StrCat("block", l));
    add("ln1.w", {c}, InitKind::kOnes);
    add("ln1.b", {c}, InitKind::kZeros);
    add("attn.qkv.w", {3 * c, c}, InitKind::kNormal, kStd);
    add("attn.qkv.b", {3 * c}, InitKind::kZeros);
    add("attn.proj.w", {c, c}, InitKind::kNormal, residual_std);
    add("attn.proj.b", {c}, InitKind::kZeros);
    add("ln2.w", {c}, InitKind::kOnes);
    add("ln2.b", {c}, InitKind::kZeros);
    add("mlp.fc.w", {4 * c, c}, InitKind::kNormal, kStd);
    add("mlp.fc.b", {4 * c}, InitKind::kZeros);
    add("mlp.proj.w", {c, 4 * c}, InitKind::kNormal, residual_std);
    add("mlp.proj.b", {c}, InitKind::kZeros);
  }

  start("head");
  add("lnf.w", {c}, InitKind::kOnes);
  add("lnf.b", {c}, InitKind::kZeros);
  add("lm_head.w", {config.vocab, c}, InitKind::kNormal, kStd);
  return std::move(b).Build();
}

absl::StatusOr<GptConfig> ParseGptModelName(const std::string& model) {
  auto not_gpt = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("the layout's model is \"", model,
                                                   "\", not a GPT this trainer computes (", why, ")"));
  };
  std::vector<std::string> words = absl::StrSplit(model, ' ', absl::SkipEmpty());
  if (words.empty() || words[0] != "gpt") return not_gpt("its words do not start with \"gpt\"");
  std::map<std::string, int*> fields;
  GptConfig config;
  fields["layers"] = &config.num_layers;
  fields["d_model"] = &config.d_model;
  fields["heads"] = &config.num_heads;
  fields["context"] = &config.context;
  fields["vocab"] = &config.vocab;
  for (size_t i = 1; i < words.size(); ++i) {
    std::pair<std::string, std::string> kv = absl::StrSplit(words[i], absl::MaxSplits('=', 1));
    auto it = fields.find(kv.first);
    if (it == fields.end() || !absl::SimpleAtoi(kv.second, it->second)) {
      return not_gpt(absl::StrCat("\"", words[i], "\" is not a GPT size"));
    }
    fields.erase(it);
  }
  if (!fields.empty()) return not_gpt(absl::StrCat("no ", fields.begin()->first, "="));
  RETURN_IF_ERROR(config.Validate());
  return config;
}

absl::StatusOr<GptConfig> GptConfigFromSpec(const ModelSpec& spec) {
  ASSIGN_OR_RETURN(const GptConfig config, ParseGptModelName(spec.model));
  ASSIGN_OR_RETURN(const ModelSpec expected, MakeGptSpec(config));
  auto differs = [&](const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrCat("the layout says \"", spec.model, "\" but does not follow that GPT's layout: ", what));
  };
  if (spec.units.size() != expected.units.size()) {
    return differs(absl::StrCat(spec.units.size(), " units, expected ", expected.units.size()));
  }
  for (size_t u = 0; u < spec.units.size(); ++u) {
    const UnitSpec& got = spec.units[u];
    const UnitSpec& want = expected.units[u];
    if (got.name != want.name || got.tensors.size() != want.tensors.size()) {
      return differs(absl::StrCat("unit ", u, " is ", got.name, " of ", got.tensors.size(), " tensors, expected ",
                                  want.name, " of ", want.tensors.size()));
    }
    for (size_t i = 0; i < got.tensors.size(); ++i) {
      const TensorSpec& a = got.tensors[i];
      const TensorSpec& b = want.tensors[i];
      if (a.name != b.name || a.shape != b.shape) {
        return differs(absl::StrCat("tensor ", a.name, " [", absl::StrJoin(a.shape, ", "), "], expected ", b.name,
                                    " [", absl::StrJoin(b.shape, ", "), "]"));
      }
    }
  }
  return config;
}

}  // namespace pshard
