// The topology file and the JSON reader under it: the input is the file's
// text. A document that ParseJson reads, FormatJson writes so that it
// reads back and writes again to the same text (one line or indented). A
// topology that parses plans a route to every server it lists for every
// trainer on one of its nodes, with UCX built (and without it, unless a
// link asks for UCX); a trainer on no node is refused. Its own JSON parses
// back to the same topology, with or without the links' shaping; a job's
// checks and the shard names' resolution answer without crashing, and a
// resolved topology names no shard.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/json.h"
#include "fuzz/harness.h"
#include "trainer_client/route_plan.h"

namespace pshard::fuzz {
namespace {

void CheckRoundTrip(const JsonValue& value, bool one_line) {
  const std::string text = FormatJson(value, one_line);
  const absl::StatusOr<JsonValue> again = ParseJson(text);
  Require(again.ok(), absl::StrCat("FormatJson wrote what ParseJson refuses (", again.status().message(), "): ", text));
  Require(FormatJson(*again, one_line) == text, absl::StrCat("a JSON document changed on its way back: ", text));
}

void CheckPlans(const Topology& topology) {
  std::vector<std::string> servers;
  bool asks_for_ucx = false;
  for (const Topology::Node& n : topology.nodes) servers.insert(servers.end(), n.servers.begin(), n.servers.end());
  for (const Topology::Link& l : topology.links) asks_for_ucx = asks_for_ucx || l.transport == "ucx";
  int planned = 0;
  for (const Topology::Node& n : topology.nodes) {
    for (int rank : n.trainers) {
      if (++planned > 16) return;
      for (bool ucx_built : {true, false}) {
        const absl::StatusOr<RoutePlan> plan = PlanRoutes(&topology, rank, servers, ucx_built);
        if (!ucx_built && asks_for_ucx && !plan.ok()) continue;
        Require(plan.ok(), absl::StrCat("no route plan for trainer ", rank, ": ", plan.status().message()));
        Require(plan->node == n.name && plan->routes.size() == servers.size(),
                absl::StrCat("trainer ", rank, "'s plan: ", plan->ToString()));
        for (const Route& r : plan->routes) {
          Require(r.transport == "grpc" || (ucx_built && r.transport == "ucx"),
                  absl::StrCat("a route over ", r.transport, ucx_built ? "" : " in a build without UCX"));
        }
      }
    }
  }
  Require(!PlanRoutes(&topology, -1, servers, true).ok(), "a plan for a trainer on no node");
}

void FuzzTopology(std::string_view text) {
  const absl::StatusOr<JsonValue> document = ParseJson(text);
  if (!document.ok()) return;
  CheckRoundTrip(*document, false);
  CheckRoundTrip(*document, true);
  const absl::StatusOr<Topology> topology = Topology::Parse(text);
  if (!topology.ok()) return;
  CheckPlans(*topology);
  for (bool shaping : {true, false}) {
    const std::string json = topology->ToJson(shaping);
    const absl::StatusOr<Topology> again = Topology::Parse(json);
    Require(again.ok(), absl::StrCat("a topology's own JSON is refused (", again.status().message(), "): ", json));
    Require(again->ToJson(shaping) == json, absl::StrCat("a topology changed on its way back: ", json));
  }
  for (int servers : {1, 3}) {
    (void)topology->CheckForJob(servers, 4);
    (void)topology->UniformGroupSize(servers);
    std::vector<std::string> addresses;
    for (int k = 0; k < servers; ++k) addresses.push_back(absl::StrCat("10.0.0.", k, ":1"));
    Topology resolved = *topology;
    if (!resolved.ResolveShards(addresses).ok()) continue;
    for (const Topology::Node& n : resolved.nodes) {
      for (const std::string& server : n.servers) {
        Require(server.rfind("shard:", 0) != 0, absl::StrCat("left unresolved: ", server));
      }
    }
  }
}

}  // namespace
}  // namespace pshard::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pshard::fuzz::FuzzTopology(std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
