#include "common/json.h"

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

TEST(JsonTest, RefusesDeepNesting) {
  EXPECT_FALSE(ParseJson(std::string(1000, '[') + std::string(1000, ']')).ok());
}

}  // namespace
}  // namespace pshard
