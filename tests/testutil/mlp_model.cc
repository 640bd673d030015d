#include "tests/testutil/mlp_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/numbers.h"
#include "common/status_macros.h"

namespace pshard::testing {
namespace {

struct MlpSizes {
  int vocab = 0, width = 0, hidden = 0;
};

absl::StatusOr<MlpSizes> SizesOf(const ModelSpec& spec) {
  MlpSizes s;
  const std::vector<std::string> words = absl::StrSplit(spec.model, ' ');
  if (words.size() != 4 || words[0] != "mlp" || !absl::SimpleAtoi(absl::StripPrefix(words[1], "vocab="), &s.vocab) ||
      !absl::SimpleAtoi(absl::StripPrefix(words[2], "width="), &s.width) ||
      !absl::SimpleAtoi(absl::StripPrefix(words[3], "hidden="), &s.hidden)) {
    return absl::InvalidArgumentError(absl::StrCat("not an MLP layout: \"", spec.model, "\""));
  }
  ASSIGN_OR_RETURN(const ModelSpec expected, MakeMlpSpec(s.vocab, s.width, s.hidden));
  if (expected.UnitNumels() != spec.UnitNumels()) {
    return absl::InvalidArgumentError(absl::StrCat("layout \"", spec.model, "\" does not have an MLP's units"));
  }
  return s;
}

class CpuMlp final : public UnitModel {
 public:
  CpuMlp(MlpSizes sizes, int batch, int seq_len)
      : s_(sizes), rows_(int64_t{batch} * seq_len), h_(sizes.hidden + 1), pre_(sizes.hidden + 1) {
    for (auto& v : h_) v.assign(rows_ * s_.width, 0.0f);
    for (auto& v : pre_) v.assign(rows_ * s_.width, 0.0f);
    probs_.assign(rows_ * s_.vocab, 0.0f);
    dh_.assign(rows_ * s_.width, 0.0f);
  }

  absl::Status SetBatch(int lane, std::span<const int32_t> tokens, std::span<const int32_t> targets) override {
    if (lane != 0) return absl::InvalidArgumentError("the MLP has one lane");
    if (static_cast<int64_t>(tokens.size()) != rows_ || static_cast<int64_t>(targets.size()) != rows_) {
      return absl::InvalidArgumentError("batch of the wrong size");
    }
    for (int64_t r = 0; r < rows_; ++r) {
      if (tokens[r] < 0 || tokens[r] >= s_.vocab || targets[r] < 0 || targets[r] >= s_.vocab) {
        return absl::InvalidArgumentError(absl::StrCat("token outside [0, ", s_.vocab, ")"));
      }
    }
    tokens_.assign(tokens.begin(), tokens.end());
    targets_.assign(targets.begin(), targets.end());
    return absl::OkStatus();
  }

  absl::Status ForwardUnit(int unit, std::span<const float> w) override {
    const int c = s_.width;
    if (unit == 0) {
      for (int64_t r = 0; r < rows_; ++r) std::copy_n(w.data() + int64_t{tokens_[r]} * c, c, h_[0].data() + r * c);
    } else if (unit <= s_.hidden) {
      Linear(w.data(), w.data() + int64_t{c} * c, h_[unit - 1], c, pre_[unit]);
      for (int64_t i = 0; i < rows_ * c; ++i) h_[unit][i] = std::max(pre_[unit][i], 0.0f);
    } else {
      const int v = s_.vocab;
      Linear(w.data(), w.data() + int64_t{v} * c, h_[s_.hidden], v, probs_);
      double total = 0.0;
      for (int64_t r = 0; r < rows_; ++r) {
        float* p = probs_.data() + r * v;
        const float top = *std::max_element(p, p + v);
        float sum = 0.0f;
        for (int j = 0; j < v; ++j) sum += (p[j] = std::exp(p[j] - top));
        for (int j = 0; j < v; ++j) p[j] /= sum;
        total += -std::log(static_cast<double>(p[targets_[r]]));
      }
      loss_ = total / static_cast<double>(rows_);
    }
    return absl::OkStatus();
  }

  absl::Status BackwardUnit(int unit, std::span<const float> w, std::span<float> g) override {
    RETURN_IF_ERROR(pending_.Start(unit));
    const int c = s_.width;
    const float inv_rows = 1.0f / static_cast<float>(rows_);
    if (unit == s_.hidden + 1) {
      const int v = s_.vocab;
      std::vector<float> dlogits(probs_);
      for (int64_t r = 0; r < rows_; ++r) {
        dlogits[r * v + targets_[r]] -= 1.0f;
        for (int j = 0; j < v; ++j) dlogits[r * v + j] *= inv_rows;
      }
      LinearBackward(w.data(), h_[s_.hidden], dlogits, v, g.data(), g.data() + int64_t{v} * c);
    } else if (unit >= 1) {
      std::vector<float> dpre(dh_);
      for (int64_t i = 0; i < rows_ * c; ++i) dpre[i] = pre_[unit][i] > 0.0f ? dpre[i] : 0.0f;
      LinearBackward(w.data(), h_[unit - 1], dpre, c, g.data(), g.data() + int64_t{c} * c);
    } else {
      std::fill(g.begin(), g.begin() + int64_t{s_.vocab} * c, 0.0f);
      for (int64_t r = 0; r < rows_; ++r) {
        float* row = g.data() + int64_t{tokens_[r]} * c;
        for (int k = 0; k < c; ++k) row[k] += dh_[r * c + k];
      }
    }
    return absl::OkStatus();
  }

  absl::Status FinishBackward(int unit) override { return pending_.Finish(unit); }
  absl::StatusOr<double> Loss(int) override { return loss_; }
  absl::StatusOr<ModelTimeline> TakeTimeline() override { return ModelTimeline{}; }
  int num_units() const override { return s_.hidden + 2; }
  int lanes() const override { return 1; }
  ModelMemory Memory() const override { return ModelMemory{}; }
  double FlopsPerMicroBatch() const override {
    return 6.0 * static_cast<double>(rows_) * (double{1.0} * s_.hidden * s_.width * s_.width + s_.vocab * s_.width);
  }
  std::string DeviceName() const override { return "cpu"; }
  bool asynchronous() const override { return false; }

 private:
  // out[r] = W x[r] + b for every row: W is [out_dim, width].
  void Linear(const float* weight, const float* bias, const std::vector<float>& x, int out_dim,
              std::vector<float>& out) const {
    const int c = s_.width;
    for (int64_t r = 0; r < rows_; ++r) {
      for (int o = 0; o < out_dim; ++o) {
        float acc = bias[o];
        const float* wr = weight + int64_t{o} * c;
        const float* xr = x.data() + r * c;
        for (int k = 0; k < c; ++k) acc += wr[k] * xr[k];
        out[r * out_dim + o] = acc;
      }
    }
  }
  // Given dout [rows, out_dim]: dW = dout^T x, db = sum of dout's rows, and
  // the input's gradient into dh_.
  void LinearBackward(const float* weight, const std::vector<float>& x, const std::vector<float>& dout, int out_dim,
                      float* dw, float* db) {
    const int c = s_.width;
    std::fill(dw, dw + int64_t{out_dim} * c, 0.0f);
    std::fill(db, db + out_dim, 0.0f);
    std::fill(dh_.begin(), dh_.end(), 0.0f);
    for (int64_t r = 0; r < rows_; ++r) {
      for (int o = 0; o < out_dim; ++o) {
        const float d = dout[r * out_dim + o];
        db[o] += d;
        float* dwr = dw + int64_t{o} * c;
        const float* xr = x.data() + r * c;
        const float* wr = weight + int64_t{o} * c;
        for (int k = 0; k < c; ++k) {
          dwr[k] += d * xr[k];
          dh_[r * c + k] += d * wr[k];
        }
      }
    }
  }

  const MlpSizes s_;
  const int64_t rows_;
  std::vector<int32_t> tokens_, targets_;
  std::vector<std::vector<float>> h_, pre_;  // h_[0]: embeddings; h_[i], pre_[i]: hidden layer i's output
  std::vector<float> probs_, dh_;
  double loss_ = 0.0;
  PendingBackwards pending_;
};

}  // namespace

absl::StatusOr<ModelSpec> MakeMlpSpec(int vocab, int width, int hidden) {
  if (vocab < 1 || width < 1 || hidden < 0) return absl::InvalidArgumentError("bad MLP sizes");
  ModelSpecBuilder b(absl::StrCat("mlp vocab=", vocab, " width=", width, " hidden=", hidden));
  b.AddUnit("embed");
  b.AddTensor("embed.weight", {vocab, width}, InitKind::kNormal, 0.5, true);
  for (int i = 0; i < hidden; ++i) {
    const std::string name = absl::StrCat("hidden", i);
    b.AddUnit(name);
    b.AddTensor(name + ".weight", {width, width}, InitKind::kNormal, 1.0 / std::sqrt(width), true);
    b.AddTensor(name + ".bias", {width}, InitKind::kOnes, 0.0, false);
  }
  b.AddUnit("out");
  b.AddTensor("out.weight", {vocab, width}, InitKind::kNormal, 1.0 / std::sqrt(width), true);
  b.AddTensor("out.bias", {vocab}, InitKind::kZeros, 0.0, false);
  return std::move(b).Build();
}

absl::StatusOr<std::unique_ptr<UnitModel>> CreateCpuMlp(const ModelSpec& spec, const UnitModelOptions& options) {
  ASSIGN_OR_RETURN(const MlpSizes sizes, SizesOf(spec));
  if (options.lanes != 1 || options.batch < 1 || options.seq_len < 1) {
    return absl::InvalidArgumentError("the MLP takes one lane of batch >= 1 x seq_len >= 1");
  }
  return std::make_unique<CpuMlp>(sizes, options.batch, options.seq_len);
}

}  // namespace pshard::testing
