#include "trainer_client/route_plan.h"

#include "gtest/gtest.h"

namespace pshard {
namespace {

constexpr char kTopology[] = R"({
  "nodes": [
    {"name": "a", "servers": ["10.0.0.1:7000"], "trainers": [0, 1]},
    {"name": "b", "servers": ["10.0.0.2:7000"], "trainers": [2, 3]},
    {"name": "c", "servers": ["10.0.0.3:7000"]}
  ],
  "fabric_groups": [[0, 1]],
  "links": [
    {"between": ["a", "b"], "kind": "rdma"},
    {"between": ["c", "a"], "kind": "ethernet", "transport": "grpc"}
  ]
})";

const std::vector<std::string> kServers = {"10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000"};

TEST(RoutePlanTest, FollowsTheTopology) {
  auto topology = Topology::Parse(kTopology);
  ASSERT_TRUE(topology.ok()) << topology.status();
  auto plan = PlanRoutes(&*topology, 1, kServers, /*ucx_built=*/true);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->node, "a");
  EXPECT_EQ(plan->fabric_group, (std::vector<int>{0, 1}));
  ASSERT_EQ(plan->routes.size(), 3u);
  EXPECT_EQ(plan->routes[0].transport, "ucx");  // same node: shared memory
  EXPECT_NE(plan->routes[0].reason.find("same node"), std::string::npos);
  EXPECT_EQ(plan->routes[1].transport, "ucx");  // rdma link
  EXPECT_NE(plan->routes[1].reason.find("rdma"), std::string::npos);
  EXPECT_EQ(plan->routes[2].transport, "grpc");  // the topology says so
  EXPECT_EQ(plan->TransportByAddress().at("10.0.0.3:7000"), "grpc");
  EXPECT_NE(plan->ToString().find("fabric group [0,1]"), std::string::npos) << plan->ToString();
}

TEST(RoutePlanTest, WithoutUcxEverythingIsGrpc) {
  auto topology = Topology::Parse(kTopology);
  ASSERT_TRUE(topology.ok());
  auto plan = PlanRoutes(&*topology, 2, kServers, /*ucx_built=*/false);
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (const Route& r : plan->routes) EXPECT_EQ(r.transport, "grpc") << r.address;
  EXPECT_TRUE(plan->fabric_group.empty());
}

TEST(RoutePlanTest, DefaultsWithoutATopology) {
  auto plan = PlanRoutes(nullptr, 0, kServers, true);
  ASSERT_TRUE(plan.ok());
  for (const Route& r : plan->routes) EXPECT_EQ(r.transport, "ucx");
  plan = PlanRoutes(nullptr, 0, kServers, false);
  ASSERT_TRUE(plan.ok());
  for (const Route& r : plan->routes) EXPECT_EQ(r.transport, "grpc");
}

TEST(RoutePlanTest, ALinkMayGiveItsOwnRateAndDelay) {
  auto t = Topology::Parse(R"({"nodes": [{"name": "a"}, {"name": "b"}],
      "links": [{"between": ["a", "b"], "kind": "ethernet", "rate": "10gbit", "delay": "1ms"}]})");
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->links.size(), 1u);
  EXPECT_EQ(t->links[0].rate, "10gbit");
  EXPECT_EQ(t->links[0].delay, "1ms");
}

TEST(RoutePlanTest, BadTopologiesAreRefusedWithAReason) {
  struct Case {
    const char* json;
    const char* says;
  };
  for (const Case& c : {
           Case{R"({"nodes": []})", "non-empty"},
           Case{R"({"nodes": [{"name": "a"}, {"name": "a"}]})", "appears twice"},
           Case{R"({"nodes": [{"name": "a", "trainers": [0]}, {"name": "b", "trainers": [0]}]})", "two nodes"},
           Case{R"({"nodes": [{"name": "a", "servers": ["x:1"]}, {"name": "b", "servers": ["x:1"]}]})", "two nodes"},
           Case{R"({"nodes": [{"name": "a", "trainers": [0]}], "fabric_groups": [[0, 5]]})", "on no node"},
           Case{R"({"nodes": [{"name": "a"}], "links": [{"between": ["a", "z"], "kind": "rdma"}]})", "unknown node"},
           Case{R"({"nodes": [{"name": "a"}], "links": [{"between": ["a", "a"], "kind": "pigeon"}]})", "link kind"},
           Case{R"({"nodes": [{"name": "a"}], "links": [{"between": ["a", "a"], "kind": "rdma", "transport": "tcp"}]})",
                "link transport"},
           Case{R"({"nodes": [{"name": "a", "trainers": [-1]}]})", "not a trainer rank"},
           Case{R"({"nodes": [{"name": "a"}], "links": [{"between": ["a", "a"], "kind": "ethernet", "rate": "fast"}]})",
                "link rate 'fast' is not a number"},
           Case{R"({"nodes": [{"name": "a"}], "links": [{"between": ["a", "a"], "kind": "ethernet", "delay": "soon"}]})",
                "delay \"soon\" is not a duration"},
           Case{"{", "JSON line"},
       }) {
    auto t = Topology::Parse(c.json);
    ASSERT_FALSE(t.ok()) << c.json;
    EXPECT_NE(t.status().message().find(c.says), std::string::npos) << t.status();
  }
  auto topology = Topology::Parse(kTopology);
  ASSERT_TRUE(topology.ok());
  EXPECT_FALSE(PlanRoutes(&*topology, 9, kServers, true).ok());                     // rank on no node
  EXPECT_FALSE(PlanRoutes(&*topology, 0, {"10.9.9.9:1"}, true).ok());              // server on no node
  EXPECT_FALSE(Topology::Load("/nonexistent/topology.json").ok());
}

// Found by fuzz/topology_fuzzer (fuzz/corpus/topology/crash_rank_beyond_int):
// a rank too large for an int was converted to one (undefined) before it
// was compared.
TEST(RoutePlanTest, RanksBeyondAnIntAreRefused) {
  for (const char* json : {R"({"nodes":[{"name":"","trainers":[1e99]}]})",
                           R"({"nodes":[{"name":"a","trainers":[2147483648]}]})",
                           R"({"nodes":[{"name":"a"}],"fabric_groups":[[1e999]]})"}) {
    auto t = Topology::Parse(json);
    ASSERT_FALSE(t.ok()) << json;
    EXPECT_NE(t.status().message().find("not a trainer rank"), std::string::npos) << t.status();
  }
  EXPECT_TRUE(Topology::Parse(R"({"nodes":[{"name":"a","trainers":[2147483647]}]})").ok());
}

// A topology that names its servers by shard works for any addresses: the
// trainer resolves them against its --servers; a job started here (pshard
// local, plan) checks it places exactly its own shards and trainers.
constexpr char kPortable[] = R"({
  "nodes": [
    {"name": "a", "servers": ["shard:0", "shard:2"], "trainers": [0, 1]},
    {"name": "b", "servers": ["shard:1"], "trainers": [2, 3]}
  ],
  "fabric_groups": [[0, 1], [2, 3]],
  "links": [{"between": ["a", "b"], "kind": "ethernet", "rate": "1gbit", "delay": "20ms"}]
})";

TEST(RoutePlanTest, ServersNamedByShardAreResolvedAgainstTheAddresses) {
  auto topology = Topology::Parse(kPortable);
  ASSERT_TRUE(topology.ok()) << topology.status();
  EXPECT_TRUE(topology->CheckForJob(3, 4).ok()) << topology->CheckForJob(3, 4);
  EXPECT_EQ(topology->NodeOfServer("shard:2"), 0);
  EXPECT_EQ(topology->NodeOfServer("shard:1"), 1);
  EXPECT_EQ(topology->NodeOfTrainer(3), 1);
  EXPECT_EQ(topology->NodeOfTrainer(4), -1);
  EXPECT_EQ(topology->UniformGroupSize(4).value_or(-1), 2);
  ASSERT_TRUE(topology->ResolveShards(kServers).ok());
  EXPECT_EQ(topology->nodes[0].servers, (std::vector<std::string>{"10.0.0.1:7000", "10.0.0.3:7000"}));
  EXPECT_EQ(topology->nodes[1].servers, (std::vector<std::string>{"10.0.0.2:7000"}));
  auto plan = PlanRoutes(&*topology, 2, kServers, /*ucx_built=*/false);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->node, "b");
  EXPECT_EQ(plan->fabric_group, (std::vector<int>{2, 3}));
  // Resolved, it is no longer a file for a job without addresses.
  EXPECT_FALSE(topology->CheckForJob(3, 4).ok());
}

TEST(RoutePlanTest, AShardOrRankTheJobLacksIsNamed) {
  auto topology = Topology::Parse(kPortable);
  ASSERT_TRUE(topology.ok());
  auto message = [](const absl::Status& s) { return std::string(s.message()); };
  EXPECT_NE(message(topology->CheckForJob(2, 4)).find("\"shard:2\" is not shard:0 to shard:1"), std::string::npos)
      << topology->CheckForJob(2, 4);
  EXPECT_NE(message(topology->CheckForJob(4, 4)).find("shard:3 is on no node"), std::string::npos);
  EXPECT_NE(message(topology->CheckForJob(3, 3)).find("trainer 3 is not one of the job's 3"), std::string::npos);
  EXPECT_NE(message(topology->CheckForJob(3, 5)).find("trainer 4 is on no node"), std::string::npos);
  Topology copy = *topology;
  const absl::Status unresolved = copy.ResolveShards({"10.0.0.1:7000", "10.0.0.2:7000"});
  EXPECT_NE(message(unresolved).find("\"shard:2\" names no shard of the 2 servers"), std::string::npos)
      << unresolved;
  // A literal address beside the shard that has it: on two nodes.
  auto twice = Topology::Parse(R"({"nodes": [{"name": "a", "servers": ["shard:0"]},
                                             {"name": "b", "servers": ["10.0.0.1:7000"]}]})");
  ASSERT_TRUE(twice.ok());
  EXPECT_NE(message(twice->ResolveShards(kServers)).find("is on two nodes"), std::string::npos);
}

TEST(RoutePlanTest, FabricGroupsMustBeConsecutiveRunsOfOneSizeForAJob) {
  auto groups_of = [](const std::string& groups) {
    return Topology::Parse(R"({"nodes": [{"name": "a", "trainers": [0, 1, 2, 3]}], "fabric_groups": )" + groups +
                           "}")
        .value()
        .UniformGroupSize(4);
  };
  EXPECT_EQ(groups_of("[]").value_or(-1), 1);
  EXPECT_EQ(groups_of("[[0, 1, 2, 3]]").value_or(-1), 4);
  EXPECT_FALSE(groups_of("[[0, 2], [1, 3]]").ok());  // not consecutive
  EXPECT_FALSE(groups_of("[[0, 1], [2]]").ok());     // sizes differ, rank 3 left out
  EXPECT_FALSE(groups_of("[[0, 1, 2], [3]]").ok());
  EXPECT_FALSE(groups_of("[[0, 1]]").ok());          // ranks 2 and 3 in none
}

TEST(RoutePlanTest, ItsJsonParsesBackToTheSameTopologyWithOrWithoutShaping) {
  auto topology = Topology::Parse(kPortable);
  ASSERT_TRUE(topology.ok());
  auto again = Topology::Parse(topology->ToJson());
  ASSERT_TRUE(again.ok()) << again.status() << topology->ToJson();
  EXPECT_EQ(again->ToJson(), topology->ToJson());
  ASSERT_EQ(again->links.size(), 1u);
  EXPECT_EQ(again->links[0].rate, "1gbit");
  EXPECT_EQ(again->links[0].delay, "20ms");
  EXPECT_EQ(again->fabric_groups, topology->fabric_groups);
  EXPECT_EQ(again->nodes[1].servers, (std::vector<std::string>{"shard:1"}));
  auto unshaped = Topology::Parse(topology->ToJson(/*shaping=*/false));
  ASSERT_TRUE(unshaped.ok());
  ASSERT_EQ(unshaped->links.size(), 1u);
  EXPECT_EQ(unshaped->links[0].rate, "");
  EXPECT_EQ(unshaped->links[0].delay, "");
  EXPECT_EQ(unshaped->links[0].kind, "ethernet");
}

}  // namespace
}  // namespace pshard
