#include "common/host_port.h"

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pshard {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(HostPortTest, ReadsNamesIpv4AndBracketedIpv6) {
  absl::StatusOr<HostPort> a = ParseHostPort("shard-0.example:50051");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->host, "shard-0.example");
  EXPECT_EQ(a->port, 50051);
  absl::StatusOr<HostPort> b = ParseHostPort("[::1]:65535");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->host, "::1");
  EXPECT_EQ(b->port, 65535);
  absl::StatusOr<HostPort> c = ParseHostPort("127.0.0.1:0", /*min_port=*/0);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->port, 0);
}

TEST(HostPortTest, RefusesPortsThatWouldWrapOrAreOutOfRange) {
  // 366499602 mod 65536 is 22290: a parser that wraps dials a stranger's port.
  for (const char* bad : {"127.0.0.1:366499602", "127.0.0.1:65536", "127.0.0.1:0", "127.0.0.1:-1",
                          "127.0.0.1:0065535", "127.0.0.1:", "127.0.0.1:12a", "127.0.0.1:+80", ":80", "host",
                          "::1:80", "[::1:80", "[]:80"}) {
    absl::StatusOr<HostPort> parsed = ParseHostPort(bad);
    EXPECT_FALSE(parsed.ok()) << bad << " read as port " << parsed->port;
    if (!parsed.ok()) {
      EXPECT_THAT(parsed.status().message(), HasSubstr(absl::StrCat("\"", bad, "\" is not host:port")));
      EXPECT_THAT(parsed.status().message(), HasSubstr("1..65535"));
    }
  }
}

TEST(HostPortTest, ListsAreCheckedOneAddressAtATime) {
  absl::StatusOr<std::vector<std::string>> ok = ParseAddressList("a:1, b:2,[::1]:3", "--servers");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_THAT(*ok, ElementsAre("a:1", "b:2", "[::1]:3"));
  absl::StatusOr<std::vector<std::string>> bad = ParseAddressList("a:1,b:99999", "--servers");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("--servers: \"b:99999\" is not host:port"));
  EXPECT_FALSE(ParseAddressList("", "--servers").ok());
  EXPECT_FALSE(ParseAddressList(" , ", "--servers").ok());
}

}  // namespace
}  // namespace pshard
