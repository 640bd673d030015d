// Fabric groups of separate members over TCP, meeting at a real shard
// server: the collectives give the shared-memory group's results bit for
// bit, and a member that never comes, dies or falls out of step is named in
// an error within the deadline.
#include "trainer_client/group/socket/socket_group.h"

#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testutil/local_cluster.h"
#include "trainer_client/group/host/host_group.h"
#include "tests/testutil/tiny_job.h"

namespace pshard::testing {
namespace {

using ::testing::HasSubstr;

class SocketGroupTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Groups of up to 4 members: the job has 4 trainers (a group is at most
    // the job's trainers).
    auto cluster = LocalCluster::Start(TinyGptJob(1, 4));
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
  }

  // Members [0, size) joined from threads, each through its own client.
  std::vector<absl::StatusOr<std::unique_ptr<GroupCollective>>> JoinAll(const std::string& group, int size,
                                                                         std::vector<int> members,
                                                                         absl::Duration timeout,
                                                                         const LinkSpec& fabric = {}) {
    std::vector<absl::StatusOr<std::unique_ptr<GroupCollective>>> out(members.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < members.size(); ++i) {
      threads.emplace_back([&, i] {
        auto client = cluster_->Connect(-1, WireEncoding::kFp32);
        if (!client.ok()) {
          out[i] = client.status();
          return;
        }
        out[i] = JoinSocketGroup(
            "127.0.0.1", members[i], size,
            [&](const std::string& payload) { return (*client)->Rendezvous(group, members[i], size, payload, timeout); },
            timeout, fabric);
      });
    }
    for (auto& t : threads) t.join();
    return out;
  }

  std::unique_ptr<LocalCluster> cluster_;
};

std::vector<std::vector<float>> RandomBuffers(int members, int64_t length, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<float>> out(members, std::vector<float>(length));
  for (auto& b : out) {
    for (float& x : b) x = normal(rng);
  }
  return out;
}

// Runs `fn(member, buffer)` on every member in its own thread.
template <typename Fn>
std::vector<absl::Status> OnEach(int members, std::vector<std::vector<float>>& buffers, Fn fn) {
  std::vector<absl::Status> status(members);
  std::vector<std::thread> threads;
  for (int m = 0; m < members; ++m) threads.emplace_back([&, m] { status[m] = fn(m, std::span<float>(buffers[m])); });
  for (auto& t : threads) t.join();
  return status;
}

bool SameBits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

TEST_F(SocketGroupTest, CollectivesEqualTheSharedMemoryGroupBitForBit) {
  for (int size : {2, 3, 4}) {
    SCOPED_TRACE(absl::StrCat("group of ", size));
    std::vector<int> members;
    for (int m = 0; m < size; ++m) members.push_back(m);
    auto joined = JoinAll(absl::StrCat("equal-", size), size, members, absl::Seconds(30));
    std::vector<std::unique_ptr<GroupCollective>> sockets;
    for (auto& j : joined) {
      ASSERT_TRUE(j.ok()) << j.status();
      sockets.push_back(std::move(*j));
    }
    std::vector<std::unique_ptr<GroupCollective>> host = CreateHostGroup(size);
    // Five shards over the members: uneven ownership, padding at the end.
    absl::StatusOr<UnitPartition> partition = PartitionUnit(10007, 5, 8);
    ASSERT_TRUE(partition.ok());
    const GroupOwnership owned = ShardOwnership(*partition, size);
    for (int round = 0; round < 3; ++round) {
      auto via_socket = RandomBuffers(size, partition->padded_numel(), 100 + round);
      auto via_host = via_socket;
      for (absl::Status s : OnEach(size, via_socket, [&](int m, std::span<float> b) {
             return sockets[m]->ReduceScatter(b, owned);
           })) {
        ASSERT_TRUE(s.ok()) << s;
      }
      for (absl::Status s : OnEach(size, via_host, [&](int m, std::span<float> b) {
             return host[m]->ReduceScatter(b, owned);
           })) {
        ASSERT_TRUE(s.ok()) << s;
      }
      for (int m = 0; m < size; ++m) {
        for (const ElementRange& r : owned[m]) {
          EXPECT_TRUE(SameBits(std::span(via_socket[m]).subspan(r.begin, r.length),
                               std::span(via_host[m]).subspan(r.begin, r.length)))
              << "reduce-scatter, member " << m << " range at " << r.begin;
        }
      }
      // All-gather what each reduced: every member ends with every range.
      for (absl::Status s : OnEach(size, via_socket, [&](int m, std::span<float> b) {
             return sockets[m]->AllGather(b, owned);
           })) {
        ASSERT_TRUE(s.ok()) << s;
      }
      for (absl::Status s : OnEach(size, via_host, [&](int m, std::span<float> b) {
             return host[m]->AllGather(b, owned);
           })) {
        ASSERT_TRUE(s.ok()) << s;
      }
      for (int m = 0; m < size; ++m) {
        EXPECT_TRUE(SameBits(via_socket[m], via_host[m])) << "all-gather, member " << m;
        EXPECT_TRUE(SameBits(via_socket[m], via_socket[0])) << "members differ after all-gather: " << m;
      }
    }
  }
}

// The all-to-all: each member gets exactly what each other member handed
// it, bits and all (a signalling-NaN pattern survives: nothing computes on
// them), over sockets and in shared memory alike.
TEST_F(SocketGroupTest, ExchangeHandsEachMemberWhatEveryOtherHandedIt) {
  constexpr int kSize = 3;
  auto joined = JoinAll("exchange", kSize, {0, 1, 2}, absl::Seconds(30));
  std::vector<std::unique_ptr<GroupCollective>> sockets;
  for (auto& j : joined) {
    ASSERT_TRUE(j.ok()) << j.status();
    sockets.push_back(std::move(*j));
  }
  std::vector<std::unique_ptr<GroupCollective>> host = CreateHostGroup(kSize);
  // From m to o: 7m + 3o + 1 elements (none from 0 to 1), each naming its pair.
  auto length = [](int from, int to) { return from == 0 && to == 1 ? 0 : 7 * from + 3 * to + 1; };
  auto part = [&](int from, int to) {
    std::vector<float> v(length(from, to));
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(1000 * from + 100 * to + static_cast<int>(i));
    if (!v.empty()) {
      const uint32_t snan = 0x7fa00000u + static_cast<uint32_t>(from * kSize + to);
      std::memcpy(&v.back(), &snan, sizeof(snan));
    }
    return v;
  };
  for (auto* group : {&sockets, &host}) {
    std::vector<absl::StatusOr<std::vector<std::vector<float>>>> got(kSize);
    std::vector<std::thread> threads;
    for (int m = 0; m < kSize; ++m) {
      threads.emplace_back([&, m] {
        std::vector<std::vector<float>> outgoing(kSize);
        std::vector<int64_t> expected(kSize, 0);
        for (int o = 0; o < kSize; ++o) {
          if (o == m) continue;
          outgoing[o] = part(m, o);
          expected[o] = length(o, m);
        }
        got[m] = (*group)[m]->Exchange(outgoing, expected);
      });
    }
    for (auto& t : threads) t.join();
    for (int m = 0; m < kSize; ++m) {
      ASSERT_TRUE(got[m].ok()) << got[m].status();
      for (int o = 0; o < kSize; ++o) {
        if (o == m) {
          EXPECT_TRUE((*got[m])[o].empty());
          continue;
        }
        EXPECT_TRUE(SameBits((*got[m])[o], part(o, m))) << "member " << m << " from " << o;
      }
    }
  }
}

// An emulated fabric delivers each member's message no sooner than its
// bytes take at the rate, plus the latency, and changes no result.
TEST_F(SocketGroupTest, AnEmulatedFabricDeliversAtItsRateAndLatency) {
  absl::StatusOr<LinkSpec> fabric = LinkSpec::Parse("100mbit", "20ms", "");
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  auto shaped = JoinAll("shaped", 2, {0, 1}, absl::Seconds(30), *fabric);
  auto plain = JoinAll("plain", 2, {0, 1}, absl::Seconds(30));
  for (auto* joined : {&shaped, &plain}) {
    for (auto& j : *joined) ASSERT_TRUE(j.ok()) << j.status();
  }
  // Two shards of 125000 elements: each member sends 500 kB, 40 ms at 100
  // Mbit/s, and each collective sends one message each way.
  absl::StatusOr<UnitPartition> partition = PartitionUnit(250000, 2, 8);
  ASSERT_TRUE(partition.ok());
  const GroupOwnership owned = ShardOwnership(*partition, 2);
  auto via_shaped = RandomBuffers(2, partition->padded_numel(), 7);
  auto via_plain = via_shaped;
  const absl::Time start = absl::Now();
  for (absl::Status s : OnEach(2, via_shaped, [&](int m, std::span<float> b) { return (*shaped[m])->AllGather(b, owned); })) {
    ASSERT_TRUE(s.ok()) << s;
  }
  const absl::Duration took = absl::Now() - start;
  const double bytes = static_cast<double>(RangeElements(owned[0])) * sizeof(float);
  EXPECT_GE(took, absl::Seconds(bytes * 8 / 100e6) + absl::Milliseconds(20)) << "sent " << bytes << " bytes";
  for (absl::Status s : OnEach(2, via_plain, [&](int m, std::span<float> b) { return (*plain[m])->AllGather(b, owned); })) {
    ASSERT_TRUE(s.ok()) << s;
  }
  for (int m = 0; m < 2; ++m) EXPECT_TRUE(SameBits(via_shaped[m], via_plain[m])) << "member " << m;
}

TEST_F(SocketGroupTest, AMemberThatNeverComesIsNamed) {
  const absl::Time start = absl::Now();
  // Long enough for the server's answer (it answers a moment before the
  // client's deadline) to arrive on a loaded machine.
  auto joined = JoinAll("lonely", 3, {0, 2}, absl::Seconds(3));
  for (auto& j : joined) {
    ASSERT_FALSE(j.ok());
    EXPECT_EQ(j.status().code(), absl::StatusCode::kDeadlineExceeded) << j.status();
    // Member 1 never came; member 0 or 2, whichever gave up first, may be
    // missing too by the time the other gives up.
    const std::string m(j.status().message());
    EXPECT_TRUE(absl::StrContains(m, "member(s) 1 did not arrive") ||
                absl::StrContains(m, "member(s) 0,1 did not arrive") ||
                absl::StrContains(m, "member(s) 1,2 did not arrive"))
        << j.status();
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
}

TEST_F(SocketGroupTest, AMemberThatDiesIsNamed) {
  auto joined = JoinAll("dies", 2, {0, 1}, absl::Seconds(5));
  ASSERT_TRUE(joined[0].ok() && joined[1].ok());
  joined[1]->reset();  // member 1's process is gone: its connections close
  std::vector<float> buffer(64, 1.0f);
  const GroupOwnership owned = {{{0, 32}}, {{32, 32}}};
  absl::Status s = (*joined[0])->AllGather(buffer, owned);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("member 1 (127.0.0.1:"));
}

TEST_F(SocketGroupTest, MembersOutOfStepAreDetected) {
  auto joined = JoinAll("step", 2, {0, 1}, absl::Seconds(5));
  ASSERT_TRUE(joined[0].ok() && joined[1].ok());
  const GroupOwnership owned = {{{0, 32}}, {{32, 32}}};
  std::vector<std::vector<float>> buffers(2, std::vector<float>(64, 1.0f));
  std::vector<absl::Status> status = OnEach(2, buffers, [&](int m, std::span<float> b) {
    return m == 0 ? (*joined[0])->AllGather(b, owned) : (*joined[1])->ReduceScatter(b, owned);
  });
  // Both fail; whoever reads the other's header first says why, and the
  // other may see only its peer hanging up.
  EXPECT_FALSE(status[0].ok());
  EXPECT_FALSE(status[1].ok());
  const bool explained = absl::StrContains(status[0].message(), "out of step") ||
                         absl::StrContains(status[1].message(), "out of step");
  EXPECT_TRUE(explained) << status[0] << " / " << status[1];
}

TEST_F(SocketGroupTest, BadOwnershipIsRefusedBeforeAnythingIsSent) {
  auto joined = JoinAll("bad", 2, {0, 1}, absl::Seconds(5));
  ASSERT_TRUE(joined[0].ok() && joined[1].ok());
  std::vector<float> buffer(16, 0.0f);
  EXPECT_THAT((*joined[0])->AllGather(buffer, {{{0, 8}}}).message(), HasSubstr("the group has 2"));
  EXPECT_THAT((*joined[0])->ReduceScatter(buffer, {{{0, 8}}, {{8, 9}}}).message(),
              HasSubstr("outside a buffer of 16"));
  // Still usable afterwards.
  std::vector<std::vector<float>> buffers = {std::vector<float>(16, 1.0f), std::vector<float>(16, 2.0f)};
  const GroupOwnership owned = {{{0, 8}}, {{8, 8}}};
  for (absl::Status s : OnEach(2, buffers, [&](int m, std::span<float> b) { return (*joined[m])->AllGather(b, owned); })) {
    EXPECT_TRUE(s.ok()) << s;
  }
  EXPECT_EQ(buffers[0][12], 2.0f);
  EXPECT_EQ(buffers[1][3], 1.0f);
}

}  // namespace
}  // namespace pshard::testing
