// Sampling from a GPT: deterministic for a seed, greedy at temperature 0,
// the context window sliding over long text, and bad requests refused.
#include "trainer_client/model/sampler.h"

#include <algorithm>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "trainer_client/model/gpt.h"
#include "trainer_client/model/gpt_spec.h"

namespace pshard {
namespace {

using ::testing::HasSubstr;

constexpr GptConfig kConfig = {.num_layers = 2, .d_model = 16, .num_heads = 2, .context = 8, .vocab = 256};

struct Model {
  ModelSpec spec;
  std::vector<std::vector<float>> units;
};

Model Initial() {
  Model m{MakeGptSpec(kConfig).value(), {}};
  for (const UnitSpec& unit : m.spec.units) {
    std::vector<float> w(unit.numel);
    InitializeUnitRange(unit, 11, 0, w);
    m.units.push_back(std::move(w));
  }
  return m;
}

std::vector<int32_t> Prompt() { return {'T', 'h', 'e', ' '}; }

TEST(SampleGptTest, TheSameSeedGivesTheSameTextAndAnotherSeedOther) {
  const Model m = Initial();
  SampleOptions options;
  options.tokens = 40;
  options.temperature = 1.0;
  options.seed = 5;
  absl::StatusOr<std::vector<int32_t>> a = SampleGpt(m.spec, m.units, Prompt(), options);
  absl::StatusOr<std::vector<int32_t>> b = SampleGpt(m.spec, m.units, Prompt(), options);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(a->size(), 44u);
  const std::vector<int32_t> prompt = Prompt();
  EXPECT_TRUE(std::equal(prompt.begin(), prompt.end(), a->begin()));
  EXPECT_EQ(*a, *b);
  options.seed = 6;
  absl::StatusOr<std::vector<int32_t>> c = SampleGpt(m.spec, m.units, Prompt(), options);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(*a, *c);
}

// The most likely next token, from a forward over exactly `tokens`.
int32_t ArgmaxNext(const Model& m, const std::vector<int32_t>& tokens) {
  CpuGpt<float> model = CpuGpt<float>::Create(m.spec, 1, static_cast<int>(tokens.size())).value();
  EXPECT_TRUE(model.SetBatch(tokens, std::vector<int32_t>(tokens.size(), 0)).ok());
  for (int u = 0; u < model.num_units(); ++u) model.ForwardUnit(u, m.units[u]);
  std::span<const float> p = model.Probabilities(0, static_cast<int>(tokens.size()) - 1);
  return static_cast<int32_t>(std::max_element(p.begin(), p.end()) - p.begin());
}

TEST(SampleGptTest, TemperatureZeroTakesTheMostLikelyTokenOverASlidingWindow) {
  const Model m = Initial();
  SampleOptions greedy;
  greedy.tokens = 12;  // the text outgrows the 8-token context
  greedy.temperature = 0.0;
  absl::StatusOr<std::vector<int32_t>> text = SampleGpt(m.spec, m.units, Prompt(), greedy);
  ASSERT_TRUE(text.ok()) << text.status();
  for (size_t i = Prompt().size(); i < text->size(); ++i) {
    const size_t from = i > static_cast<size_t>(kConfig.context) ? i - kConfig.context : 0;
    const std::vector<int32_t> window(text->begin() + from, text->begin() + i);
    EXPECT_EQ((*text)[i], ArgmaxNext(m, window)) << "token " << i;
  }
  SampleOptions top1;
  top1.tokens = 12;
  top1.temperature = 1.5;
  top1.top_k = 1;
  EXPECT_EQ(SampleGpt(m.spec, m.units, Prompt(), top1).value(), *text);
}

TEST(SampleGptTest, BadRequestsAreRefused) {
  const Model m = Initial();
  SampleOptions options;
  EXPECT_THAT(SampleGpt(m.spec, m.units, {}, options).status().message(), HasSubstr("at least one token"));
  EXPECT_THAT(SampleGpt(m.spec, m.units, {300}, options).status().message(), HasSubstr("outside the vocabulary"));
  options.temperature = -1;
  EXPECT_EQ(SampleGpt(m.spec, m.units, Prompt(), options).status().code(), absl::StatusCode::kInvalidArgument);
  options.temperature = 1;
  std::vector<std::vector<float>> short_units = m.units;
  short_units[1].pop_back();
  EXPECT_THAT(SampleGpt(m.spec, short_units, Prompt(), options).status().message(), HasSubstr("block0"));
  ModelSpec other = m.spec;
  other.model = "mlp";
  EXPECT_THAT(SampleGpt(other, m.units, Prompt(), options).status().message(), HasSubstr("not a GPT"));
}

}  // namespace
}  // namespace pshard
