// The fabric collectives move the encodings in use: the all-gather of
// weights carries bf16 and int8 weights encoded (bf16 half the bytes of
// fp32, int8 about a quarter), with every member ending with the bits a
// plain fp32 all-gather gives; the reduce-scatter of gradients carries
// each member's part of the others' slices in the gradients' encoding
// (int8 and int4 with error feedback), summed by the owner.
#include <cmath>
#include <cstring>
#include <limits>
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

// A member that records the bytes it receives from the other members
// (4 per element, whatever the elements hold).
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
    carried += 4 * (size() - 1) * RangeElements(owned[rank()]);
    return inner_->ReduceScatter(buffer, owned);
  }
  absl::StatusOr<std::vector<std::vector<float>>> Exchange(const std::vector<std::vector<float>>& outgoing,
                                                           const std::vector<int64_t>& expected) override {
    for (int m = 0; m < size(); ++m) {
      if (m != rank()) carried += 4 * expected[m];
    }
    return inner_->Exchange(outgoing, expected);
  }
  int64_t carried = 0;

 private:
  std::unique_ptr<GroupCollective> inner_;
};

// E(n) of docs/levers.md: the bytes of a slice of n elements.
int64_t SliceBytes(WireEncoding e, int64_t block, int64_t n) {
  switch (e) {
    case WireEncoding::kFp32: return 4 * n;
    case WireEncoding::kBf16: return 2 * n;
    case WireEncoding::kInt8: return n + 4 * ((n + block - 1) / block);
    case WireEncoding::kInt4: return (n / block) * (block / 2) + ((n % block) + 1) / 2 + 4 * ((n + block - 1) / block);
  }
  return -1;
}

int64_t RangesBytes(WireEncoding e, int64_t block, const std::vector<ElementRange>& ranges) {
  int64_t bytes = 0;
  for (const ElementRange& r : ranges) bytes += SliceBytes(e, block, r.length);
  return bytes;
}

constexpr int kBlock = 48;

// Values as the servers' weights in `encoding` decode (member m's ranges
// differing by member): bf16 values; for int8, each block of a range (from
// its first element) codes q times a block scale, one code of magnitude 127.
std::vector<float> DecodedWeights(const GroupOwnership& owned, int64_t n, int member, WireEncoding encoding) {
  std::vector<float> v(n, 0.0f);
  for (const ElementRange& r : owned[member]) {
    for (int64_t i = 0; i < r.length; ++i) {
      const int64_t at = r.begin + i;
      if (encoding == WireEncoding::kBf16) {
        v[at] = Bf16ToFloat(
            FloatToBf16(0.001f * static_cast<float>((at * 37) % 1001 - 500) * static_cast<float>(member + 1)));
      } else {
        const int64_t block = i / kBlock;
        const float scale = 0.0007f * (1.0f + 0.37f * static_cast<float>(block % 7)) * static_cast<float>(member + 1);
        const int code = i % kBlock == 0 ? (block % 2 == 0 ? 127 : -127) : static_cast<int>((at * 53) % 255) - 127;
        v[at] = static_cast<float>(code) * scale;
      }
    }
  }
  return v;
}

struct Result {
  std::vector<std::vector<float>> buffers;
  std::vector<int64_t> reported, carried;
  std::vector<absl::Status> status;
};

// Runs `call(member, buffer)` on every member of a host group, each in its
// thread, from `inputs[m]`.
template <typename Call>
Result InGroup(int size, std::vector<std::vector<float>> inputs, absl::Duration timeout, Call call) {
  std::vector<std::unique_ptr<GroupCollective>> members = CreateHostGroup(size, timeout);
  Result out;
  out.buffers = std::move(inputs);
  out.reported.assign(size, 0);
  out.carried.assign(size, 0);
  out.status.assign(size, absl::OkStatus());
  std::vector<std::thread> threads;
  for (int m = 0; m < size; ++m) {
    threads.emplace_back([&, m] {
      Recording member(std::move(members[m]));
      absl::StatusOr<int64_t> got = call(member, m, out.buffers[m]);
      out.status[m] = got.status();
      if (got.ok()) out.reported[m] = *got;
      out.carried[m] = member.carried;
    });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

Result GatherInGroup(int size, const UnitPartition& p, WireEncoding encoding, bool plain, bool break_member0 = false) {
  const GroupOwnership owned = ShardOwnership(p, size);
  std::vector<std::vector<float>> inputs;
  for (int m = 0; m < size; ++m) inputs.push_back(DecodedWeights(owned, p.padded_numel(), m, encoding));
  if (break_member0) inputs[0][owned[0][0].begin + 1] = 0.1f;  // neither bf16 nor on the block's grid
  // A member that refuses leaves the others waiting: a short deadline.
  return InGroup(size, std::move(inputs), break_member0 ? absl::Seconds(2) : absl::Seconds(30),
                 [&](GroupCollective& member, int, std::vector<float>& buffer) -> absl::StatusOr<int64_t> {
                   if (plain) {
                     if (absl::Status s = member.AllGather(buffer, owned); !s.ok()) return s;
                     return 0;
                   }
                   return AllGatherWeights(member, buffer, owned, WireFormat(encoding, kBlock));
                 });
}

class FabricGatherTest : public ::testing::TestWithParam<WireEncoding> {};

TEST_P(FabricGatherTest, WeightsCrossTheFabricEncodedWithThePlainGathersBits) {
  const WireEncoding encoding = GetParam();
  // 5 shards over groups of 2 and 3 (several ranges a member), odd slices
  // so that a member's bytes end inside a float slot and blocks are short.
  const UnitPartition p = *PartitionUnit(1001, 5);
  for (int size : {2, 3}) {
    SCOPED_TRACE(absl::StrCat("group of ", size));
    const Result plain = GatherInGroup(size, p, encoding, /*plain=*/true);
    const Result encoded = GatherInGroup(size, p, encoding, /*plain=*/false);
    const GroupOwnership owned = ShardOwnership(p, size);
    for (int m = 0; m < size; ++m) {
      ASSERT_TRUE(plain.status[m].ok()) << plain.status[m];
      ASSERT_TRUE(encoded.status[m].ok()) << encoded.status[m];
      EXPECT_EQ(std::memcmp(encoded.buffers[m].data(), plain.buffers[m].data(), plain.buffers[m].size() * 4), 0)
          << "member " << m;
      int64_t want = 0, fp32 = 0;
      for (int o = 0; o < size; ++o) {
        if (o == m) continue;
        want += RangesBytes(encoding, kBlock, owned[o]);
        fp32 += 4 * RangeElements(owned[o]);
      }
      EXPECT_EQ(encoded.reported[m], want) << "member " << m;
      // What crossed: the encoded bytes, each member's padded to a float.
      EXPECT_GE(encoded.carried[m], want) << "member " << m;
      EXPECT_LE(encoded.carried[m], want + 3 * (size - 1)) << "member " << m;
      EXPECT_LT(encoded.carried[m], (encoding == WireEncoding::kBf16 ? 0.51 : 0.33) * fp32) << "member " << m;
    }
  }
}

TEST_P(FabricGatherTest, ValuesThatAreNotADecodeAreRefusedNotRounded) {
  const UnitPartition p = *PartitionUnit(192, 2);
  const Result broken = GatherInGroup(2, p, GetParam(), /*plain=*/false, /*break_member0=*/true);
  ASSERT_FALSE(broken.status[0].ok());
  EXPECT_THAT(broken.status[0].message(), HasSubstr("is not a decode of"));
}

INSTANTIATE_TEST_SUITE_P(Encodings, FabricGatherTest, ::testing::Values(WireEncoding::kBf16, WireEncoding::kInt8),
                         [](const auto& info) { return std::string(WireEncodingName(info.param)); });

// The oracle's symmetric block quantization, from block_quant.h's words:
// scale max|x| / Q, codes round(x * Q / max|x|) half to even, decoded q * s;
// a block starts at the first element of a range.
std::vector<float> OracleRoundTrip(std::span<const float> x, int q_max) {
  std::vector<float> out(x.size(), 0.0f);
  for (size_t at = 0; at < x.size(); at += kBlock) {
    const size_t n = std::min<size_t>(kBlock, x.size() - at);
    float amax = 0.0f;
    for (size_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[at + i]));
    if (amax == 0.0f) continue;
    const float scale = amax / static_cast<float>(q_max);
    const float inverse = static_cast<float>(q_max) / amax;
    for (size_t i = 0; i < n; ++i) {
      const float code = std::nearbyint(x[at + i] * inverse);
      out[at + i] = std::clamp(code, -static_cast<float>(q_max), static_cast<float>(q_max)) * scale;
    }
  }
  return out;
}

// Member m's gradient of a unit, different in every round.
std::vector<float> Gradient(int64_t n, int member, int round) {
  std::vector<float> g(n);
  for (int64_t i = 0; i < n; ++i) {
    g[i] = 0.01f * std::sin(0.37f * static_cast<float>(i) + static_cast<float>(member * 5 + round * 11)) *
           (1.0f + static_cast<float>(i % 9));
  }
  return g;
}

class FabricReduceTest : public ::testing::TestWithParam<WireEncoding> {};

TEST_P(FabricReduceTest, GradientsCrossTheFabricEncodedWithErrorFeedback) {
  const WireEncoding encoding = GetParam();
  const WireFormat format(encoding, kBlock);
  const UnitPartition p = *PartitionUnit(1001, 5);
  const int size = 3;
  const GroupOwnership owned = ShardOwnership(p, size);
  const int64_t n = p.padded_numel();
  const bool quantized = encoding != WireEncoding::kBf16;
  const int q_max = encoding == WireEncoding::kInt8 ? 127 : 7;
  std::vector<std::vector<float>> residual(size, std::vector<float>(n, 0.0f));    // the members'
  std::vector<std::vector<float>> oracle_residual(size, std::vector<float>(n, 0.0f));
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    // The oracle: what each member hands over (its own ranges as they are,
    // the others' through the encoding, the residual added and renewed),
    // then summed by the plain fp32 reduce-scatter.
    std::vector<std::vector<float>> handed, inputs;
    for (int m = 0; m < size; ++m) {
      std::vector<float> g = Gradient(n, m, round);
      inputs.push_back(g);
      for (int o = 0; o < size; ++o) {
        if (o == m) continue;
        for (const ElementRange& r : owned[o]) {
          std::vector<float> v(g.begin() + r.begin, g.begin() + r.begin + r.length);
          if (quantized) {
            for (int64_t i = 0; i < r.length; ++i) v[i] = v[i] + oracle_residual[m][r.begin + i];
          }
          std::vector<float> d(v.size());
          if (quantized) {
            d = OracleRoundTrip(v, q_max);
            for (int64_t i = 0; i < r.length; ++i) oracle_residual[m][r.begin + i] = v[i] - d[i];
          } else {
            for (size_t i = 0; i < v.size(); ++i) d[i] = Bf16ToFloat(FloatToBf16(v[i]));
          }
          std::copy(d.begin(), d.end(), g.begin() + r.begin);
        }
      }
      handed.push_back(std::move(g));
    }
    const Result want = InGroup(size, handed, absl::Seconds(30),
                                [&](GroupCollective& member, int, std::vector<float>& b) -> absl::StatusOr<int64_t> {
                                  if (absl::Status s = member.ReduceScatter(b, owned); !s.ok()) return s;
                                  return 0;
                                });
    const Result got = InGroup(size, inputs, absl::Seconds(30),
                               [&](GroupCollective& member, int m, std::vector<float>& b) {
                                 return ReduceScatterGradients(member, b, owned, format,
                                                               quantized ? std::span<float>(residual[m]) : std::span<float>());
                               });
    for (int m = 0; m < size; ++m) {
      ASSERT_TRUE(want.status[m].ok()) << want.status[m];
      ASSERT_TRUE(got.status[m].ok()) << got.status[m];
      for (const ElementRange& r : owned[m]) {
        EXPECT_EQ(std::memcmp(got.buffers[m].data() + r.begin, want.buffers[m].data() + r.begin, r.length * 4), 0)
            << "member " << m << ", range at " << r.begin;
      }
      const int64_t bytes = (size - 1) * RangesBytes(encoding, kBlock, owned[m]);
      EXPECT_EQ(got.reported[m], bytes) << "member " << m;
      EXPECT_GE(got.carried[m], bytes);
      EXPECT_LE(got.carried[m], bytes + 3 * (size - 1));
      for (const ElementRange& r : owned[(m + 1) % size]) {  // a range it quantized for another: its residual
        for (int64_t i = r.begin; i < r.begin + r.length; ++i) {
          ASSERT_EQ(residual[m][i], oracle_residual[m][i]) << "member " << m << ", element " << i;
        }
      }
    }
  }
}

TEST_P(FabricReduceTest, AContributionThatIsNotFiniteMakesItsRangesSumNaN) {
  const WireFormat format(GetParam(), kBlock);
  const UnitPartition p = *PartitionUnit(300, 3);
  const GroupOwnership owned = ShardOwnership(p, 2);  // member 0: shards 0 and 2; member 1: shard 1
  std::vector<std::vector<float>> inputs = {Gradient(p.padded_numel(), 0, 0), Gradient(p.padded_numel(), 1, 0)};
  inputs[1][owned[0][0].begin + 3] = std::numeric_limits<float>::infinity();  // member 1's part of shard 0
  std::vector<float> residual(p.padded_numel(), 0.0f);
  const Result got = InGroup(2, inputs, absl::Seconds(30), [&](GroupCollective& member, int m, std::vector<float>& b) {
    return ReduceScatterGradients(member, b, owned, format, m == 1 ? std::span<float>(residual) : std::span<float>());
  });
  ASSERT_TRUE(got.status[0].ok()) << got.status[0];
  const ElementRange bad = owned[0][0], good = owned[0][1];
  EXPECT_FALSE(std::isfinite(got.buffers[0][bad.begin + 3]));
  for (int64_t i = good.begin; i < good.begin + good.length; ++i) ASSERT_TRUE(std::isfinite(got.buffers[0][i])) << i;
  // The slice that was not finite leaves no residual behind.
  for (int64_t i = bad.begin; i < bad.begin + bad.length; ++i) ASSERT_EQ(residual[i], 0.0f) << i;
}

INSTANTIATE_TEST_SUITE_P(Encodings, FabricReduceTest,
                         ::testing::Values(WireEncoding::kBf16, WireEncoding::kInt8, WireEncoding::kInt4),
                         [](const auto& info) { return std::string(WireEncodingName(info.param)); });

TEST(FabricReduceTest, Fp32IsThePlainReduceScatter) {
  const UnitPartition p = *PartitionUnit(500, 3);
  const GroupOwnership owned = ShardOwnership(p, 2);
  std::vector<std::vector<float>> inputs = {Gradient(p.padded_numel(), 0, 1), Gradient(p.padded_numel(), 1, 1)};
  const Result plain = InGroup(2, inputs, absl::Seconds(30), [&](GroupCollective& member, int, std::vector<float>& b)
                                                                 -> absl::StatusOr<int64_t> {
    if (absl::Status s = member.ReduceScatter(b, owned); !s.ok()) return s;
    return 0;
  });
  const Result got = InGroup(2, inputs, absl::Seconds(30), [&](GroupCollective& member, int, std::vector<float>& b) {
    return ReduceScatterGradients(member, b, owned, WireFormat(WireEncoding::kFp32), {});
  });
  for (int m = 0; m < 2; ++m) {
    ASSERT_TRUE(got.status[m].ok());
    for (const ElementRange& r : owned[m]) {
      EXPECT_EQ(std::memcmp(got.buffers[m].data() + r.begin, plain.buffers[m].data() + r.begin, r.length * 4), 0);
    }
    EXPECT_EQ(got.reported[m], 4 * RangeElements(owned[m]));
  }
}

}  // namespace
}  // namespace pshard
