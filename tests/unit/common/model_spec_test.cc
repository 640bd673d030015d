// Layouts as data: the builder, validation, the JSON document and the
// fingerprint, on layouts that are not a GPT's.
#include "common/model_spec.h"

#include <bit>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/layout_file.h"
#include "common/partition.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pshard {
namespace {

using ::testing::HasSubstr;

// A two-layer MLP: what the GPT is not.
ModelSpec Mlp() {
  ModelSpecBuilder b("mlp in=6 hidden=5 out=3");
  b.AddUnit("fc1");
  b.AddTensor("fc1.weight", {5, 6}, InitKind::kNormal, 0.1, true);
  b.AddTensor("fc1.bias", {5}, InitKind::kZeros, 0.0, false);
  b.AddUnit("fc2");
  b.AddTensor("fc2.weight", {3, 5}, InitKind::kGiven, 0.0, true);
  b.AddTensor("fc2.scale", {}, InitKind::kOnes, 0.0, false);
  absl::StatusOr<ModelSpec> spec = std::move(b).Build();
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

TEST(ModelSpecBuilderTest, OffsetsSizesAndStreamsFollowTheOrder) {
  const ModelSpec spec = Mlp();
  ASSERT_EQ(spec.units.size(), 2u);
  EXPECT_EQ(spec.units[0].numel, 35);
  EXPECT_EQ(spec.units[1].numel, 16);
  EXPECT_EQ(spec.TotalParameters(), 51);
  EXPECT_EQ(spec.num_tensors(), 4);
  EXPECT_EQ(spec.units[0].tensors[1].offset, 30);
  EXPECT_EQ(spec.units[1].tensors[1].offset, 15);
  EXPECT_EQ(spec.units[1].tensors[1].numel, 1);  // a scalar
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(spec.units[i / 2].tensors[i % 2].rng_stream, static_cast<uint64_t>(i));
  }
  EXPECT_TRUE(spec.HasGivenValues());
}

// The message of the error a layout built by `build` gets.
template <typename Fn>
std::string Refusal(Fn build) {
  ModelSpecBuilder b("test");
  build(b);
  absl::StatusOr<ModelSpec> spec = std::move(b).Build();
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(spec.status().message());
}

TEST(ModelSpecBuilderTest, BadLayoutsAreRefusedNamingWhat) {
  EXPECT_THAT(Refusal([](ModelSpecBuilder&) {}), HasSubstr("no units"));
  EXPECT_THAT(Refusal([](ModelSpecBuilder& b) { b.AddTensor("w", {2}, InitKind::kZeros, 0, false); }),
              HasSubstr("before any unit"));
  EXPECT_THAT(Refusal([](ModelSpecBuilder& b) { b.AddUnit("u"); }), HasSubstr("unit u has no tensors"));
  EXPECT_THAT(Refusal([](ModelSpecBuilder& b) {
                b.AddUnit("u");
                b.AddTensor("w", {2}, InitKind::kZeros, 0, false);
                b.AddUnit("u");
                b.AddTensor("v", {2}, InitKind::kZeros, 0, false);
              }),
              HasSubstr("two units are named u"));
  EXPECT_THAT(Refusal([](ModelSpecBuilder& b) {
                b.AddUnit("a");
                b.AddTensor("w", {2}, InitKind::kZeros, 0, false);
                b.AddUnit("b");
                b.AddTensor("w", {3}, InitKind::kZeros, 0, false);
              }),
              HasSubstr("two tensors are named w"));
  EXPECT_THAT(Refusal([](ModelSpecBuilder& b) {
                b.AddUnit("u");
                b.AddTensor("w", {4, 0}, InitKind::kZeros, 0, false);
              }),
              HasSubstr("dimension 0 in shape [4, 0]"));
  EXPECT_THAT(Refusal([](ModelSpecBuilder& b) {
                b.AddUnit("u");
                b.AddTensor("__metadata__", {1}, InitKind::kZeros, 0, false);
              }),
              HasSubstr("reserved"));
  EXPECT_THAT(Refusal([](ModelSpecBuilder& b) {
                b.AddUnit("u");
                b.AddTensor("", {1}, InitKind::kZeros, 0, false);
              }),
              HasSubstr("printable"));
  EXPECT_THAT(Refusal([](ModelSpecBuilder& b) {
                b.AddUnit("u");
                b.AddTensor("w", {3}, InitKind::kNormal, -0.5, false);
              }),
              HasSubstr("standard deviation"));
  EXPECT_THAT(Refusal([](ModelSpecBuilder& b) {
                b.AddUnit("u");
                b.AddTensor("w", {3}, InitKind::kNormal, std::numeric_limits<double>::infinity(), false);
              }),
              HasSubstr("standard deviation"));
  EXPECT_THAT(Refusal([](ModelSpecBuilder& b) {
                b.AddUnit("u");
                b.AddTensor("w", {int64_t{1} << 30, int64_t{1} << 30}, InitKind::kZeros, 0, false);
              }),
              HasSubstr("more than"));
  EXPECT_THAT(Refusal([](ModelSpecBuilder& b) {
                b.AddUnit("u");
                b.AddTensor("w", std::vector<int64_t>(kMaxTensorRank + 1, 1), InitKind::kZeros, 0, false);
              }),
              HasSubstr("dimensions"));
}

TEST(ModelSpecTest, EditedOffsetsAreRefused) {
  ModelSpec spec = Mlp();
  EXPECT_TRUE(ValidateModelSpec(spec).ok());
  spec.units[0].tensors[1].offset = 29;
  EXPECT_THAT(ValidateModelSpec(spec).message(), HasSubstr("fc1.bias"));
  spec = Mlp();
  spec.units[1].numel = 17;
  EXPECT_THAT(ValidateModelSpec(spec).message(), HasSubstr("unit fc2 says 17 elements"));
}

TEST(LayoutFileTest, TheDocumentReadsBackToTheSameLayout) {
  const ModelSpec spec = Mlp();
  for (bool one_line : {false, true}) {
    absl::StatusOr<ModelSpec> back = ParseLayoutJson(FormatLayoutJson(spec, one_line));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->model, spec.model);
    ASSERT_EQ(back->units.size(), spec.units.size());
    for (size_t u = 0; u < spec.units.size(); ++u) {
      ASSERT_EQ(back->units[u].tensors.size(), spec.units[u].tensors.size());
      for (size_t i = 0; i < spec.units[u].tensors.size(); ++i) {
        const TensorSpec& a = back->units[u].tensors[i];
        const TensorSpec& b = spec.units[u].tensors[i];
        EXPECT_EQ(a.name, b.name);
        EXPECT_EQ(a.shape, b.shape);
        EXPECT_EQ(a.init, b.init);
        EXPECT_EQ(std::bit_cast<uint64_t>(a.init_std), std::bit_cast<uint64_t>(b.init_std)) << a.name;
        EXPECT_EQ(a.weight_decay, b.weight_decay);
        EXPECT_EQ(a.offset, b.offset);
      }
    }
    EXPECT_EQ(LayoutFingerprint(*back), LayoutFingerprint(spec));
  }
  // A standard deviation that needs all 17 digits survives the trip.
  ModelSpecBuilder b("odd std");
  b.AddUnit("u");
  b.AddTensor("w", {4}, InitKind::kNormal, 0.02 / std::sqrt(2.0 * 7), true);
  const ModelSpec odd = *std::move(b).Build();
  absl::StatusOr<ModelSpec> back = ParseLayoutJson(FormatLayoutJson(odd));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->units[0].tensors[0].init_std, odd.units[0].tensors[0].init_std);
}

TEST(LayoutFileTest, WhatATrainerWouldWriteByHandIsRead) {
  const std::string text = R"({
    "format": "pshard-layout/1", "model": "mlp",
    "units": [{"name": "fc", "tensors": [
      {"name": "fc.w", "shape": [3, 2], "init": "normal", "std": 0.5, "weight_decay": true},
      {"name": "fc.b", "shape": [3], "init": "zeros"}]}]})";
  absl::StatusOr<ModelSpec> spec = ParseLayoutJson(text);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->TotalParameters(), 9);
  EXPECT_FALSE(spec->units[0].tensors[1].weight_decay);  // the default
  EXPECT_EQ(spec->units[0].tensors[0].init_std, 0.5);
}

TEST(LayoutFileTest, MalformedDocumentsAreRefusedNamingWhere) {
  struct Case {
    std::string text, expected;
  };
  const std::string head = R"({"format": "pshard-layout/1", "model": "m", "units": )";
  const std::vector<Case> cases = {
      {"[1, 2]", "not an object"},
      {"{\"format\": \"pshard-layout/9\", \"model\": \"m\", \"units\": []}", "pshard-layout/9"},
      {head + "[]}", "no units"},
      {head + "[{\"name\": \"u\", \"tensors\": []}], \"extra\": 1}", "unknown member \"extra\""},
      {head + "[{\"name\": \"u\", \"tensors\": [{\"name\": \"w\", \"shape\": [2], \"init\": \"normal\"}]}]}",
       "needs a number \"std\""},
      {head + "[{\"name\": \"u\", \"tensors\": [{\"name\": \"w\", \"shape\": [2], \"init\": \"zeros\", \"std\": 1}]}]}",
       "\"std\" is for normal"},
      {head + "[{\"name\": \"u\", \"tensors\": [{\"name\": \"w\", \"shape\": [2.5], \"init\": \"zeros\"}]}]}",
       "whole number"},
      {head + "[{\"name\": \"u\", \"tensors\": [{\"name\": \"w\", \"shape\": [-1], \"init\": \"zeros\"}]}]}",
       "whole number"},
      {head + "[{\"name\": \"u\", \"tensors\": [{\"name\": \"w\", \"shape\": [2], \"init\": \"uniform\"}]}]}",
       "unknown initialisation \"uniform\""},
      {head + "[{\"name\": \"u\", \"tensors\": [{\"name\": \"w\", \"shape\": [2], \"init\": \"ones\", \"decay\": true}]}]}",
       "unknown member \"decay\""},
      {head + "[{\"name\": \"u\", \"tensors\": [{\"name\": \"w\", \"shape\": [2], \"init\": \"ones\", "
              "\"weight_decay\": 1}]}]}",
       "true or false"},
      {head + "[{\"name\": \"u\"}]}", "\"tensors\" must be an array"},
      {head + "[{\"name\": \"u\", \"tensors\": [{\"name\": \"w\", \"shape\": [2], \"init\": \"ones\"}]}",
       "layout:"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<ModelSpec> got = ParseLayoutJson(c.text);
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(got.status().message(), HasSubstr(c.expected)) << c.text;
  }
  EXPECT_EQ(ReadLayoutFile("/nonexistent/layout.json").status().code(), absl::StatusCode::kNotFound);
}

TEST(LayoutFingerprintTest, AnyChangeChangesIt) {
  const ModelSpec base = Mlp();
  const uint64_t fp = LayoutFingerprint(base);
  std::vector<ModelSpec> changed;
  ModelSpec s = base;
  s.model = "mlp2";
  changed.push_back(s);
  s = base;
  s.units[0].tensors[0].init_std = 0.2;
  changed.push_back(s);
  s = base;
  s.units[0].tensors[1].weight_decay = true;
  changed.push_back(s);
  s = base;
  s.units[1].tensors[1].init = InitKind::kZeros;
  changed.push_back(s);
  s = base;
  s.units[0].tensors[0].name = "fc1.w";
  changed.push_back(s);
  s = base;
  s.units[0].tensors[0].shape = {6, 5};
  changed.push_back(s);
  s = base;
  s.units[1].name = "out";
  changed.push_back(s);
  for (const ModelSpec& c : changed) EXPECT_NE(LayoutFingerprint(c), fp);
  EXPECT_EQ(LayoutFingerprint(Mlp()), fp);
  EXPECT_EQ(FingerprintHex(0x1234), "0x0000000000001234");
}

TEST(InitializeUnitRangeTest, RulesOfALayoutThatIsNotAGpt) {
  const ModelSpec spec = Mlp();
  std::vector<float> fc1(40, -1.0f);  // 35 elements and 5 of padding
  InitializeUnitRange(spec.units[0], 3, 0, fc1);
  double sum_sq = 0;
  for (int i = 0; i < 30; ++i) sum_sq += fc1[i] * fc1[i];
  EXPECT_GT(sum_sq, 0.0);
  for (int i = 30; i < 40; ++i) EXPECT_EQ(fc1[i], 0.0f) << i;  // zeros, then padding
  std::vector<float> fc2(16, -1.0f);
  InitializeUnitRange(spec.units[1], 3, 0, fc2);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(fc2[i], 0.0f) << i;  // given: the caller fills it
  EXPECT_EQ(fc2[15], 1.0f);
  // The same values whatever range a shard initialises.
  for (int shards : {2, 3, 7}) {
    const UnitPartition p = *PartitionUnit(spec.units[0].numel, shards, 4);
    for (int s = 0; s < shards; ++s) {
      const SliceRange r = p.Slice(s);
      std::vector<float> slice(r.length);
      InitializeUnitRange(spec.units[0], 3, r.begin, slice);
      for (int64_t i = 0; i < r.length; ++i) {
        const float want = r.begin + i < 40 ? fc1[r.begin + i] : 0.0f;
        EXPECT_EQ(std::bit_cast<uint32_t>(slice[i]), std::bit_cast<uint32_t>(want));
      }
    }
  }
  const std::vector<ElementRun> runs = WeightDecayRuns(spec.units[1], 0, 20);
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0].begin, 0);
  EXPECT_EQ(runs[0].end, 15);
}

}  // namespace
}  // namespace pshard
