#include "common/model_spec.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/rng.h"

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

const TensorSpec* UnitSpec::Find(const std::string& name_suffix) const {
  for (const TensorSpec& t : tensors) {
    if (absl::EndsWith(t.name, name_suffix)) return &t;
  }
  return nullptr;
}

int64_t ModelSpec::TotalParameters() const {
  int64_t total = 0;
  for (const UnitSpec& u : units) total += u.numel;
  return total;
}

std::vector<int64_t> ModelSpec::UnitNumels() const {
  std::vector<int64_t> out;
  for (const UnitSpec& u : units) out.push_back(u.numel);
  return out;
}

namespace {

class UnitBuilder {
 public:
  UnitBuilder(std::string name, uint64_t* next_stream) : next_stream_(next_stream) {
    unit_.name = std::move(name);
  }
  void Add(const std::string& name, std::vector<int64_t> shape, InitKind init, double std = 0.0) {
    TensorSpec t;
    t.name = absl::StrCat(unit_.name, ".", name);
    t.numel = 1;
    for (int64_t d : shape) t.numel *= d;
    t.shape = std::move(shape);
    t.offset = unit_.numel;
    t.init = init;
    t.init_std = std;
    t.weight_decay = t.shape.size() >= 2;
    t.rng_stream = (*next_stream_)++;
    unit_.numel += t.numel;
    unit_.tensors.push_back(std::move(t));
  }
  UnitSpec Take() { return std::move(unit_); }

 private:
  UnitSpec unit_;
  uint64_t* next_stream_;
};

}  // namespace

absl::StatusOr<ModelSpec> MakeGptSpec(const GptConfig& config) {
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  const int64_t c = config.d_model;
  const double kStd = 0.02;
  // GPT-2 scales the residual projections by 1/sqrt(2 * layers).
  const double residual_std = kStd / std::sqrt(2.0 * config.num_layers);
  uint64_t stream = 0;
  ModelSpec spec;
  spec.config = config;

  UnitBuilder embed("embed", &stream);
  embed.Add("wte", {config.vocab, c}, InitKind::kNormal, kStd);
  embed.Add("wpe", {config.context, c}, InitKind::kNormal, 0.01);
  spec.units.push_back(embed.Take());

  for (int l = 0; l < config.num_layers; ++l) {
    UnitBuilder block(absl::StrCat("block", l), &stream);
    block.Add("ln1.w", {c}, InitKind::kOnes);
    block.Add("ln1.b", {c}, InitKind::kZeros);
    block.Add("attn.qkv.w", {3 * c, c}, InitKind::kNormal, kStd);
    block.Add("attn.qkv.b", {3 * c}, InitKind::kZeros);
    block.Add("attn.proj.w", {c, c}, InitKind::kNormal, residual_std);
    block.Add("attn.proj.b", {c}, InitKind::kZeros);
    block.Add("ln2.w", {c}, InitKind::kOnes);
    block.Add("ln2.b", {c}, InitKind::kZeros);
    block.Add("mlp.fc.w", {4 * c, c}, InitKind::kNormal, kStd);
    block.Add("mlp.fc.b", {4 * c}, InitKind::kZeros);
    block.Add("mlp.proj.w", {c, 4 * c}, InitKind::kNormal, residual_std);
    block.Add("mlp.proj.b", {c}, InitKind::kZeros);
    spec.units.push_back(block.Take());
  }

  UnitBuilder head("head", &stream);
  head.Add("lnf.w", {c}, InitKind::kOnes);
  head.Add("lnf.b", {c}, InitKind::kZeros);
  head.Add("lm_head.w", {config.vocab, c}, InitKind::kNormal, kStd);
  spec.units.push_back(head.Take());
  return spec;
}

namespace {

// Calls fn(tensor, first_element_in_tensor, out_index, count) for every piece
// of [begin, begin + n) that falls inside a tensor of the unit.
template <typename Fn>
void ForEachTensorPiece(const UnitSpec& unit, int64_t begin, int64_t n, Fn fn) {
  const int64_t end = begin + n;
  for (const TensorSpec& t : unit.tensors) {
    const int64_t lo = std::max(begin, t.offset);
    const int64_t hi = std::min(end, t.offset + t.numel);
    if (lo < hi) fn(t, lo - t.offset, lo - begin, hi - lo);
  }
}

}  // namespace

void InitializeUnitRange(const UnitSpec& unit, uint64_t seed, int64_t begin, std::span<float> out) {
  std::fill(out.begin(), out.end(), 0.0f);
  ForEachTensorPiece(unit, begin, static_cast<int64_t>(out.size()),
                     [&](const TensorSpec& t, int64_t first, int64_t at, int64_t count) {
                       for (int64_t i = 0; i < count; ++i) {
                         float v = 0.0f;
                         switch (t.init) {
                           case InitKind::kZeros: v = 0.0f; break;
                           case InitKind::kOnes: v = 1.0f; break;
                           case InitKind::kNormal:
                             v = static_cast<float>(t.init_std *
                                                    NormalAt(seed, t.rng_stream, first + i));
                             break;
                         }
                         out[at + i] = v;
                       }
                     });
}

std::vector<ElementRun> WeightDecayRuns(const UnitSpec& unit, int64_t begin, int64_t length) {
  std::vector<ElementRun> runs;
  ForEachTensorPiece(unit, begin, length,
                     [&](const TensorSpec& t, int64_t, int64_t at, int64_t count) {
                       if (!t.weight_decay) return;
                       if (!runs.empty() && runs.back().end == at) {
                         runs.back().end = at + count;
                       } else {
                         runs.push_back({at, at + count});
                       }
                     });
  return runs;
}

}  // namespace pshard
