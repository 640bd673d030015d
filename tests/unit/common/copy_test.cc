#include "common/copy.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace pshard {
namespace {

TEST(CopyBytesTest, CopiesEveryLengthAndAlignmentAroundItsThresholds) {
  constexpr size_t kMax = (size_t{4} << 20) + 300;
  std::vector<unsigned char> src(kMax + 16), dst(kMax + 16);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 131 + 7);
  for (size_t length : {size_t{0}, size_t{1}, size_t{63}, size_t{255}, size_t{256}, size_t{257}, size_t{319},
                        size_t{320}, size_t{4096 + 17}, size_t{4} << 20, (size_t{4} << 20) + 1, kMax}) {
    for (size_t from : {0, 1, 7}) {
      for (size_t to : {0, 3, 8}) {
        std::fill(dst.begin(), dst.end(), 0xee);
        CopyBytes(dst.data() + to, src.data() + from, length);
        for (size_t i = 0; i < to; ++i) ASSERT_EQ(dst[i], 0xee) << "wrote before the range";
        for (size_t i = 0; i < length; ++i) {
          ASSERT_EQ(dst[to + i], src[from + i]) << "length " << length << " byte " << i;
        }
        ASSERT_EQ(dst[to + length], 0xee) << "wrote past the range, length " << length;
      }
    }
  }
}

}  // namespace
}  // namespace pshard
