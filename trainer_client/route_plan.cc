#include "trainer_client/route_plan.h"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/json.h"
#include "common/link_rate.h"
#include "common/status_macros.h"

namespace pshard {
namespace {

absl::Status Invalid(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("topology: ", what));
}

absl::StatusOr<std::string> StringField(const JsonValue& object, const std::string& key, bool required) {
  const JsonValue* v = object.Find(key);
  if (v == nullptr) {
    if (required) return Invalid(absl::StrCat("missing \"", key, "\""));
    return std::string();
  }
  if (!v->is_string()) return Invalid(absl::StrCat("\"", key, "\" must be a string"));
  return v->as_string();
}

absl::StatusOr<std::vector<int>> Ranks(const JsonValue& v, const std::string& what) {
  if (!v.is_array()) return Invalid(absl::StrCat(what, " must be an array of trainer ranks"));
  std::vector<int> out;
  for (const JsonValue& r : v.as_array()) {
    // In range before the cast: converting 1e99 to int is undefined.
    if (!r.is_number() || !(r.as_number() >= 0 && r.as_number() <= std::numeric_limits<int>::max()) ||
        r.as_number() != static_cast<int>(r.as_number())) {
      return Invalid(absl::StrCat(what, " holds something that is not a trainer rank"));
    }
    out.push_back(static_cast<int>(r.as_number()));
  }
  return out;
}

bool Known(const std::string& value, std::initializer_list<const char*> allowed) {
  return std::any_of(allowed.begin(), allowed.end(), [&](const char* a) { return value == a; });
}

}  // namespace

absl::StatusOr<Topology> Topology::Parse(std::string_view json) {
  ASSIGN_OR_RETURN(JsonValue doc, ParseJson(json));
  if (!doc.is_object()) return Invalid("the document must be an object");
  Topology t;
  const JsonValue* nodes = doc.Find("nodes");
  if (nodes == nullptr || !nodes->is_array() || nodes->as_array().empty()) {
    return Invalid("\"nodes\" must be a non-empty array");
  }
  std::set<std::string> names, servers;
  std::set<int> trainers;
  for (const JsonValue& n : nodes->as_array()) {
    if (!n.is_object()) return Invalid("every node must be an object");
    Node node;
    ASSIGN_OR_RETURN(node.name, StringField(n, "name", true));
    if (!names.insert(node.name).second) return Invalid(absl::StrCat("node \"", node.name, "\" appears twice"));
    if (const JsonValue* s = n.Find("servers")) {
      if (!s->is_array()) return Invalid(absl::StrCat("node ", node.name, ": \"servers\" must be an array"));
      for (const JsonValue& a : s->as_array()) {
        if (!a.is_string()) return Invalid(absl::StrCat("node ", node.name, ": a server is not a string"));
        if (!servers.insert(a.as_string()).second) {
          return Invalid(absl::StrCat("server ", a.as_string(), " is on two nodes"));
        }
        node.servers.push_back(a.as_string());
      }
    }
    if (const JsonValue* r = n.Find("trainers")) {
      ASSIGN_OR_RETURN(node.trainers, Ranks(*r, absl::StrCat("node ", node.name, ": \"trainers\"")));
      for (int rank : node.trainers) {
        if (!trainers.insert(rank).second) return Invalid(absl::StrCat("trainer ", rank, " is on two nodes"));
      }
    }
    t.nodes.push_back(std::move(node));
  }
  if (const JsonValue* groups = doc.Find("fabric_groups")) {
    if (!groups->is_array()) return Invalid("\"fabric_groups\" must be an array of rank arrays");
    std::set<int> grouped;
    for (const JsonValue& g : groups->as_array()) {
      ASSIGN_OR_RETURN(std::vector<int> group, Ranks(g, "a fabric group"));
      for (int rank : group) {
        if (!trainers.count(rank)) return Invalid(absl::StrCat("fabric group member ", rank, " is on no node"));
        if (!grouped.insert(rank).second) return Invalid(absl::StrCat("trainer ", rank, " is in two fabric groups"));
      }
      t.fabric_groups.push_back(std::move(group));
    }
  }
  if (const JsonValue* links = doc.Find("links")) {
    if (!links->is_array()) return Invalid("\"links\" must be an array");
    for (const JsonValue& l : links->as_array()) {
      const JsonValue* between = l.is_object() ? l.Find("between") : nullptr;
      if (between == nullptr || !between->is_array() || between->as_array().size() != 2 ||
          !between->as_array()[0].is_string() || !between->as_array()[1].is_string()) {
        return Invalid("every link needs \"between\": [node, node]");
      }
      Link link;
      link.a = between->as_array()[0].as_string();
      link.b = between->as_array()[1].as_string();
      for (const std::string& end : {link.a, link.b}) {
        if (!names.count(end)) return Invalid(absl::StrCat("link to unknown node \"", end, "\""));
      }
      ASSIGN_OR_RETURN(link.kind, StringField(l, "kind", true));
      if (!Known(link.kind, {"ethernet", "rdma", "infiniband", "nvlink"})) {
        return Invalid(absl::StrCat("link kind \"", link.kind, "\" (expected ethernet, rdma, infiniband or nvlink)"));
      }
      ASSIGN_OR_RETURN(link.transport, StringField(l, "transport", false));
      if (!link.transport.empty() && !Known(link.transport, {"auto", "grpc", "ucx"})) {
        return Invalid(absl::StrCat("link transport \"", link.transport, "\" (expected auto, grpc or ucx)"));
      }
      ASSIGN_OR_RETURN(link.rate, StringField(l, "rate", false));
      if (absl::StatusOr<double> r = ParseLinkRate(link.rate); !r.ok()) {
        return Invalid(absl::StrCat("link ", link.a, "-", link.b, ": ", r.status().message()));
      }
      ASSIGN_OR_RETURN(link.delay, StringField(l, "delay", false));
      if (absl::Duration d; !link.delay.empty() && (!absl::ParseDuration(link.delay, &d) || d < absl::ZeroDuration())) {
        return Invalid(absl::StrCat("link ", link.a, "-", link.b, ": delay \"", link.delay,
                                    "\" is not a duration such as 5ms"));
      }
      t.links.push_back(std::move(link));
    }
  }
  return t;
}

absl::StatusOr<Topology> Topology::Load(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read topology file ", path));
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<Topology> t = Parse(text.str());
  if (!t.ok()) return absl::Status(t.status().code(), absl::StrCat(path, ": ", t.status().message()));
  return t;
}

namespace {

constexpr std::string_view kShardPrefix = "shard:";

// K of "shard:K", or -1 when `server` is not such a name.
int ShardIndex(const std::string& server) {
  if (server.rfind(kShardPrefix, 0) != 0) return -1;
  const std::string digits = server.substr(kShardPrefix.size());
  if (digits.empty() || digits.size() > 6 || !std::all_of(digits.begin(), digits.end(), [](unsigned char c) { return std::isdigit(c) != 0; })) return -1;
  return std::stoi(digits);
}

}  // namespace

std::string Topology::ToJson(bool shaping) const {
  auto ranks = [](const std::vector<int>& list) {
    JsonValue::Array a;
    for (int r : list) a.push_back(JsonValue::Number(r));
    return JsonValue::MakeArray(std::move(a));
  };
  JsonValue::Array node_list, group_list, link_list;
  for (const Node& n : nodes) {
    JsonValue::Array servers;
    for (const std::string& s : n.servers) servers.push_back(JsonValue::String(s));
    node_list.push_back(JsonValue::MakeObject({{"name", JsonValue::String(n.name)},
                                               {"servers", JsonValue::MakeArray(std::move(servers))},
                                               {"trainers", ranks(n.trainers)}}));
  }
  for (const std::vector<int>& g : fabric_groups) group_list.push_back(ranks(g));
  for (const Link& l : links) {
    JsonValue::Object link = {{"between", JsonValue::MakeArray({JsonValue::String(l.a), JsonValue::String(l.b)})},
                              {"kind", JsonValue::String(l.kind)}};
    if (!l.transport.empty()) link.emplace("transport", JsonValue::String(l.transport));
    if (shaping && !l.rate.empty()) link.emplace("rate", JsonValue::String(l.rate));
    if (shaping && !l.delay.empty()) link.emplace("delay", JsonValue::String(l.delay));
    link_list.push_back(JsonValue::MakeObject(std::move(link)));
  }
  return FormatJson(JsonValue::MakeObject({{"nodes", JsonValue::MakeArray(std::move(node_list))},
                                           {"fabric_groups", JsonValue::MakeArray(std::move(group_list))},
                                           {"links", JsonValue::MakeArray(std::move(link_list))}}));
}

absl::Status Topology::ResolveShards(const std::vector<std::string>& server_addresses) {
  std::set<std::string> seen;
  for (Node& node : nodes) {
    for (std::string& server : node.servers) {
      if (server.rfind(kShardPrefix, 0) == 0) {
        const int k = ShardIndex(server);
        if (k < 0 || k >= static_cast<int>(server_addresses.size())) {
          return Invalid(absl::StrCat("node ", node.name, ": \"", server, "\" names no shard of the ",
                                      server_addresses.size(), " servers (shard:0 to shard:",
                                      server_addresses.size() - 1, ")"));
        }
        server = server_addresses[k];
      }
      if (!seen.insert(server).second) return Invalid(absl::StrCat("server ", server, " is on two nodes"));
    }
  }
  return absl::OkStatus();
}

absl::Status Topology::CheckForJob(int servers, int trainers) const {
  std::set<int> shards, ranks;
  for (const Node& node : nodes) {
    for (const std::string& server : node.servers) {
      const int k = ShardIndex(server);
      if (k < 0 || k >= servers) {
        return Invalid(absl::StrCat("node ", node.name, ": server \"", server, "\" is not shard:0 to shard:",
                                    servers - 1, " (a job started here has no fixed addresses)"));
      }
      shards.insert(k);
    }
    for (int rank : node.trainers) {
      if (rank >= trainers) {
        return Invalid(absl::StrCat("node ", node.name, ": trainer ", rank, " is not one of the job's ", trainers));
      }
      ranks.insert(rank);
    }
  }
  for (int k = 0; k < servers; ++k) {
    if (!shards.count(k)) return Invalid(absl::StrCat("shard:", k, " is on no node"));
  }
  for (int r = 0; r < trainers; ++r) {
    if (!ranks.count(r)) return Invalid(absl::StrCat("trainer ", r, " is on no node"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> Topology::UniformGroupSize(int trainers) const {
  if (fabric_groups.empty()) return 1;
  const int g = static_cast<int>(fabric_groups[0].size());
  const bool uniform = g >= 1 && trainers % g == 0 && static_cast<int>(fabric_groups.size()) == trainers / g;
  for (size_t i = 0; uniform && i < fabric_groups.size(); ++i) {
    for (int m = 0; m < g; ++m) {
      if (static_cast<int>(fabric_groups[i].size()) != g || fabric_groups[i][m] != static_cast<int>(i) * g + m) {
        return Invalid(absl::StrCat("fabric group ", i, " is not ranks ", i * g, " to ", i * g + g - 1,
                                    ": groups must be consecutive runs of one size covering every trainer"));
      }
    }
  }
  if (!uniform) {
    return Invalid(absl::StrCat(fabric_groups.size(), " fabric groups of ", g, " do not cover the ", trainers,
                                " trainers in consecutive runs of one size"));
  }
  return g;
}

int Topology::NodeOfServer(const std::string& server) const {
  for (size_t n = 0; n < nodes.size(); ++n) {
    if (std::count(nodes[n].servers.begin(), nodes[n].servers.end(), server)) return static_cast<int>(n);
  }
  return -1;
}

int Topology::NodeOfTrainer(int rank) const {
  for (size_t n = 0; n < nodes.size(); ++n) {
    if (std::count(nodes[n].trainers.begin(), nodes[n].trainers.end(), rank)) return static_cast<int>(n);
  }
  return -1;
}

std::map<std::string, std::string> RoutePlan::TransportByAddress() const {
  std::map<std::string, std::string> out;
  for (const Route& r : routes) out[r.address] = r.transport;
  return out;
}

std::string RoutePlan::ToString() const {
  std::string out = absl::StrCat("route plan of trainer ", rank, node.empty() ? "" : absl::StrCat(" on node ", node),
                                 fabric_group.empty() ? "" : absl::StrCat(", fabric group [",
                                                                          absl::StrJoin(fabric_group, ","), "]"),
                                 ":\n");
  for (const Route& r : routes) absl::StrAppend(&out, "  ", r.address, "  ", r.transport, "  (", r.reason, ")\n");
  return out;
}

absl::StatusOr<RoutePlan> PlanRoutes(const Topology* topology, int rank,
                                     const std::vector<std::string>& server_addresses, bool ucx_built) {
  RoutePlan plan;
  plan.rank = rank;
  const std::string fallback = ucx_built ? "ucx" : "grpc";
  if (topology == nullptr) {
    for (const std::string& a : server_addresses) {
      plan.routes.push_back({a, fallback,
                             ucx_built ? "no topology: UCX where the server offers it (shared memory on this host, "
                                         "tcp or RDMA elsewhere), else gRPC"
                                       : "no topology; this build has no UCX"});
    }
    return plan;
  }
  auto node_of_trainer = [&](int r) -> const Topology::Node* {
    for (const auto& n : topology->nodes) {
      if (std::count(n.trainers.begin(), n.trainers.end(), r)) return &n;
    }
    return nullptr;
  };
  const Topology::Node* mine = node_of_trainer(rank);
  if (mine == nullptr) return Invalid(absl::StrCat("trainer ", rank, " is on no node"));
  plan.node = mine->name;
  for (const auto& g : topology->fabric_groups) {
    if (std::count(g.begin(), g.end(), rank)) plan.fabric_group = g;
  }
  for (const std::string& address : server_addresses) {
    const Topology::Node* theirs = nullptr;
    for (const auto& n : topology->nodes) {
      if (std::count(n.servers.begin(), n.servers.end(), address)) theirs = &n;
    }
    if (theirs == nullptr) return Invalid(absl::StrCat("server ", address, " is on no node"));
    if (theirs == mine) {
      plan.routes.push_back({address, fallback, ucx_built ? "same node: UCX shared memory" : "same node; no UCX in this build"});
      continue;
    }
    const Topology::Link* link = nullptr;
    for (const auto& l : topology->links) {
      if ((l.a == mine->name && l.b == theirs->name) || (l.b == mine->name && l.a == theirs->name)) link = &l;
    }
    const std::string kind = link ? link->kind : "ethernet";
    if (link && (link->transport == "grpc" || link->transport == "ucx")) {
      if (link->transport == "ucx" && !ucx_built) {
        return Invalid(absl::StrCat("the link ", mine->name, "-", theirs->name, " asks for ucx; this build has no UCX"));
      }
      plan.routes.push_back({address, link->transport, absl::StrCat(kind, " link to node ", theirs->name, ", as the topology says")});
      continue;
    }
    plan.routes.push_back({address, fallback,
                           absl::StrCat(kind, " link to node ", theirs->name, link ? "" : " (no link declared)",
                                        ucx_built ? ": UCX (tcp, or RDMA where present)" : ": gRPC (no UCX in this build)")});
  }
  return plan;
}

}  // namespace pshard
