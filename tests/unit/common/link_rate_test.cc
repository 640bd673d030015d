// Link rates: tc's units in bits and bytes, and how a rate is read back.
#include "common/link_rate.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pshard {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(LinkRate, ParsesBitsAndBytesUnits) {
  EXPECT_DOUBLE_EQ(*ParseLinkRate("100mbit"), 12.5e6);
  EXPECT_DOUBLE_EQ(*ParseLinkRate("1Gbit"), 125e6);
  EXPECT_DOUBLE_EQ(*ParseLinkRate("500kbit"), 62.5e3);
  EXPECT_DOUBLE_EQ(*ParseLinkRate("50Mbps"), 50e6);
  EXPECT_DOUBLE_EQ(*ParseLinkRate(" 2.5gbps "), 2.5e9);
  EXPECT_EQ(*ParseLinkRate(""), 0.0);
  EXPECT_EQ(*ParseLinkRate("0"), 0.0);
}

TEST(LinkRate, RefusesWhatIsNotARate) {
  for (const char* bad : {"fast", "100", "100mbits", "-5mbit", "mbit", "1.2.3mbit"}) {
    EXPECT_EQ(ParseLinkRate(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_THAT(ParseLinkRate("100mb").status().message(), HasSubstr("unknown unit 'mb'"));
}

TEST(LinkRate, DescribesARateInBothUnits) {
  EXPECT_EQ(*DescribeLinkRate("100mbit"), "100mbit = 100 Mbit/s = 12.5 MB/s");
  EXPECT_EQ(*DescribeLinkRate("0"), "no limit");
  EXPECT_THAT(*DescribeLinkRate("1gbit"), Not(HasSubstr("note")));
}

TEST(LinkRate, FlagsABytesRateAsEightTimesTheBits) {
  const std::string text = *DescribeLinkRate("50Mbps");
  EXPECT_THAT(text, HasSubstr("400 Mbit/s"));
  EXPECT_THAT(text, HasSubstr("50 MB/s"));
  EXPECT_THAT(text, HasSubstr("8x 50mbit"));
  EXPECT_THAT(text, HasSubstr("write 50mbit"));
  EXPECT_FALSE(DescribeLinkRate("50 furlongs").ok());
}

TEST(EthernetBytesTest, EverySegmentCarriesItsHeaders) {
  EXPECT_EQ(EthernetBytes(0), 0);
  EXPECT_EQ(EthernetBytes(1), 67);
  EXPECT_EQ(EthernetBytes(1448), 1514);  // one full frame at a 1500-byte MTU
  EXPECT_EQ(EthernetBytes(1449), 1449 + 2 * 66);
  // A large message: 1514 / 1448 of its payload.
  EXPECT_NEAR(static_cast<double>(EthernetBytes(1448 * 1000)) / (1448 * 1000), 1514.0 / 1448, 1e-12);
}

}  // namespace
}  // namespace pshard
