#include "common/partition.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace pshard {
namespace {

// Checks every property the partition promises for one (numel, N, alignment).
// Returns a failure naming the case and the first property that broke.
::testing::AssertionResult CheckPartition(int64_t numel, int num_shards, int64_t alignment) {
  const std::string where =
      absl::StrCat("numel=", numel, " N=", num_shards, " alignment=", alignment, ": ");
  absl::StatusOr<UnitPartition> p = PartitionUnit(numel, num_shards, alignment);
  if (!p.ok()) return ::testing::AssertionFailure() << where << p.status();
  if (p->numel != numel || p->num_shards != num_shards) {
    return ::testing::AssertionFailure() << where << "numel/num_shards not recorded";
  }
  const int64_t len = p->slice_length;
  if (len < alignment || len % alignment != 0) {
    return ::testing::AssertionFailure()
           << where << "slice_length " << len << " is not a positive multiple of the alignment";
  }
  if (p->padded_numel() != len * num_shards || p->padded_numel() < numel) {
    return ::testing::AssertionFailure()
           << where << "padded_numel " << p->padded_numel() << " does not hold the unit";
  }
  // Minimal: one aligned block less would not hold the unit (or would be empty).
  if (len > alignment && (len - alignment) * num_shards >= numel) {
    return ::testing::AssertionFailure() << where << "slice_length " << len << " is not minimal";
  }

  std::vector<int> owners(static_cast<size_t>(numel), 0);
  int64_t expected_begin = 0;
  int64_t total_valid = 0;
  bool seen_short_slice = false;  // once a slice is not full, all later ones are empty
  for (int s = 0; s < num_shards; ++s) {
    const SliceRange r = p->Slice(s);
    if (r.begin != expected_begin || r.length != len) {
      return ::testing::AssertionFailure()
             << where << "shard " << s << " is [" << r.begin << ", +" << r.length
             << "), expected to start at " << expected_begin << " with length " << len;
    }
    if (r.valid < 0 || r.valid > r.length) {
      return ::testing::AssertionFailure() << where << "shard " << s << " valid=" << r.valid;
    }
    const int64_t expected_valid = std::min(std::max<int64_t>(numel - r.begin, 0), len);
    if (r.valid != expected_valid) {
      return ::testing::AssertionFailure()
             << where << "shard " << s << " valid=" << r.valid << ", expected " << expected_valid;
    }
    if (seen_short_slice && r.valid != 0) {
      return ::testing::AssertionFailure() << where << "real data after padding in shard " << s;
    }
    if (r.valid < r.length) seen_short_slice = true;
    for (int64_t e = r.begin; e < r.begin + r.valid; ++e) ++owners[static_cast<size_t>(e)];
    total_valid += r.valid;
    expected_begin += r.length;
  }
  if (expected_begin != p->padded_numel()) {
    return ::testing::AssertionFailure() << where << "slices end at " << expected_begin
                                         << ", not at padded_numel " << p->padded_numel();
  }
  if (total_valid != numel) {
    return ::testing::AssertionFailure() << where << "valid counts sum to " << total_valid;
  }
  for (int64_t e = 0; e < numel; ++e) {
    if (owners[static_cast<size_t>(e)] != 1) {
      return ::testing::AssertionFailure() << where << "element " << e << " is owned "
                                           << owners[static_cast<size_t>(e)] << " times";
    }
  }
  return ::testing::AssertionSuccess();
}

constexpr int64_t kAlignments[] = {1, 3, 64};

TEST(PartitionUnitTest, ExhaustiveSmallSizes) {
  for (int64_t alignment : kAlignments) {
    for (int64_t numel = 0; numel <= 300; ++numel) {
      for (int n = 1; n <= numel + 3; ++n) {
        ASSERT_TRUE(CheckPartition(numel, n, alignment));
      }
      for (int n : {1000, 4099}) ASSERT_TRUE(CheckPartition(numel, n, alignment));
    }
  }
}

TEST(PartitionUnitTest, VeryManyShards) {
  for (int64_t alignment : kAlignments) {
    for (int64_t numel : {0, 1, 7, 251, 1 << 16}) {
      ASSERT_TRUE(CheckPartition(numel, 1 << 20, alignment));
    }
  }
}

TEST(PartitionUnitTest, PrimeSizesAroundAlignmentMultiples) {
  for (int64_t numel : {509, 1021, 4093, 65521, 131071}) {
    for (int n : {1, 2, 3, 7, 8, 13, 64, 127}) {
      for (int64_t alignment : kAlignments) ASSERT_TRUE(CheckPartition(numel, n, alignment));
    }
  }
}

TEST(PartitionUnitTest, OneShardIsOneSlice) {
  for (int64_t numel : {0, 1, 63, 64, 65, 124439808}) {
    absl::StatusOr<UnitPartition> p = PartitionUnit(numel, 1);
    ASSERT_TRUE(p.ok()) << p.status();
    const SliceRange r = p->Slice(0);
    EXPECT_EQ(r.begin, 0);
    EXPECT_EQ(r.length, p->padded_numel());
    EXPECT_EQ(r.valid, numel);
    const int64_t rounded_up = (numel + kSliceAlignment - 1) / kSliceAlignment * kSliceAlignment;
    EXPECT_EQ(p->slice_length, std::max(kSliceAlignment, rounded_up)) << "numel=" << numel;
  }
}

TEST(PartitionUnitTest, KnownValues) {
  absl::StatusOr<UnitPartition> p = PartitionUnit(10, 4, 1);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->slice_length, 3);
  EXPECT_EQ(p->Slice(3).begin, 9);
  EXPECT_EQ(p->Slice(3).valid, 1);

  p = PartitionUnit(1000, 3);  // default alignment 64: ceil(334 / 64) * 64
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->slice_length, 384);
  EXPECT_EQ(p->Slice(2).valid, 1000 - 768);

  p = PartitionUnit(0, 5, 3);  // empty units still get one aligned block per shard
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->slice_length, 3);
  for (int s = 0; s < 5; ++s) EXPECT_EQ(p->Slice(s).valid, 0);
}

TEST(PartitionUnitTest, LargeUnitDoesNotOverflow) {
  const int64_t numel = (int64_t{1} << 40) + 17;
  absl::StatusOr<UnitPartition> p = PartitionUnit(numel, 7, kSliceAlignment);
  ASSERT_TRUE(p.ok());
  EXPECT_GE(p->padded_numel(), numel);
  EXPECT_LT(p->padded_numel() - numel, 7 * kSliceAlignment);
  EXPECT_EQ(p->Slice(6).begin, 6 * p->slice_length);
  EXPECT_EQ(p->Slice(6).valid, numel - 6 * p->slice_length);
}

TEST(PartitionUnitTest, RejectsInvalidInputs) {
  EXPECT_EQ(PartitionUnit(10, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PartitionUnit(10, -3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PartitionUnit(-1, 4).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PartitionUnit(10, 4, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PartitionUnit(10, 4, -64).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PartitionUnitsTest, EachUnitPartitionedTheSameWay) {
  const std::vector<int64_t> numels = {0, 1, 17, 64, 65, 299, 4093, 786432};
  for (int64_t alignment : kAlignments) {
    for (int n : {1, 2, 5, 64, 300}) {
      absl::StatusOr<std::vector<UnitPartition>> parts = PartitionUnits(numels, n, alignment);
      ASSERT_TRUE(parts.ok()) << parts.status();
      ASSERT_EQ(parts->size(), numels.size());
      for (size_t u = 0; u < numels.size(); ++u) {
        absl::StatusOr<UnitPartition> one = PartitionUnit(numels[u], n, alignment);
        ASSERT_TRUE(one.ok());
        EXPECT_EQ((*parts)[u].numel, numels[u]);
        EXPECT_EQ((*parts)[u].num_shards, n);
        EXPECT_EQ((*parts)[u].slice_length, one->slice_length) << "unit " << u;
        EXPECT_TRUE(CheckPartition(numels[u], n, alignment));
      }
    }
  }
}

TEST(PartitionUnitsTest, EmptyModel) {
  absl::StatusOr<std::vector<UnitPartition>> parts = PartitionUnits({}, 4);
  ASSERT_TRUE(parts.ok());
  EXPECT_TRUE(parts->empty());
}

TEST(PartitionUnitsTest, RejectsInvalidInputs) {
  const std::vector<int64_t> with_negative = {10, -1, 20};
  EXPECT_EQ(PartitionUnits(with_negative, 2).status().code(), absl::StatusCode::kInvalidArgument);
  const std::vector<int64_t> fine = {10, 20};
  EXPECT_EQ(PartitionUnits(fine, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PartitionUnits(fine, 2, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pshard
