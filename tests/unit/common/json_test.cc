#include "common/json.h"

#include <cmath>
#include <string>

#include "gtest/gtest.h"

namespace pshard {
namespace {

TEST(JsonTest, ParsesEveryKindOfValue) {
  auto v = ParseJson(R"({"a": [1, -2.5e3, true, false, null], "s": "x\"y\\n\u00e9", "o": {}})");
  ASSERT_TRUE(v.ok()) << v.status();
  const JsonValue::Array& a = v->Find("a")->as_array();
  ASSERT_EQ(a.size(), 5u);
  EXPECT_EQ(a[0].as_number(), 1);
  EXPECT_EQ(a[1].as_number(), -2500);
  EXPECT_TRUE(a[2].as_bool());
  EXPECT_FALSE(a[3].as_bool());
  EXPECT_TRUE(a[4].is_null());
  EXPECT_EQ(v->Find("s")->as_string(), "x\"y\\n\xc3\xa9");
  EXPECT_TRUE(v->Find("o")->as_object().empty());
  EXPECT_EQ(v->Find("missing"), nullptr);
}

TEST(JsonTest, ErrorsNameTheLineAndColumn) {
  for (const char* bad : {"", "{", "[1,]", "{\"a\" 1}", "{\"a\":1,\"a\":2}", "\"unterminated", "[1] 2", "nul",
                          "{\"a\":\"\x01\"}", "[\"\\q\"]"}) {
    auto v = ParseJson(bad);
    ASSERT_FALSE(v.ok()) << bad;
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(v.status().message().find("line"), std::string::npos) << v.status();
  }
  auto v = ParseJson("{\n  \"a\": [1,\n  2,,]\n}");
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("line 3"), std::string::npos) << v.status();
}

TEST(JsonTest, WritesWhatItReadsBack) {
  const char* doc =
      "{\"a\": [1, -2500, 0.1, 1e300, true, false, null, [], {}], \"s\": \"x\\\"y\\\\n\\u0001\\t\\u00e9\", "
      "\"o\": {\"z\": {\"k\": 123456789012}}}";
  auto v = ParseJson(doc);
  ASSERT_TRUE(v.ok()) << v.status();
  const std::string text = FormatJson(*v);
  auto back = ParseJson(text);
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << text;
  EXPECT_EQ(FormatJson(*back), text);
  const JsonValue::Array& a = back->Find("a")->as_array();
  EXPECT_EQ(a[1].as_number(), -2500);
  EXPECT_EQ(a[2].as_number(), 0.1);
  EXPECT_EQ(a[3].as_number(), 1e300);
  EXPECT_EQ(back->Find("s")->as_string(), v->Find("s")->as_string());
  EXPECT_EQ(back->Find("o")->Find("z")->Find("k")->as_number(), 123456789012.0);
  EXPECT_NE(text.find("\"k\": 123456789012\n"), std::string::npos) << text;
  EXPECT_EQ(FormatJson(JsonValue::Number(std::nan(""))), "null\n");
  const std::string line = FormatJson(*v, /*one_line=*/true);
  EXPECT_EQ(line.find('\n'), line.size() - 1) << line;
  auto from_line = ParseJson(line);
  ASSERT_TRUE(from_line.ok()) << from_line.status();
  EXPECT_EQ(FormatJson(*from_line), text);
}

TEST(JsonTest, RefusesDeepNesting) {
  EXPECT_FALSE(ParseJson(std::string(1000, '[') + std::string(1000, ']')).ok());
}

}  // namespace
}  // namespace pshard
