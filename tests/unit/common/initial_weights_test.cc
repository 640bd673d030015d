// Initial weights from a safetensors file: matched to the layout by name
// and shape, strictly, and handed out slice by slice.
#include "common/initial_weights.h"

#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "common/partition.h"
#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pshard {
namespace {

using ::testing::HasSubstr;

ModelSpec Layout() {
  ModelSpecBuilder b("two units");
  b.AddUnit("a");
  b.AddTensor("a.w", {2, 3}, InitKind::kGiven, 0.0, true);
  b.AddTensor("a.b", {3}, InitKind::kZeros, 0.0, false);
  b.AddUnit("b");
  b.AddTensor("b.w", {4}, InitKind::kNormal, 0.1, false);
  return *std::move(b).Build();
}

template <typename T>
std::span<const uint8_t> Bytes(const std::vector<T>& v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(T)};
}

class InitialWeightsTest : public ::testing::Test {
 protected:
  std::string Write(const std::string& name, const std::vector<SafetensorsTensorView>& tensors) {
    const std::string path = (dir_ / name).string();
    EXPECT_TRUE(WriteSafetensors(path, tensors, {}).ok());
    return path;
  }
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / absl::StrCat("pshard-init-", getpid());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::filesystem::path dir_;
  std::vector<float> aw{1, 2, 3, 4, 5, 6}, ab{0.5f, -0.5f, 0.25f}, bw{-1, -2, -3, -4};
};

TEST_F(InitialWeightsTest, FillsSlicesWithTheFilesValuesAndZeroPadding) {
  const ModelSpec spec = Layout();
  const std::string path = Write("ok.safetensors", {{"b.w", SafetensorsDtype::kF32, {4}, Bytes(bw)},
                                                    {"a.w", SafetensorsDtype::kF32, {2, 3}, Bytes(aw)},
                                                    {"a.b", SafetensorsDtype::kF32, {3}, Bytes(ab)}});
  absl::StatusOr<InitialWeights> w = InitialWeights::Load(path, spec);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_NE(w->fingerprint(), 0u);
  std::vector<float> unit(12, -7.0f);  // 9 elements and 3 of padding
  w->FillUnitRange(spec.units[0], 0, unit);
  EXPECT_THAT(unit, ::testing::ElementsAre(1, 2, 3, 4, 5, 6, 0.5f, -0.5f, 0.25f, 0, 0, 0));
  std::vector<float> piece(3, -7.0f);
  w->FillUnitRange(spec.units[0], 5, piece);
  EXPECT_THAT(piece, ::testing::ElementsAre(6, 0.5f, -0.5f));
  std::vector<float> b(4);
  w->FillUnitRange(spec.units[1], 0, b);
  EXPECT_EQ(b, bw);
}

TEST_F(InitialWeightsTest, TheSameValuesInBf16HaveTheSameFingerprint) {
  const ModelSpec spec = Layout();
  std::vector<uint16_t> aw16, ab16, bw16;
  for (float x : aw) aw16.push_back(FloatToBf16(x));
  for (float x : ab) ab16.push_back(FloatToBf16(x));
  for (float x : bw) bw16.push_back(FloatToBf16(x));
  const std::string f32 = Write("f32.safetensors", {{"a.w", SafetensorsDtype::kF32, {2, 3}, Bytes(aw)},
                                                    {"a.b", SafetensorsDtype::kF32, {3}, Bytes(ab)},
                                                    {"b.w", SafetensorsDtype::kF32, {4}, Bytes(bw)}});
  const std::string bf16 = Write("bf16.safetensors", {{"a.w", SafetensorsDtype::kBF16, {2, 3}, Bytes(aw16)},
                                                      {"a.b", SafetensorsDtype::kBF16, {3}, Bytes(ab16)},
                                                      {"b.w", SafetensorsDtype::kBF16, {4}, Bytes(bw16)}});
  std::vector<float> other = bw;
  other[3] = 4.0f;
  const std::string changed = Write("changed.safetensors", {{"a.w", SafetensorsDtype::kF32, {2, 3}, Bytes(aw)},
                                                            {"a.b", SafetensorsDtype::kF32, {3}, Bytes(ab)},
                                                            {"b.w", SafetensorsDtype::kF32, {4}, Bytes(other)}});
  const uint64_t a = InitialWeights::Load(f32, spec)->fingerprint();
  EXPECT_EQ(InitialWeights::Load(bf16, spec)->fingerprint(), a);
  EXPECT_NE(InitialWeights::Load(changed, spec)->fingerprint(), a);
}

TEST_F(InitialWeightsTest, FilesThatDoNotFitTheLayoutAreRefused) {
  const ModelSpec spec = Layout();
  auto refusal = [&](const std::string& path) {
    absl::StatusOr<InitialWeights> w = InitialWeights::Load(path, spec);
    EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(w.status().message());
  };
  EXPECT_THAT(refusal(Write("missing.safetensors", {{"a.w", SafetensorsDtype::kF32, {2, 3}, Bytes(aw)},
                                                    {"a.b", SafetensorsDtype::kF32, {3}, Bytes(ab)}})),
              HasSubstr("no tensor b.w"));
  EXPECT_THAT(refusal(Write("shape.safetensors", {{"a.w", SafetensorsDtype::kF32, {3, 2}, Bytes(aw)},
                                                  {"a.b", SafetensorsDtype::kF32, {3}, Bytes(ab)},
                                                  {"b.w", SafetensorsDtype::kF32, {4}, Bytes(bw)}})),
              HasSubstr("tensor a.w has shape [3, 2]; the layout says [2, 3]"));
  const std::vector<float> extra{9};
  EXPECT_THAT(refusal(Write("extra.safetensors", {{"a.w", SafetensorsDtype::kF32, {2, 3}, Bytes(aw)},
                                                  {"a.b", SafetensorsDtype::kF32, {3}, Bytes(ab)},
                                                  {"b.w", SafetensorsDtype::kF32, {4}, Bytes(bw)},
                                                  {"w", SafetensorsDtype::kF32, {1}, Bytes(extra)}})),
              HasSubstr("tensor w is not in the layout"));
  EXPECT_EQ(InitialWeights::Load((dir_ / "absent").string(), spec).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace pshard
