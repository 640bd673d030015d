#include "trainer_client/model/gpt_spec.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "common/layout_file.h"
#include "common/partition.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pshard {
namespace {

constexpr GptConfig kGpt2Small = {
    .num_layers = 12, .d_model = 768, .num_heads = 12, .context = 1024, .vocab = 50257};
constexpr GptConfig kSmall = {
    .num_layers = 2, .d_model = 32, .num_heads = 4, .context = 16, .vocab = 64};
constexpr GptConfig kTiny = {
    .num_layers = 1, .d_model = 4, .num_heads = 2, .context = 3, .vocab = 5};

ModelSpec MustMakeSpec(const GptConfig& config) {
  absl::StatusOr<ModelSpec> spec = MakeGptSpec(config);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return spec.ok() ? *std::move(spec) : ModelSpec{};
}

int64_t Product(const std::vector<int64_t>& shape) {
  int64_t p = 1;
  for (int64_t d : shape) p *= d;
  return p;
}

uint32_t Bits(float v) { return std::bit_cast<uint32_t>(v); }

TEST(GptSpecTest, Gpt2SmallParameterCount) {
  const ModelSpec spec = MustMakeSpec(kGpt2Small);
  // By hand, C = 768, V = 50257, T = 1024:
  //   embed: V*C + T*C                         = 38,597,376 + 786,432 = 39,383,808
  //   block: 2C + (3C*C + 3C) + (C*C + C) + 2C
  //          + (4C*C + 4C) + (C*4C + C)        = 12C^2 + 13C = 7,087,872
  //   head:  2C + V*C                          = 38,598,912
  //   total: 39,383,808 + 12 * 7,087,872 + 38,598,912 = 163,037,184
  // which is the familiar 124,439,808 of tied GPT-2 plus the untied V*C head.
  EXPECT_EQ(spec.TotalParameters(), 163037184);
  EXPECT_EQ(spec.TotalParameters() - 50257 * 768, 124439808);
  ASSERT_EQ(spec.units.size(), 14u);
  EXPECT_EQ(spec.units.front().numel, 39383808);
  for (int l = 1; l <= 12; ++l) EXPECT_EQ(spec.units[l].numel, 7087872) << "block " << l - 1;
  EXPECT_EQ(spec.units.back().numel, 38598912);
  const std::vector<int64_t> numels = spec.UnitNumels();
  ASSERT_EQ(numels.size(), spec.units.size());
  for (size_t u = 0; u < numels.size(); ++u) EXPECT_EQ(numels[u], spec.units[u].numel);
}

TEST(GptSpecTest, ModelWordsReadBackToTheSizes) {
  for (const GptConfig& config : {kGpt2Small, kSmall, kTiny, GptConfig{}}) {
    const ModelSpec spec = MustMakeSpec(config);
    EXPECT_EQ(spec.model, GptModelName(config));
    absl::StatusOr<GptConfig> back = GptConfigFromSpec(spec);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->num_layers, config.num_layers);
    EXPECT_EQ(back->d_model, config.d_model);
    EXPECT_EQ(back->num_heads, config.num_heads);
    EXPECT_EQ(back->context, config.context);
    EXPECT_EQ(back->vocab, config.vocab);
    // Through a layout document too, as servers get it from a file.
    absl::StatusOr<ModelSpec> reread = ParseLayoutJson(FormatLayoutJson(spec));
    ASSERT_TRUE(reread.ok()) << reread.status();
    EXPECT_TRUE(GptConfigFromSpec(*reread).ok());
  }
  EXPECT_EQ(GptModelName(kSmall), "gpt layers=2 d_model=32 heads=4 context=16 vocab=64");
}

TEST(GptSpecTest, LayoutsThatAreNotThisGptAreRefused) {
  const ModelSpec spec = MustMakeSpec(kSmall);
  auto refused = [](const ModelSpec& s, const std::string& why) {
    absl::StatusOr<GptConfig> got = GptConfigFromSpec(s);
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << why;
    return std::string(got.status().message());
  };
  ModelSpec other = spec;
  other.model = "torch Mlp";
  EXPECT_THAT(refused(other, "not a gpt"), ::testing::HasSubstr("not a GPT"));
  other.model = "gpt layers=2 d_model=32 heads=4 context=16";
  EXPECT_THAT(refused(other, "vocab missing"), ::testing::HasSubstr("no vocab="));
  other.model = "gpt layers=2 d_model=32 heads=4 context=16 vocab=64 depth=3";
  EXPECT_THAT(refused(other, "unknown size"), ::testing::HasSubstr("depth=3"));
  other.model = GptModelName(kTiny);  // the words of another GPT
  EXPECT_THAT(refused(other, "other sizes"), ::testing::HasSubstr("does not follow"));
  // The right words over a tensor of another shape.
  ModelSpecBuilder b(spec.model);
  for (const UnitSpec& unit : spec.units) {
    b.AddUnit(unit.name);
    for (const TensorSpec& t : unit.tensors) {
      std::vector<int64_t> shape = t.shape;
      if (t.name == "block1.mlp.fc.w") std::swap(shape[0], shape[1]);
      b.AddTensor(t.name, shape, t.init, t.init_std, t.weight_decay);
    }
  }
  absl::StatusOr<ModelSpec> transposed = std::move(b).Build();
  ASSERT_TRUE(transposed.ok());
  EXPECT_THAT(refused(*transposed, "transposed"), ::testing::HasSubstr("block1.mlp.fc.w [32, 128]"));
}

TEST(GptSpecTest, UnitNamesAndBlockLayout) {
  const ModelSpec spec = MustMakeSpec(kSmall);
  ASSERT_EQ(spec.units.size(), 4u);
  EXPECT_EQ(spec.units[0].name, "embed");
  EXPECT_EQ(spec.units[1].name, "block0");
  EXPECT_EQ(spec.units[2].name, "block1");
  EXPECT_EQ(spec.units[3].name, "head");

  const int64_t c = kSmall.d_model;
  struct Expected {
    std::string name;
    std::vector<int64_t> shape;
  };
  const std::vector<Expected> block = {{"block1.ln1.w", {c}},
                                       {"block1.ln1.b", {c}},
                                       {"block1.attn.qkv.w", {3 * c, c}},
                                       {"block1.attn.qkv.b", {3 * c}},
                                       {"block1.attn.proj.w", {c, c}},
                                       {"block1.attn.proj.b", {c}},
                                       {"block1.ln2.w", {c}},
                                       {"block1.ln2.b", {c}},
                                       {"block1.mlp.fc.w", {4 * c, c}},
                                       {"block1.mlp.fc.b", {4 * c}},
                                       {"block1.mlp.proj.w", {c, 4 * c}},
                                       {"block1.mlp.proj.b", {c}}};
  const UnitSpec& unit = spec.units[2];
  ASSERT_EQ(unit.tensors.size(), block.size());
  for (size_t i = 0; i < block.size(); ++i) {
    EXPECT_EQ(unit.tensors[i].name, block[i].name);
    EXPECT_EQ(unit.tensors[i].shape, block[i].shape) << block[i].name;
  }
  EXPECT_EQ(spec.units[0].tensors[0].shape, (std::vector<int64_t>{kSmall.vocab, c}));
  EXPECT_EQ(spec.units[0].tensors[1].shape, (std::vector<int64_t>{kSmall.context, c}));
  EXPECT_EQ(spec.units[3].tensors[2].shape, (std::vector<int64_t>{kSmall.vocab, c}));
}

TEST(GptSpecTest, TensorOffsetsAreContiguous) {
  for (const GptConfig& config : {kGpt2Small, kSmall, kTiny, GptConfig{}}) {
    const ModelSpec spec = MustMakeSpec(config);
    std::set<uint64_t> streams;
    std::set<std::string> names;
    for (const UnitSpec& unit : spec.units) {
      int64_t offset = 0;
      for (const TensorSpec& t : unit.tensors) {
        EXPECT_EQ(t.offset, offset) << t.name;
        EXPECT_EQ(t.numel, Product(t.shape)) << t.name;
        EXPECT_GT(t.numel, 0) << t.name;
        EXPECT_TRUE(absl::StartsWith(t.name, unit.name + ".")) << t.name;
        EXPECT_TRUE(streams.insert(t.rng_stream).second) << "stream reused by " << t.name;
        EXPECT_TRUE(names.insert(t.name).second) << "name reused: " << t.name;
        offset += t.numel;
      }
      EXPECT_EQ(unit.numel, offset) << unit.name;
    }
  }
}

TEST(GptSpecTest, WeightDecayOnMatricesOnly) {
  const ModelSpec spec = MustMakeSpec(kSmall);
  for (const UnitSpec& unit : spec.units) {
    for (const TensorSpec& t : unit.tensors) {
      EXPECT_EQ(t.weight_decay, t.shape.size() == 2) << t.name;
    }
  }
}

TEST(GptSpecTest, FindBySuffix) {
  const ModelSpec spec = MustMakeSpec(kSmall);
  const UnitSpec& block = spec.units[1];
  const TensorSpec* qkv = block.Find("attn.qkv.w");
  ASSERT_NE(qkv, nullptr);
  EXPECT_EQ(qkv->name, "block0.attn.qkv.w");
  EXPECT_EQ(block.Find("lm_head.w"), nullptr);
  ASSERT_NE(spec.units[3].Find("lm_head.w"), nullptr);
}

TEST(GptSpecTest, RejectsInvalidConfigs) {
  std::vector<GptConfig> bad;
  for (int value : {0, -1}) {
    GptConfig c = kSmall;
    c.num_layers = value;
    bad.push_back(c);
    c = kSmall;
    c.d_model = value;
    bad.push_back(c);
    c = kSmall;
    c.num_heads = value;
    bad.push_back(c);
    c = kSmall;
    c.context = value;
    bad.push_back(c);
    c = kSmall;
    c.vocab = value;
    bad.push_back(c);
  }
  GptConfig indivisible = kSmall;
  indivisible.d_model = 30;  // 30 % 4 != 0
  bad.push_back(indivisible);
  indivisible = kGpt2Small;
  indivisible.num_heads = 7;
  bad.push_back(indivisible);
  for (const GptConfig& c : bad) {
    SCOPED_TRACE(::testing::Message()
                 << "layers=" << c.num_layers << " width=" << c.d_model << " heads=" << c.num_heads
                 << " context=" << c.context << " vocab=" << c.vocab);
    EXPECT_EQ(c.Validate().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(MakeGptSpec(c).status().code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_TRUE(GptConfig{}.Validate().ok());
  EXPECT_TRUE(kGpt2Small.Validate().ok());
}

// The whole unit plus some padding, initialised in one call.
std::vector<float> InitWhole(const UnitSpec& unit, uint64_t seed, int64_t padding) {
  std::vector<float> out(static_cast<size_t>(unit.numel + padding));
  InitializeUnitRange(unit, seed, 0, out);
  return out;
}

TEST(InitializeUnitRangeTest, IndependentOfHowTheUnitIsSplit) {
  const ModelSpec spec = MustMakeSpec(kSmall);
  constexpr int64_t kPadding = 37;
  for (const UnitSpec& unit : spec.units) {
    const std::vector<float> whole = InitWhole(unit, 5, kPadding);
    const int64_t total = static_cast<int64_t>(whole.size());
    // Fixed chunk sizes, including ones that cut tensors at odd places.
    for (int64_t chunk : {1, 7, 64, 1000, 4093}) {
      std::vector<float> pieces(whole.size(), std::numeric_limits<float>::quiet_NaN());
      for (int64_t at = 0; at < total; at += chunk) {
        const int64_t n = std::min(chunk, total - at);
        InitializeUnitRange(unit, 5, at, std::span<float>(pieces).subspan(at, n));
      }
      for (int64_t i = 0; i < total; ++i) {
        ASSERT_EQ(Bits(pieces[i]), Bits(whole[i]))
            << unit.name << " chunk " << chunk << " at " << i;
      }
    }
    // The partition's own slices, as shard servers would initialise them.
    for (int n : {2, 3, 5}) {
      absl::StatusOr<UnitPartition> p = PartitionUnit(unit.numel, n, 3);
      ASSERT_TRUE(p.ok());
      for (int s = 0; s < n; ++s) {
        const SliceRange r = p->Slice(s);
        std::vector<float> slice(static_cast<size_t>(r.length), -1.0f);
        InitializeUnitRange(unit, 5, r.begin, slice);
        for (int64_t i = 0; i < r.length; ++i) {
          const float expected = r.begin + i < total ? whole[r.begin + i] : 0.0f;
          ASSERT_EQ(Bits(slice[i]), Bits(expected)) << unit.name << " shard " << s << " at " << i;
        }
      }
    }
  }
}

TEST(InitializeUnitRangeTest, PaddingIsZero) {
  const ModelSpec spec = MustMakeSpec(kSmall);
  const UnitSpec& unit = spec.units[1];
  std::vector<float> out(100, std::numeric_limits<float>::quiet_NaN());
  InitializeUnitRange(unit, 1, unit.numel - 10, out);  // 10 real, 90 padding
  for (int i = 10; i < 100; ++i) EXPECT_EQ(Bits(out[i]), 0u) << i;
  // mlp.proj.b closes the unit: its init is zeros, so all of out is 0.
  for (int i = 0; i < 10; ++i) EXPECT_EQ(out[i], 0.0f) << i;

  std::fill(out.begin(), out.end(), 7.0f);
  InitializeUnitRange(unit, 1, unit.numel + 1000, out);  // all padding
  for (float v : out) EXPECT_EQ(Bits(v), 0u);

  // A range ending in a normal tensor then padding (head ends in lm_head.w).
  const UnitSpec& head = spec.units[3];
  std::vector<float> tail(20, std::numeric_limits<float>::quiet_NaN());
  InitializeUnitRange(head, 1, head.numel - 4, tail);
  for (int i = 0; i < 4; ++i) EXPECT_NE(tail[i], 0.0f) << i;
  for (int i = 4; i < 20; ++i) EXPECT_EQ(Bits(tail[i]), 0u) << i;
}

TEST(InitializeUnitRangeTest, ValuesFollowTheInitKinds) {
  const GptConfig config;  // 4 layers, width 128: tensors of 16k-64k elements
  const ModelSpec spec = MustMakeSpec(config);
  const double residual_std = 0.02 / std::sqrt(2.0 * config.num_layers);
  int normal_tensors = 0;
  for (const UnitSpec& unit : spec.units) {
    const std::vector<float> values = InitWhole(unit, 2024, 0);
    for (const TensorSpec& t : unit.tensors) {
      SCOPED_TRACE(t.name);
      const float* v = values.data() + t.offset;
      if (absl::EndsWith(t.name, "ln1.w") || absl::EndsWith(t.name, "ln2.w") ||
          absl::EndsWith(t.name, "lnf.w")) {
        EXPECT_EQ(t.init, InitKind::kOnes);
        for (int64_t i = 0; i < t.numel; ++i) ASSERT_EQ(v[i], 1.0f) << i;
      } else if (absl::EndsWith(t.name, ".b")) {
        EXPECT_EQ(t.init, InitKind::kZeros);
        for (int64_t i = 0; i < t.numel; ++i) ASSERT_EQ(Bits(v[i]), 0u) << i;
      } else {
        ASSERT_EQ(t.init, InitKind::kNormal);
        ++normal_tensors;
        double expected_std = 0.02;
        if (absl::EndsWith(t.name, "wpe")) expected_std = 0.01;
        if (absl::EndsWith(t.name, "attn.proj.w") || absl::EndsWith(t.name, "mlp.proj.w")) {
          expected_std = residual_std;
        }
        EXPECT_DOUBLE_EQ(t.init_std, expected_std);
        double sum = 0.0;
        double sum_sq = 0.0;
        for (int64_t i = 0; i < t.numel; ++i) {
          sum += v[i];
          sum_sq += static_cast<double>(v[i]) * v[i];
        }
        const double n = static_cast<double>(t.numel);
        const double mean = sum / n;
        const double std = std::sqrt(sum_sq / n - mean * mean);
        // 5 standard errors: SE(mean) = std/sqrt(n), SE(std) ~ std/sqrt(2n).
        EXPECT_NEAR(mean, 0.0, 5.0 * expected_std / std::sqrt(n));
        EXPECT_NEAR(std, expected_std, 5.0 * expected_std / std::sqrt(2.0 * n));
      }
    }
  }
  EXPECT_EQ(normal_tensors, 2 + 4 * config.num_layers + 1);
}

TEST(InitializeUnitRangeTest, DependsOnSeedAndTensor) {
  const ModelSpec spec = MustMakeSpec(kSmall);
  const UnitSpec& block0 = spec.units[1];
  const UnitSpec& block1 = spec.units[2];
  const std::vector<float> a = InitWhole(block0, 1, 0);
  const std::vector<float> again = InitWhole(block0, 1, 0);
  const std::vector<float> other_seed = InitWhole(block0, 2, 0);
  const std::vector<float> other_block = InitWhole(block1, 1, 0);
  const TensorSpec* qkv = block0.Find("attn.qkv.w");
  ASSERT_NE(qkv, nullptr);
  int same_seed_equal = 0;
  int other_seed_equal = 0;
  int other_block_equal = 0;
  for (int64_t i = qkv->offset; i < qkv->offset + qkv->numel; ++i) {
    same_seed_equal += a[i] == again[i];
    other_seed_equal += a[i] == other_seed[i];
    other_block_equal += a[i] == other_block[i];
  }
  EXPECT_EQ(same_seed_equal, qkv->numel);
  EXPECT_LT(other_seed_equal, 10);
  EXPECT_LT(other_block_equal, 10);
  // wte and lm_head have the same shape and std but are different tensors.
  const std::vector<float> embed = InitWhole(spec.units[0], 1, 0);
  const std::vector<float> head = InitWhole(spec.units[3], 1, 0);
  const TensorSpec* lm_head = spec.units[3].Find("lm_head.w");
  ASSERT_NE(lm_head, nullptr);
  int tied_equal = 0;
  for (int64_t i = 0; i < lm_head->numel; ++i) tied_equal += embed[i] == head[lm_head->offset + i];
  EXPECT_LT(tied_equal, 10);
}

// Maximal runs of decayed elements of [begin, begin + length), from a
// per-element mask built from the tensor list.
std::vector<ElementRun> ExpectedDecayRuns(const UnitSpec& unit, int64_t begin, int64_t length) {
  std::vector<ElementRun> runs;
  for (int64_t i = 0; i < length; ++i) {
    const int64_t e = begin + i;
    bool decay = false;
    for (const TensorSpec& t : unit.tensors) {
      if (e >= t.offset && e < t.offset + t.numel) decay = t.shape.size() == 2;
    }
    if (!decay) continue;
    if (!runs.empty() && runs.back().end == i) {
      runs.back().end = i + 1;
    } else {
      runs.push_back({i, i + 1});
    }
  }
  return runs;
}

TEST(WeightDecayRunsTest, ExhaustiveOverRangesOfATinyModel) {
  const ModelSpec spec = MustMakeSpec(kTiny);
  for (const UnitSpec& unit : spec.units) {
    for (int64_t begin = 0; begin <= unit.numel + 2; ++begin) {
      for (int64_t length = 0; begin + length <= unit.numel + 3; ++length) {
        const std::vector<ElementRun> got = WeightDecayRuns(unit, begin, length);
        const std::vector<ElementRun> want = ExpectedDecayRuns(unit, begin, length);
        ASSERT_EQ(got.size(), want.size())
            << unit.name << " begin " << begin << " length " << length;
        for (size_t r = 0; r < got.size(); ++r) {
          ASSERT_EQ(got[r].begin, want[r].begin) << unit.name << " begin " << begin << " run " << r;
          ASSERT_EQ(got[r].end, want[r].end) << unit.name << " begin " << begin << " run " << r;
        }
      }
    }
  }
}

TEST(WeightDecayRunsTest, WholeUnits) {
  const ModelSpec spec = MustMakeSpec(kSmall);
  // wte and wpe are adjacent matrices: one merged run over the whole unit.
  const UnitSpec& embed = spec.units[0];
  std::vector<ElementRun> runs = WeightDecayRuns(embed, 0, embed.numel);
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0].begin, 0);
  EXPECT_EQ(runs[0].end, embed.numel);

  // A block: the four matrices, separated by biases and LayerNorms.
  const UnitSpec& block = spec.units[1];
  runs = WeightDecayRuns(block, 0, block.numel);
  const std::vector<std::string> matrices = {"attn.qkv.w", "attn.proj.w", "mlp.fc.w", "mlp.proj.w"};
  ASSERT_EQ(runs.size(), matrices.size());
  for (size_t i = 0; i < matrices.size(); ++i) {
    const TensorSpec* t = block.Find(matrices[i]);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(runs[i].begin, t->offset) << matrices[i];
    EXPECT_EQ(runs[i].end, t->offset + t->numel) << matrices[i];
  }

  // Offsets are relative to the queried range, and padding never decays.
  const TensorSpec* fc = block.Find("mlp.fc.w");
  runs = WeightDecayRuns(block, fc->offset + 5, 10);
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0].begin, 0);
  EXPECT_EQ(runs[0].end, 10);
  const UnitSpec& head = spec.units[3];
  runs = WeightDecayRuns(head, head.numel - 3, 50);
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0].begin, 0);
  EXPECT_EQ(runs[0].end, 3);
  EXPECT_TRUE(WeightDecayRuns(head, head.numel, 50).empty());
  EXPECT_TRUE(WeightDecayRuns(block, 0, 0).empty());
}

}  // namespace
}  // namespace pshard
