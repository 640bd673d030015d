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

}  // namespace
}  // namespace pshard
