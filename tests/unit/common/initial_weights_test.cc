// Initial weights from a safetensors file: matched to the layout by name
// and shape, strictly, and handed out slice by slice.
#include "common/initial_weights.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "common/checksum.h"
#include "common/rng.h"
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
  ASSERT_TRUE(w->ReadUnitRange(spec.units[0], 0, unit).ok());
  EXPECT_THAT(unit, ::testing::ElementsAre(1, 2, 3, 4, 5, 6, 0.5f, -0.5f, 0.25f, 0, 0, 0));
  std::vector<float> piece(3, -7.0f);
  ASSERT_TRUE(w->ReadUnitRange(spec.units[0], 5, piece).ok());
  EXPECT_THAT(piece, ::testing::ElementsAre(6, 0.5f, -0.5f));
  std::vector<float> b(4);
  ASSERT_TRUE(w->ReadUnitRange(spec.units[1], 0, b).ok());
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

// What a shard reads is its range, from the file, when it asks: a file
// changed since it was checked is refused, not read.
TEST_F(InitialWeightsTest, AFileChangedAfterItWasCheckedIsNotRead) {
  const ModelSpec spec = Layout();
  const std::string path = Write("ok.safetensors", {{"a.w", SafetensorsDtype::kF32, {2, 3}, Bytes(aw)},
                                                    {"a.b", SafetensorsDtype::kF32, {3}, Bytes(ab)},
                                                    {"b.w", SafetensorsDtype::kF32, {4}, Bytes(bw)}});
  const absl::StatusOr<InitialWeights> w = InitialWeights::Load(path, spec);
  ASSERT_TRUE(w.ok()) << w.status();
  std::vector<float> slice(6, -7.0f);  // a.w's last element, a.b, 2 of padding
  ASSERT_TRUE(w->ReadUnitRange(spec.units[0], 5, slice).ok());
  EXPECT_THAT(slice, ::testing::ElementsAre(6, 0.5f, -0.5f, 0.25f, 0, 0));

  std::vector<float> other = bw;
  other[0] = 9.0f;  // the same size
  Write("ok.safetensors", {{"a.w", SafetensorsDtype::kF32, {2, 3}, Bytes(aw)},
                           {"a.b", SafetensorsDtype::kF32, {3}, Bytes(ab)},
                           {"b.w", SafetensorsDtype::kF32, {4}, Bytes(other)}});
  std::filesystem::last_write_time(path, std::filesystem::last_write_time(path) + std::chrono::seconds(1));
  std::vector<float> b(4, -7.0f);
  const absl::Status s = w->ReadUnitRange(spec.units[1], 0, b);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("the file changed after it was checked"));
  std::filesystem::remove(path);
  EXPECT_EQ(w->ReadUnitRange(spec.units[1], 0, b).code(), absl::StatusCode::kDataLoss);
}

// A tensor larger than the reader's piece: the values and the fingerprint
// are those of the whole tensor taken at once, wherever a range falls
// against the pieces.
TEST_F(InitialWeightsTest, ALargeTensorIsReadInPiecesToTheSameResult) {
  const int64_t n = (int64_t{1} << 20) * 3 / 2;
  ModelSpecBuilder b("one large tensor");
  b.AddUnit("u");
  b.AddTensor("u.w", {n}, InitKind::kGiven, 0.0, true);
  const ModelSpec spec = *std::move(b).Build();
  std::vector<uint16_t> values(n);
  for (int64_t i = 0; i < n; ++i) values[i] = FloatToBf16(static_cast<float>(i % 1000) - 500.0f);
  const std::string path = Write("large.safetensors", {{"u.w", SafetensorsDtype::kBF16, {n}, Bytes(values)}});
  std::vector<float> widened(n);
  for (int64_t i = 0; i < n; ++i) widened[i] = Bf16ToFloat(values[i]);
  uint32_t crc = Crc32c("u.w", 3, 0);
  crc = Crc32c(spec.units[0].tensors[0].shape.data(), sizeof(int64_t), crc);
  crc = Crc32c(widened.data(), widened.size() * sizeof(float), crc);
  const uint64_t expected = Mix64((static_cast<uint64_t>(crc) << 32) ^ static_cast<uint64_t>(n)) | 1;

  const absl::StatusOr<InitialWeights> w = InitialWeights::Load(path, spec);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->fingerprint(), expected);
  // A range across the reader's piece boundary, and one past the tensor.
  for (const int64_t begin : {(int64_t{1} << 20) - 100, n - 50}) {
    std::vector<float> got(300, -7.0f);
    ASSERT_TRUE(w->ReadUnitRange(spec.units[0], begin, got).ok());
    const int64_t real = std::min<int64_t>(300, n - begin);
    EXPECT_TRUE(std::equal(got.begin(), got.begin() + real, widened.begin() + begin)) << begin;
    EXPECT_TRUE(std::all_of(got.begin() + real, got.end(), [](float x) { return x == 0.0f; })) << begin;
  }
}

// A file cut short after its header is refused, not read past its end.
TEST_F(InitialWeightsTest, AFileShorterThanItsHeaderSaysIsRefused) {
  const ModelSpec spec = Layout();
  const std::string path = Write("cut.safetensors", {{"a.w", SafetensorsDtype::kF32, {2, 3}, Bytes(aw)},
                                                     {"a.b", SafetensorsDtype::kF32, {3}, Bytes(ab)},
                                                     {"b.w", SafetensorsDtype::kF32, {4}, Bytes(bw)}});
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 4);
  const absl::StatusOr<InitialWeights> w = InitialWeights::Load(path, spec);
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(w.status().message(), HasSubstr("cut.safetensors"));
}

}  // namespace
}  // namespace pshard
