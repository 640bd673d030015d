#include "common/safetensors.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/bf16.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pshard {
namespace {

using ::testing::HasSubstr;

template <typename T>
std::span<const uint8_t> Bytes(const std::vector<T>& v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(T)};
}

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() / absl::StrCat("pshard-st-", getpid(), "-", name)).string();
}

struct Example {
  std::vector<float> w{1.5f, -2.25f, 3.0f, 1e-30f, -0.0f, 65504.0f};
  std::vector<uint16_t> b;
  std::vector<float> empty;
  std::vector<SafetensorsTensorView> views;

  Example() {
    for (float x : {0.5f, -1.0f, 3.140625f}) b.push_back(FloatToBf16(x));
    views = {{"block0.attn.w", SafetensorsDtype::kF32, {2, 3}, Bytes(w)},
             {"block0.ln.b", SafetensorsDtype::kBF16, {3}, Bytes(b)},
             {"zero.rows", SafetensorsDtype::kF32, {0, 4}, Bytes(empty)}};
  }
};

TEST(Safetensors, RoundTripsTensorsAndMetadata) {
  Example ex;
  absl::StatusOr<std::string> bytes = EncodeSafetensors(ex.views, {{"step", "12"}, {"layout", "abc"}});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  uint64_t header = 0;
  std::memcpy(&header, bytes->data(), 8);
  EXPECT_EQ((8 + header) % 8, 0u) << "the data must start 8-byte aligned";
  EXPECT_EQ(bytes->size(), 8 + header + 6 * 4 + 3 * 2);

  absl::StatusOr<SafetensorsFile> file = ParseSafetensors(*bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ(file->tensors.size(), 3u);
  const SafetensorsTensor* w = file->Find("block0.attn.w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->dtype, SafetensorsDtype::kF32);
  EXPECT_EQ(w->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(w->ToFloat(), ex.w);
  const SafetensorsTensor* b = file->Find("block0.ln.b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->dtype, SafetensorsDtype::kBF16);
  EXPECT_EQ(b->ToFloat(), (std::vector<float>{0.5f, -1.0f, 3.140625f}));
  EXPECT_EQ(file->Find("zero.rows")->numel, 0);
  EXPECT_EQ(file->metadata, (std::map<std::string, std::string>{{"layout", "abc"}, {"step", "12"}}));
  EXPECT_EQ(file->Find("nothing"), nullptr);
}

// A reader that shares no code with pshard: Python's json and struct.
TEST(Safetensors, AnIndependentReaderSeesTheSameTensors) {
  Example ex;
  const std::string path = TempPath("independent.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, ex.views, {{"step", "7"}}).ok());
  const std::string script = R"PY(
import json, struct, sys
raw = open(sys.argv[1], "rb").read()
(n,) = struct.unpack("<Q", raw[:8])
header = json.loads(raw[8:8 + n])
data = raw[8 + n:]
print("meta", json.dumps(header.pop("__metadata__"), sort_keys=True))
for name, t in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
    b, e = t["data_offsets"]
    chunk = data[b:e]
    if t["dtype"] == "F32":
        values = struct.unpack("<%df" % (len(chunk) // 4), chunk)
    else:
        values = [struct.unpack("<f", struct.pack("<I", h << 16))[0]
                  for h in struct.unpack("<%dH" % (len(chunk) // 2), chunk)]
    print(name, t["dtype"], "x".join(map(str, t["shape"])), " ".join(repr(v) for v in values))
)PY";
  const std::string script_path = TempPath("reader.py");
  std::ofstream(script_path) << script;
  FILE* p = popen(absl::StrCat("/usr/bin/python3 ", script_path, " ", path, " 2>&1").c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  ASSERT_EQ(pclose(p), 0) << out;
  const std::vector<std::string> lines = absl::StrSplit(out, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 4u) << out;
  EXPECT_EQ(lines[0], "meta {\"step\": \"7\"}");
  EXPECT_EQ(lines[1], "block0.attn.w F32 2x3 1.5 -2.25 3.0 1.0000000031710769e-30 -0.0 65504.0");
  EXPECT_EQ(lines[2], "block0.ln.b BF16 3 0.5 -1.0 3.140625");
  EXPECT_EQ(lines[3], "zero.rows F32 0x4 ");
  std::filesystem::remove(path);
  std::filesystem::remove(script_path);
}

TEST(Safetensors, BadTensorsAreRefusedAndNothingIsWritten) {
  Example ex;
  std::vector<SafetensorsTensorView> twice = {ex.views[0], ex.views[0]};
  EXPECT_THAT(EncodeSafetensors(twice, {}).status().message(), HasSubstr("given twice"));
  std::vector<SafetensorsTensorView> short_data = {ex.views[0]};
  short_data[0].shape = {3, 3};
  EXPECT_THAT(EncodeSafetensors(short_data, {}).status().message(), HasSubstr("its shape needs 36"));
  std::vector<SafetensorsTensorView> reserved = {ex.views[0]};
  reserved[0].name = "__metadata__";
  EXPECT_FALSE(EncodeSafetensors(reserved, {}).ok());
  std::vector<SafetensorsTensorView> negative = {ex.views[2]};
  negative[0].shape = {-1};
  EXPECT_THAT(EncodeSafetensors(negative, {}).status().message(), HasSubstr("negative"));

  const std::string path = TempPath("refused.safetensors");
  EXPECT_FALSE(WriteSafetensors(path, twice, {}).ok());
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(path + ".partial"));
  const std::string no_dir = TempPath("no-such-folder") + "/x.safetensors";
  absl::Status s = WriteSafetensors(no_dir, ex.views, {});
  EXPECT_THAT(s.message(), HasSubstr("cannot create"));
}

// A file with the given header JSON and `data_bytes` zero bytes of data.
std::string FileWith(const std::string& json, size_t data_bytes) {
  std::string out(8, '\0');
  const uint64_t n = json.size();
  std::memcpy(out.data(), &n, 8);
  return out + json + std::string(data_bytes, '\0');
}

TEST(Safetensors, MalformedFilesAreRefusedWithTheReason) {
  struct Case {
    std::string what;
    std::string bytes;
    std::string message;
  };
  std::string huge(8, '\0');
  const uint64_t too_long = kSafetensorsMaxHeaderBytes + 1;
  std::memcpy(huge.data(), &too_long, 8);
  std::string past_end(8, '\0');
  const uint64_t forty = 40;
  std::memcpy(past_end.data(), &forty, 8);
  past_end += "{}";
  const std::vector<Case> cases = {
      {"too short", "abc", "shorter than the header length"},
      {"an oversized header", huge, "at most"},
      {"a header past the end", past_end, "in a file of"},
      {"not JSON", FileWith("{nope", 0), "not JSON"},
      {"not an object", FileWith("[1, 2]", 0), "not a JSON object"},
      {"an unknown dtype", FileWith(R"({"a":{"dtype":"F16","shape":[1],"data_offsets":[0,2]}})", 2), "dtype F16"},
      {"a shape of another size", FileWith(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
       "its shape needs"},
      {"a gap", FileWith(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8), "gap"},
      {"an overlap",
       FileWith(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                8),
       "overlap"},
      {"offsets past the end", FileWith(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8),
       "data_offsets"},
      {"bytes after the last tensor", FileWith(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8),
       "after the last tensor"},
      {"a fractional dimension", FileWith(R"({"a":{"dtype":"F32","shape":[0.5],"data_offsets":[0,4]}})", 4),
       "whole number"},
      {"metadata that is not strings", FileWith(R"({"__metadata__":{"step":3}})", 0), "not a string"},
      {"an extra field", FileWith(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}})", 4),
       "exactly dtype"},
      {"an overflowing shape",
       FileWith(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,4]}})", 4),
       "whole number within the file"},
      // Found by the safetensors fuzzer: the writer could not have written it.
      {"an empty name", FileWith(R"({"":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4), "empty name"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<SafetensorsFile> file = ParseSafetensors(c.bytes);
    EXPECT_FALSE(file.ok()) << c.what;
    EXPECT_THAT(file.status().message(), HasSubstr(c.message)) << c.what;
  }
  EXPECT_EQ(ReadSafetensors(TempPath("missing")).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace pshard
