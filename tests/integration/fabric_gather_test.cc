// The fabric all-gather of weights moves them in the encoding they came in:
// bf16 values as bf16 (half the bytes of fp32), with every member ending
// with the bits a plain fp32 all-gather gives; other encodings as fp32.
#include <cstring>
#include <thread>

#include "common/bf16.h"
#include "common/partition.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "trainer_client/group/group_collective.h"
#include "trainer_client/group/host/host_group.h"

namespace pshard {
namespace {

using ::testing::HasSubstr;

// A member that records the size of every buffer it all-gathers: the
// elements the fabric carries (4 bytes each, whatever they hold).
class Recording : public GroupCollective {
 public:
  explicit Recording(std::unique_ptr<GroupCollective> inner) : inner_(std::move(inner)) {}
  int size() const override { return inner_->size(); }
  int rank() const override { return inner_->rank(); }
  absl::Status AllGather(std::span<float> buffer, const GroupOwnership& owned) override {
    for (int m = 0; m < size(); ++m) {
      if (m != rank()) carried += 4 * RangeElements(owned[m]);
    }
    return inner_->AllGather(buffer, owned);
  }
  absl::Status ReduceScatter(std::span<float> buffer, const GroupOwnership& owned) override {
    return inner_->ReduceScatter(buffer, owned);
  }
  int64_t carried = 0;  // bytes of the other members' ranges received

 private:
  std::unique_ptr<GroupCollective> inner_;
};

// Values that are bf16's exactly (as the servers' bf16 weights decode),
// member m's ranges holding m + 1 times element-dependent values.
std::vector<float> Bf16Values(int64_t n, int member) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) {
    v[i] = Bf16ToFloat(FloatToBf16(0.001f * static_cast<float>((i * 37) % 1001 - 500) * static_cast<float>(member + 1)));
  }
  return v;
}

struct Gathered {
  std::vector<std::vector<float>> buffers;
  std::vector<int64_t> reported, carried;
  std::vector<absl::Status> status;
};

Gathered GatherInGroup(int size, const UnitPartition& p, WireEncoding encoding, bool plain,
                       bool break_member0 = false) {
  // A member that refuses leaves the others waiting: a short deadline.
  std::vector<std::unique_ptr<GroupCollective>> members =
      CreateHostGroup(size, break_member0 ? absl::Seconds(2) : absl::Seconds(30));
  const GroupOwnership owned = ShardOwnership(p, size);
  Gathered out;
  out.buffers.assign(size, std::vector<float>(p.padded_numel(), 0.0f));
  out.reported.assign(size, 0);
  out.carried.assign(size, 0);
  out.status.assign(size, absl::OkStatus());
  std::vector<std::thread> threads;
  for (int m = 0; m < size; ++m) {
    threads.emplace_back([&, m] {
      Recording member(std::move(members[m]));
      const std::vector<float> values = Bf16Values(p.padded_numel(), m);
      for (const ElementRange& r : owned[m]) {
        std::copy(values.begin() + r.begin, values.begin() + r.begin + r.length, out.buffers[m].begin() + r.begin);
      }
      if (break_member0 && m == 0 && !owned[0].empty()) out.buffers[0][owned[0][0].begin] = 0.1f;  // not a bf16
      if (plain) {
        out.status[m] = member.AllGather(out.buffers[m], owned);
      } else {
        absl::StatusOr<int64_t> got = AllGatherWeights(member, out.buffers[m], owned, encoding);
        out.status[m] = got.status();
        if (got.ok()) out.reported[m] = *got;
      }
      out.carried[m] = member.carried;
    });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

TEST(FabricGatherTest, Bf16WeightsCrossTheFabricAsBf16WithThePlainGathersBits) {
  // 3 shards over a group of 2 (member 0: shards 0 and 2; member 1: shard
  // 1), an odd slice so that one member's bf16 values end in half a slot.
  const UnitPartition p = *PartitionUnit(1001, 3);
  const Gathered plain = GatherInGroup(2, p, WireEncoding::kFp32, /*plain=*/true);
  const Gathered bf16 = GatherInGroup(2, p, WireEncoding::kBf16, /*plain=*/false);
  const GroupOwnership owned = ShardOwnership(p, 2);
  for (int m = 0; m < 2; ++m) {
    ASSERT_TRUE(plain.status[m].ok()) << plain.status[m];
    ASSERT_TRUE(bf16.status[m].ok()) << bf16.status[m];
    EXPECT_EQ(std::memcmp(bf16.buffers[m].data(), plain.buffers[m].data(), plain.buffers[m].size() * 4), 0)
        << "member " << m;
    const int64_t others = p.padded_numel() - RangeElements(owned[m]);
    EXPECT_EQ(plain.carried[m], 4 * others);
    // Half the bytes (up to the half slot an odd count rounds to).
    EXPECT_LE(bf16.carried[m], 2 * others + 2) << "member " << m;
    EXPECT_GE(bf16.carried[m], 2 * others) << "member " << m;
    EXPECT_EQ(bf16.reported[m], 2 * others);
  }
  // Decoded int8 weights are not bf16's: they cross as fp32.
  const Gathered int8 = GatherInGroup(2, p, WireEncoding::kInt8, /*plain=*/false);
  for (int m = 0; m < 2; ++m) {
    ASSERT_TRUE(int8.status[m].ok());
    EXPECT_EQ(int8.carried[m], plain.carried[m]);
    EXPECT_EQ(int8.reported[m], plain.carried[m]);
  }
}

TEST(FabricGatherTest, ValuesThatAreNotBf16AreRefusedNotRounded) {
  const UnitPartition p = *PartitionUnit(64, 2);
  const Gathered broken = GatherInGroup(2, p, WireEncoding::kBf16, /*plain=*/false, /*break_member0=*/true);
  ASSERT_FALSE(broken.status[0].ok());
  EXPECT_THAT(broken.status[0].message(), HasSubstr("is not a bf16 value"));
}

}  // namespace
}  // namespace pshard
