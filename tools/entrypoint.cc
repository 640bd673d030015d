#include "tools/entrypoint.h"

#include <algorithm>
#include <cctype>
#include <cstdint>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/host_port.h"
#include "common/link_rate.h"

namespace pshard::entrypoint {
namespace {

constexpr int kDefaultPort = 7070;
constexpr int kDefaultMetricsPort = 9400;
constexpr int kDefaultUser = 10001;
constexpr char kDefaultConfigDir[] = "/etc/pshard";
constexpr char kDefaultCheckpointDir[] = "/var/lib/pshard/checkpoints";
constexpr int64_t kMaxServers = 4096;

std::optional<std::string> Get(const Environment& env, const std::string& name) {
  auto it = env.find(name);
  if (it == env.end()) return std::nullopt;
  return it->second;
}

// A variable that is set and not empty.
std::optional<std::string> GetSet(const Environment& env, const std::string& name) {
  std::optional<std::string> v = Get(env, name);
  if (v && absl::StripAsciiWhitespace(*v).empty()) return std::nullopt;
  if (v) return std::string(absl::StripAsciiWhitespace(*v));
  return std::nullopt;
}

absl::StatusOr<int64_t> NonNegative(const std::string& name, const std::string& value) {
  int64_t n = 0;
  if (!absl::SimpleAtoi(value, &n) || n < 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, "=\"", value, "\" is not a non-negative integer"));
  }
  return n;
}

absl::StatusOr<int> Port(const Environment& env, const std::string& name, int fallback) {
  std::optional<std::string> v = GetSet(env, name);
  if (!v) return fallback;
  absl::StatusOr<int64_t> n = NonNegative(name, *v);
  if (!n.ok()) return n.status();
  if (*n < 1 || *n > 65535) return absl::InvalidArgumentError(absl::StrCat(name, "=", *v, " is not a port (1-65535)"));
  return static_cast<int>(*n);
}

// The number at the end of a hostname like "pshard-server-3" (a
// StatefulSet pod or an Indexed Job pod); nullopt without one.
std::optional<int64_t> HostnameOrdinal(const std::string& hostname) {
  const size_t dash = hostname.rfind('-');
  if (dash == std::string::npos || dash + 1 >= hostname.size()) return std::nullopt;
  const std::string digits = hostname.substr(dash + 1);
  if (!std::all_of(digits.begin(), digits.end(), [](unsigned char c) { return std::isdigit(c); })) {
    return std::nullopt;
  }
  int64_t n = 0;
  if (!absl::SimpleAtoi(digits, &n)) return std::nullopt;
  return n;
}

// One value from several variables that must agree where set; the first
// one's name is the source. nullopt when none is set.
struct Sourced {
  int64_t value = 0;
  std::string source;
};
absl::StatusOr<std::optional<Sourced>> Agreeing(const Environment& env, const std::vector<std::string>& names) {
  std::optional<Sourced> found;
  for (const std::string& name : names) {
    std::optional<std::string> v = GetSet(env, name);
    if (!v) continue;
    absl::StatusOr<int64_t> n = NonNegative(name, *v);
    if (!n.ok()) return n.status();
    if (!found) {
      found = Sourced{*n, name};
    } else if (found->value != *n) {
      return absl::InvalidArgumentError(absl::StrCat(found->source, "=", found->value, " and ", name, "=", *n,
                                                     " disagree; set one of them, or both alike"));
    }
  }
  return found;
}

absl::Status CheckAddress(const std::string& address, const std::string& from) {
  if (absl::Status s = ParseHostPort(address).status(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(from, ": ", s.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> ServerList(const Environment& env) {
  std::optional<std::string> list = GetSet(env, "PSHARD_SERVERS");
  std::optional<std::string> pattern = GetSet(env, "PSHARD_SERVER_TEMPLATE");
  std::optional<std::string> count_text = GetSet(env, "PSHARD_NUM_SERVERS");
  std::optional<int64_t> count;
  if (count_text) {
    absl::StatusOr<int64_t> n = NonNegative("PSHARD_NUM_SERVERS", *count_text);
    if (!n.ok()) return n.status();
    // A template expands to this many addresses, which become one flag of a
    // command line: a typo must not make millions of them.
    if (*n < 1 || *n > kMaxServers) {
      return absl::InvalidArgumentError(absl::StrCat("PSHARD_NUM_SERVERS=", *n, ": must be at least 1 and at most ",
                                                     kMaxServers));
    }
    count = *n;
  }
  if (list && pattern) {
    return absl::InvalidArgumentError("PSHARD_SERVERS and PSHARD_SERVER_TEMPLATE are both set; set one");
  }
  std::vector<std::string> servers;
  if (list) {
    for (absl::string_view part : absl::StrSplit(*list, ',')) {
      const std::string address(absl::StripAsciiWhitespace(part));
      if (address.empty()) return absl::InvalidArgumentError("PSHARD_SERVERS has an empty entry");
      if (absl::Status s = CheckAddress(address, "PSHARD_SERVERS"); !s.ok()) return s;
      servers.push_back(address);
    }
    if (count && *count != static_cast<int64_t>(servers.size())) {
      return absl::InvalidArgumentError(absl::StrCat("PSHARD_NUM_SERVERS=", *count, " but PSHARD_SERVERS lists ",
                                                     servers.size(), " servers"));
    }
  } else if (pattern) {
    if (!absl::StrContains(*pattern, "{i}")) {
      return absl::InvalidArgumentError(
          absl::StrCat("PSHARD_SERVER_TEMPLATE=\"", *pattern, "\" has no {i} for the shard index"));
    }
    if (!count) return absl::InvalidArgumentError("PSHARD_SERVER_TEMPLATE needs PSHARD_NUM_SERVERS");
    for (int64_t i = 0; i < *count; ++i) {
      servers.push_back(absl::StrReplaceAll(*pattern, {{"{i}", absl::StrCat(i)}}));
      if (absl::Status s = CheckAddress(servers.back(), "PSHARD_SERVER_TEMPLATE"); !s.ok()) return s;
    }
  } else {
    return absl::InvalidArgumentError(
        "no shard servers given: set PSHARD_SERVERS=host:port,... (in shard order) or "
        "PSHARD_SERVER_TEMPLATE=name-{i}.service:7070 with PSHARD_NUM_SERVERS");
  }
  return servers;
}

absl::StatusOr<int64_t> TrainerCount(const Environment& env) {
  absl::StatusOr<std::optional<Sourced>> m = Agreeing(env, {"PSHARD_NUM_TRAINERS", "WORLD_SIZE"});
  if (!m.ok()) return m.status();
  if (!*m) return absl::InvalidArgumentError("the trainer count is not set: set PSHARD_NUM_TRAINERS (or WORLD_SIZE)");
  if ((*m)->value < 1) return absl::InvalidArgumentError(absl::StrCat((*m)->source, " must be at least 1"));
  return (*m)->value;
}

// The role's index: explicit variables first, else the hostname ordinal.
absl::StatusOr<Sourced> Index(const Facts& facts, const std::vector<std::string>& names, const std::string& what) {
  absl::StatusOr<std::optional<Sourced>> explicit_value = Agreeing(facts.env, names);
  if (!explicit_value.ok()) return explicit_value.status();
  if (*explicit_value) return **explicit_value;
  if (std::optional<int64_t> ordinal = HostnameOrdinal(facts.hostname)) {
    return Sourced{*ordinal, absl::StrCat("hostname ", facts.hostname)};
  }
  return absl::InvalidArgumentError(absl::StrCat("the ", what, " is not set: set ", absl::StrJoin(names, " or "),
                                                 ", or run with a hostname ending in -<ordinal> (hostname is \"",
                                                 facts.hostname, "\")"));
}

absl::Status AddShaping(const Facts& facts, LaunchPlan& plan) {
  std::optional<std::string> rate = GetSet(facts.env, "PSHARD_LINK_RATE");
  const std::string shaper = GetSet(facts.env, "PSHARD_LINK_SHAPER").value_or("auto");
  if (shaper != "auto" && shaper != "tc" && shaper != "process") {
    return absl::InvalidArgumentError(
        absl::StrCat("PSHARD_LINK_SHAPER=\"", shaper, "\": expected auto, tc or process"));
  }
  if (!rate) {
    if (shaper == "tc") return absl::InvalidArgumentError("PSHARD_LINK_SHAPER=tc needs PSHARD_LINK_RATE");
    return absl::OkStatus();
  }
  absl::StatusOr<int64_t> bits = ParseRate(*rate);
  if (!bits.ok()) return bits.status();
  // Without tc the trainer emulates the rate in process (on its side of
  // each link; servers have no emulation of their own).
  if (shaper == "process" || (shaper == "auto" && !facts.is_root)) return absl::OkStatus();
  if (!facts.is_root) {
    return absl::FailedPreconditionError(
        "PSHARD_LINK_SHAPER=tc: shaping with tc needs the container to start as root with NET_ADMIN "
        "(it then runs as the pshard user)");
  }
  TrafficShaping shaping;
  shaping.device = GetSet(facts.env, "PSHARD_LINK_DEVICE").value_or("eth0");
  shaping.rate_bits_per_second = *bits;
  // A bucket of at least 10 ms of traffic (and one jumbo frame), so that the
  // timer granularity does not cap the rate.
  shaping.burst_bytes = std::max<int64_t>(*bits / 8 / 100, 16 << 10);
  plan.shaping = shaping;
  plan.shaping_may_fall_back = shaper == "auto";
  plan.unset_env.push_back("PSHARD_LINK_RATE");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int64_t> ParseRate(const std::string& text) {
  absl::StatusOr<double> bytes = ParseLinkRate(text);
  if (!bytes.ok()) return absl::InvalidArgumentError(absl::StrCat("PSHARD_LINK_RATE: ", bytes.status().message()));
  const double bits = *bytes * 8;
  if (!(bits >= 1) || bits > 1e13) {
    return absl::InvalidArgumentError(
        absl::StrCat("PSHARD_LINK_RATE: '", text, "' is outside 1 bit/s to 10 Tbit/s"));
  }
  return static_cast<int64_t>(bits);
}

std::vector<std::string> TrafficShaping::TcCommand() const {
  return {"tc",   "qdisc", "replace", "dev",     device,
          "root", "tbf",   "rate",    absl::StrCat(rate_bits_per_second, "bit"),
          "burst", absl::StrCat(burst_bytes), "latency", "100ms"};
}

std::string LaunchPlan::Summary() const {
  if (role == "health") return absl::StrCat("health check of ", health_address);
  std::string line = absl::StrCat(role, " (", index_source, "): ", program, " ", absl::StrJoin(args, " "));
  if (shaping) {
    absl::StrAppend(&line, "; egress of ", shaping->device, " shaped to ", shaping->rate_bits_per_second, " bit/s");
  }
  if (uid >= 0) absl::StrAppend(&line, "; as uid ", uid);
  return line;
}

namespace {

// TLS and tokens: the mounted folder's files and the token file become the
// program's flags (the health check takes only the CA and the name).
absl::Status AddSecurity(const Facts& facts, LaunchPlan& plan) {
  const std::optional<std::string> dir = GetSet(facts.env, "PSHARD_TLS_DIR");
  const std::optional<std::string> name = GetSet(facts.env, "PSHARD_TLS_SERVER_NAME");
  const std::optional<std::string> tokens = GetSet(facts.env, "PSHARD_AUTH_TOKEN_FILE");
  auto exists = [&](const std::string& path) { return !facts.file_exists || facts.file_exists(path); };
  if (name && !dir) return absl::InvalidArgumentError("PSHARD_TLS_SERVER_NAME is set but PSHARD_TLS_DIR is not");
  if (dir) {
    for (const char* file : {"tls.crt", "tls.key", "ca.crt"}) {
      if (!exists(absl::StrCat(*dir, "/", file))) {
        return absl::InvalidArgumentError(absl::StrCat(
            "PSHARD_TLS_DIR=", *dir, " has no readable ", file,
            " (mount a Kubernetes TLS secret or a folder made by make-certs.sh there)"));
      }
    }
    if (plan.role == "health") {
      plan.health_tls_ca = absl::StrCat(*dir, "/ca.crt");
      plan.health_tls_server_name = name.value_or("localhost");
    } else {
      plan.args.push_back(absl::StrCat("--tls_cert=", *dir, "/tls.crt"));
      plan.args.push_back(absl::StrCat("--tls_key=", *dir, "/tls.key"));
      plan.args.push_back(absl::StrCat("--tls_ca=", *dir, "/ca.crt"));
      if (name) plan.args.push_back(absl::StrCat("--tls_server_name=", *name));
    }
  }
  if (tokens && plan.role != "health") {
    if (!exists(*tokens)) {
      return absl::InvalidArgumentError(absl::StrCat("PSHARD_AUTH_TOKEN_FILE=", *tokens, " cannot be read"));
    }
    plan.args.push_back(absl::StrCat("--auth_token_file=", *tokens));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LaunchPlan> Plan(const std::vector<std::string>& args, const Facts& facts) {
  LaunchPlan plan;
  std::vector<std::string> passthrough;
  std::optional<std::string> env_role = GetSet(facts.env, "PSHARD_ROLE");
  std::string role;
  if (!args.empty() && !absl::StartsWith(args[0], "-")) {
    role = args[0];
    passthrough.assign(args.begin() + 1, args.end());
    if (env_role && *env_role != role) {
      return absl::InvalidArgumentError(
          absl::StrCat("the argument says \"", role, "\" but PSHARD_ROLE=", *env_role, "; drop one"));
    }
  } else {
    passthrough = args;
    if (!env_role) {
      return absl::InvalidArgumentError(
          "no role: pass `server`, `trainer` or `health` as the first argument, or set PSHARD_ROLE");
    }
    role = *env_role;
  }
  if (role != "server" && role != "trainer" && role != "health") {
    return absl::InvalidArgumentError(absl::StrCat("unknown role \"", role, "\": expected server, trainer or health"));
  }
  plan.role = role;
  absl::StatusOr<int> port = Port(facts.env, "PSHARD_PORT", kDefaultPort);
  if (!port.ok()) return port.status();
  if (role == "health") {
    if (!passthrough.empty()) return absl::InvalidArgumentError("health takes no arguments");
    plan.health_address = absl::StrCat("127.0.0.1:", *port);
    if (absl::Status s = AddSecurity(facts, plan); !s.ok()) return s;
    return plan;
  }
  absl::StatusOr<int> metrics_port = Port(facts.env, "PSHARD_METRICS_PORT", kDefaultMetricsPort);
  if (!metrics_port.ok()) return metrics_port.status();
  absl::StatusOr<std::vector<std::string>> servers = ServerList(facts.env);
  if (!servers.ok()) return servers.status();
  absl::StatusOr<int64_t> trainers = TrainerCount(facts.env);
  if (!trainers.ok()) return trainers.status();
  const int64_t num_servers = static_cast<int64_t>(servers->size());

  const std::string config_dir = GetSet(facts.env, "PSHARD_CONFIG_DIR").value_or(kDefaultConfigDir);
  const std::string flag_file = absl::StrCat(config_dir, "/", role, ".flags");
  if (facts.file_exists && facts.file_exists(flag_file)) plan.args.push_back(absl::StrCat("--flagfile=", flag_file));

  if (role == "server") {
    plan.program = "pshard-server";
    absl::StatusOr<Sourced> index = Index(facts, {"PSHARD_SHARD_INDEX"}, "shard index");
    if (!index.ok()) return index.status();
    if (index->value >= num_servers) {
      return absl::InvalidArgumentError(absl::StrCat("shard index ", index->value, " (from ", index->source,
                                                     ") is outside the ", num_servers, " servers listed"));
    }
    plan.index_source = absl::StrCat("shard ", index->value, " of ", num_servers, " from ", index->source);
    plan.args.push_back(absl::StrCat("--shard_index=", index->value));
    plan.args.push_back(absl::StrCat("--num_shards=", num_servers));
    plan.args.push_back(absl::StrCat("--num_trainers=", *trainers));
    plan.args.push_back(absl::StrCat("--address=0.0.0.0:", *port));
    plan.args.push_back(absl::StrCat("--metrics_address=0.0.0.0:", *metrics_port));
    if (index->value > 0) plan.args.push_back(absl::StrCat("--coordinator=", (*servers)[0]));
    const std::optional<std::string> dir = Get(facts.env, "PSHARD_CHECKPOINT_DIR");
    const std::string checkpoint_dir = dir ? std::string(absl::StripAsciiWhitespace(*dir)) : kDefaultCheckpointDir;
    if (!checkpoint_dir.empty()) {
      plan.args.push_back(absl::StrCat("--checkpoint_dir=", checkpoint_dir));
      for (const auto& [name, flag] : {std::pair<std::string, std::string>{"PSHARD_CHECKPOINT_EVERY",
                                                                           "checkpoint_every"},
                                       {"PSHARD_RESUME_STEP", "resume_step"}}) {
        if (std::optional<std::string> v = GetSet(facts.env, name)) {
          absl::StatusOr<int64_t> n = NonNegative(name, *v);
          if (!n.ok()) return n.status();
          plan.args.push_back(absl::StrCat("--", flag, "=", *n));
        }
      }
    } else if (GetSet(facts.env, "PSHARD_RESUME_STEP")) {
      return absl::InvalidArgumentError("PSHARD_RESUME_STEP is set but PSHARD_CHECKPOINT_DIR is empty");
    }
  } else {
    plan.program = "pshard-trainer";
    absl::StatusOr<Sourced> rank = Index(facts, {"PSHARD_RANK", "RANK", "JOB_COMPLETION_INDEX"}, "trainer rank");
    if (!rank.ok()) return rank.status();
    if (rank->value >= *trainers) {
      return absl::InvalidArgumentError(absl::StrCat("trainer rank ", rank->value, " (from ", rank->source,
                                                     ") is outside the ", *trainers, " trainers of the job"));
    }
    plan.index_source = absl::StrCat("rank ", rank->value, " of ", *trainers, " from ", rank->source);
    plan.args.push_back(absl::StrCat("--servers=", absl::StrJoin(*servers, ",")));
    plan.args.push_back(absl::StrCat("--rank=", rank->value));
    plan.args.push_back(absl::StrCat("--metrics_address=0.0.0.0:", *metrics_port));
    if (std::optional<std::string> timeout = GetSet(facts.env, "PSHARD_JOIN_TIMEOUT")) {
      plan.args.push_back(absl::StrCat("--join_timeout=", *timeout));
    }
  }
  if (absl::Status s = AddShaping(facts, plan); !s.ok()) return s;
  if (absl::Status s = AddSecurity(facts, plan); !s.ok()) return s;
  if (facts.is_root && GetSet(facts.env, "PSHARD_RUN_AS_ROOT").value_or("") != "1") {
    plan.uid = kDefaultUser;
    plan.gid = kDefaultUser;
  }
  plan.args.insert(plan.args.end(), passthrough.begin(), passthrough.end());
  return plan;
}

}  // namespace pshard::entrypoint
