#include "tools/local_cluster.h"

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include "absl/algorithm/container.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/signals.h"
#include "common/status_macros.h"
#include "shard_server/checkpoint.h"
#include "tools/kernel_links.h"
#include "tools/process.h"

namespace pshard {
namespace {

std::atomic<int> g_signal{0};

// Copies what a child appends to its log onto this process's stdout, as
// `tail -f` would.
class LogFollower {
 public:
  explicit LogFollower(std::string path) : path_(std::move(path)) {}
  void Pump() {
    std::ifstream in(path_, std::ios::binary);
    if (!in) return;
    in.seekg(offset_);
    char buffer[1 << 14];
    while (in.read(buffer, sizeof(buffer)) || in.gcount() > 0) {
      std::fwrite(buffer, 1, static_cast<size_t>(in.gcount()), stdout);
      offset_ += in.gcount();
    }
    std::fflush(stdout);
  }

 private:
  const std::string path_;
  std::streamoff offset_ = 0;
};

std::string Tail(const std::string& path, size_t max_bytes = 2000) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  return s.size() > max_bytes ? s.substr(s.size() - max_bytes) : s;
}

// Stops every child still running: SIGTERM, then SIGKILL after a grace period.
void StopAll(std::vector<ChildProcess>& children, absl::Duration grace) {
  for (auto& c : children) c.Signal(SIGTERM);
  const absl::Time deadline = absl::Now() + grace;
  for (auto& c : children) {
    if (!c.WaitUntil(deadline)) {
      std::fprintf(stderr, "pshard: %s (pid %d) ignored SIGTERM; killing it\n", c.name().c_str(), c.pid());
      c.Signal(SIGKILL);
      c.WaitUntil(absl::Now() + absl::Seconds(5));
    }
  }
}

std::string MetricsAddress(int base, int offset) {
  return absl::StrCat("127.0.0.1:", base == 0 ? 0 : base + offset);
}

// A server's port file (docs: the port file's lines): its gRPC port, its
// metrics port, and the step it serves from (its restored checkpoint's, 0
// when it started fresh).
struct PortFile {
  int grpc_port = 0;
  int metrics_port = 0;
  int64_t start_step = 0;
};
PortFile ReadPortFile(const std::string& path) {
  std::ifstream in(path);
  PortFile file;
  in >> file.grpc_port >> file.metrics_port >> file.start_step;
  return file;
}

// Logs of an earlier run in the same folder are kept, once, as NAME.previous
// (a process's log is appended to while this run restarts it, so without
// this a reused --run_dir would mix two runs in one file).
void KeepPreviousLogs(const std::string& run_dir, int num_servers, int num_trainers) {
  std::vector<std::string> names;
  for (int s = 0; s < num_servers; ++s) names.push_back(absl::StrCat(run_dir, "/server", s, ".log"));
  for (int r = 0; r < num_trainers; ++r) names.push_back(absl::StrCat(run_dir, "/trainer", r, ".log"));
  int kept = 0;
  for (const std::string& name : names) {
    std::error_code error;
    if (!std::filesystem::exists(name, error)) continue;
    std::filesystem::rename(name, name + ".previous", error);
    if (!error) ++kept;
  }
  if (kept > 0) {
    std::printf("pshard: %s holds an earlier run's logs: kept as *.log.previous\n", run_dir.c_str());
    std::fflush(stdout);
  }
}

std::string Quoted(const std::vector<std::string>& targets) {
  std::vector<std::string> q;
  for (const std::string& t : targets) q.push_back(absl::StrCat("'", t, "'"));
  return absl::StrJoin(q, ", ");
}


// The credentials of a local job: what each kind of process is given.
struct LocalSecurity {
  std::vector<std::string> server_flags, trainer_flags, reader_flags;
  std::string what;  // for the start line
};

absl::StatusOr<std::string> RandomHex(size_t bytes) {
  std::ifstream random("/dev/urandom", std::ios::binary);
  std::string raw(bytes, '\0');
  if (!random.read(raw.data(), static_cast<std::streamsize>(bytes))) {
    return absl::InternalError("cannot read /dev/urandom for the job's tokens");
  }
  std::string hex;
  for (unsigned char c : raw) absl::StrAppend(&hex, absl::Hex(c, absl::kZeroPad2));
  return hex;
}

absl::StatusOr<LocalSecurity> MakeLocalSecurity(const LocalClusterSpec& spec) {
  LocalSecurity out;
  std::vector<std::string> what;
  if (spec.tls) {
    const std::string dir = spec.run_dir + "/tls";
    const std::string log = spec.run_dir + "/make-certs.log";
    ASSIGN_OR_RETURN(ChildProcess make, ChildProcess::Spawn({spec.bin_dir + "/pshard-make-certs.sh", dir}, log));
    const std::optional<int> code = make.WaitUntil(absl::Now() + absl::Seconds(60));
    if (code != 0) {
      return absl::InternalError(absl::StrCat("making the job's certificates failed (", log, "):\n", Tail(log)));
    }
    // Servers are dialled by address (loopback, or a kernel link's host
    // side); their certificate names localhost.
    auto role = [&dir](const std::string& name) {
      return std::vector<std::string>{absl::StrCat("--tls_cert=", dir, "/", name, "/tls.crt"),
                                      absl::StrCat("--tls_key=", dir, "/", name, "/tls.key"),
                                      absl::StrCat("--tls_ca=", dir, "/", name, "/ca.crt"), "--tls_server_name=localhost"};
    };
    out.server_flags = role("server");
    out.trainer_flags = role("trainer");
    out.reader_flags = role("reader");
    what.push_back(absl::StrCat("mutual TLS (certificates in ", dir, ")"));
  }
  if (spec.tokens) {
    const std::string path = spec.run_dir + "/tokens";
    std::string text = "# pshard local: one token per role\n";
    for (const char* role : {"server", "trainer", "reader"}) {
      ASSIGN_OR_RETURN(std::string token, RandomHex(16));
      absl::StrAppend(&text, role, " ", token, "\n");
    }
    std::filesystem::remove(path);
    {
      std::ofstream file(path);
      file << text;
      if (!file) return absl::InternalError(absl::StrCat("cannot write ", path));
    }
    std::filesystem::permissions(path, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
    const std::string flag = absl::StrCat("--auth_token_file=", path);
    for (auto* flags : {&out.server_flags, &out.trainer_flags, &out.reader_flags}) flags->push_back(flag);
    what.push_back(absl::StrCat("tokens (", path, ")"));
  }
  out.what = absl::StrJoin(what, " and ");
  return out;
}

}  // namespace

std::string LocalTopology(const std::vector<std::string>& server_addresses, int num_trainers, int group_size,
                          bool paired) {
  std::vector<std::string> nodes, groups;
  const int servers = static_cast<int>(server_addresses.size());
  for (int i = 0; i < std::max(servers, num_trainers); ++i) {
    const bool server = i < servers, trainer = i < num_trainers;
    if (paired) {
      nodes.push_back(absl::StrCat("{\"name\": \"node-", i, "\"",
                                   server ? absl::StrCat(", \"servers\": [\"", server_addresses[i], "\"]") : "",
                                   trainer ? absl::StrCat(", \"trainers\": [", i, "]") : "", "}"));
      continue;
    }
    if (server) {
      nodes.push_back(absl::StrCat("{\"name\": \"server-", i, "\", \"servers\": [\"", server_addresses[i], "\"]}"));
    }
    if (trainer) nodes.push_back(absl::StrCat("{\"name\": \"trainer-", i, "\", \"trainers\": [", i, "]}"));
  }
  for (int first = 0; first < num_trainers && group_size > 1; first += group_size) {
    std::vector<std::string> members;
    for (int r = first; r < first + group_size; ++r) members.push_back(absl::StrCat(r));
    groups.push_back(absl::StrCat("[", absl::StrJoin(members, ", "), "]"));
  }
  return absl::StrCat("{\"nodes\": [\n  ", absl::StrJoin(nodes, ",\n  "), "],\n \"fabric_groups\": [",
                      absl::StrJoin(groups, ", "), "]}\n");
}

std::string LocalPrometheusConfig(const std::vector<std::string>& server_targets,
                                  const std::vector<std::string>& trainer_targets) {
  return absl::StrCat(
      "# Scrapes a local pshard cluster (written by `pshard local`).\n"
      "global:\n"
      "  scrape_interval: 1s\n"
      "  evaluation_interval: 1s\n"
      "scrape_configs:\n"
      "  - job_name: pshard-server\n"
      "    static_configs:\n"
      "      - targets: [", Quoted(server_targets), "]\n"
      "  - job_name: pshard-trainer\n"
      "    static_configs:\n"
      "      - targets: [", Quoted(trainer_targets), "]\n");
}

absl::Status RunLocalCluster(const LocalClusterSpec& spec) {
  if (spec.num_servers < 1 || spec.num_trainers < 1) {
    return absl::InvalidArgumentError(absl::StrCat("need at least one server and one trainer, got ",
                                                   spec.num_servers, " and ", spec.num_trainers));
  }
  if (spec.paired && (spec.fabric_group_size > 1 || spec.link_mode == "kernel")) {
    return absl::InvalidArgumentError("paired placement takes neither fabric groups nor the kernel link mode");
  }
  if (spec.fabric_group_size < 1 || spec.num_trainers % spec.fabric_group_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("fabric groups of ", spec.fabric_group_size,
                                                   " do not divide ", spec.num_trainers, " trainers"));
  }
  std::error_code error;
  std::filesystem::create_directories(spec.run_dir, error);
  if (error) {
    return absl::InvalidArgumentError(absl::StrCat("cannot create run folder ", spec.run_dir, ": ", error.message()));
  }
  KeepPreviousLogs(spec.run_dir, spec.num_servers, spec.num_trainers);
  CallOnTerminationSignal([](int signo) { g_signal = signo; });
  std::unique_ptr<KernelLinks> kernel;  // outlives every process below
  if (spec.link_mode == "kernel") {
    ASSIGN_OR_RETURN(kernel, KernelLinks::Create(spec.num_trainers, spec.kernel_rate, spec.run_dir + "/kernel_links.log"));
    std::printf("pshard: kernel links: %s\n", kernel->ToString().c_str());
  } else if (!spec.link_mode.empty() && spec.link_mode != "emulated") {
    return absl::InvalidArgumentError(absl::StrCat("link mode \"", spec.link_mode, "\" is not emulated or kernel"));
  }
  std::vector<std::string> server_security, trainer_security;
  if (spec.tls || spec.tokens) {
    ASSIGN_OR_RETURN(LocalSecurity security, MakeLocalSecurity(spec));
    server_security = std::move(security.server_flags);
    trainer_security = std::move(security.trainer_flags);
    std::printf("pshard: %s; pshard status needs %s\n", security.what.c_str(),
                absl::StrJoin(security.reader_flags, " ").c_str());
  }
  const std::string server_bin = spec.bin_dir + "/pshard-server";
  const std::string trainer_bin = spec.bin_dir + "/pshard-trainer";
  std::vector<ChildProcess> servers, trainers;
  std::vector<std::string> addresses;
  std::vector<std::string> server_metrics, trainer_metrics;
  auto fail = [&](absl::Status s) {
    StopAll(trainers, absl::Seconds(5));
    StopAll(servers, absl::Seconds(5));
    return s;
  };

  // Starts shard s's server on `port` (0: any free one) and metrics port
  // `metrics_port` (0: as the spec says) and waits until it serves.
  auto start_server = [&](int s, int port, int metrics_port) -> absl::StatusOr<int> {
    const std::string port_file = absl::StrCat(spec.run_dir, "/server", s, ".port");
    std::remove(port_file.c_str());
    std::vector<std::string> argv = {server_bin,
                                     absl::StrCat("--shard_index=", s),
                                     absl::StrCat("--num_shards=", spec.num_servers),
                                     absl::StrCat("--num_trainers=", spec.num_trainers),
                                     absl::StrCat(kernel ? "--address=0.0.0.0:" : "--address=127.0.0.1:", port),
                                     metrics_port == 0
                                         ? absl::StrCat("--metrics_address=", MetricsAddress(spec.metrics_port_base, s))
                                         : absl::StrCat("--metrics_address=127.0.0.1:", metrics_port),
                                     absl::StrCat("--port_file=", port_file)};
    if (s > 0) argv.push_back(absl::StrCat("--coordinator=", addresses[0]));
    for (const std::string& flag : spec.server_flags) {
      // A restarted server resumes from its newest checkpoint, whatever
      // the job started from.
      if (port != 0 && (absl::StartsWith(flag, "--resume_step") || absl::StartsWith(flag, "--start_fresh"))) continue;
      argv.push_back(flag);
    }
    argv.insert(argv.end(), server_security.begin(), server_security.end());
    const std::string log = absl::StrCat(spec.run_dir, "/server", s, ".log");
    ASSIGN_OR_RETURN(ChildProcess child, ChildProcess::Spawn(argv, log));
    if (static_cast<int>(servers.size()) <= s) {
      servers.push_back(std::move(child));
    } else {
      servers[s] = std::move(child);
    }
    absl::StatusOr<int> bound = WaitForPortFile(port_file, servers[s], absl::Seconds(30));
    if (!bound.ok()) {
      return absl::Status(bound.status().code(),
                          absl::StrCat(bound.status().message(), "\n--- ", log, " ---\n", Tail(log)));
    }
    return *bound;
  };
  std::vector<int> server_ports, server_metrics_ports;
  for (int s = 0; s < spec.num_servers; ++s) {
    absl::StatusOr<int> port = start_server(s, 0, 0);
    if (!port.ok()) return fail(port.status());
    const std::string port_file = absl::StrCat(spec.run_dir, "/server", s, ".port");
    server_ports.push_back(*port);
    server_metrics_ports.push_back(ReadPortFile(port_file).metrics_port);
    addresses.push_back(absl::StrCat("127.0.0.1:", *port));
    server_metrics.push_back(absl::StrCat("127.0.0.1:", server_metrics_ports.back()));
  }
  std::printf("pshard: %d shard servers up (%s); starting %d trainers; logs in %s\n", spec.num_servers,
              absl::StrJoin(addresses, ", ").c_str(), spec.num_trainers, spec.run_dir.c_str());
  const int64_t resumed = ReadPortFile(absl::StrCat(spec.run_dir, "/server0.port")).start_step;
  for (const std::string& flag : spec.server_flags) {
    if (resumed == 0 && absl::StartsWith(flag, "--init_from=")) {
      std::printf("pshard: initial weights from %s\n", flag.substr(flag.find('=') + 1).c_str());
    }
  }
  if (resumed > 0) {
    std::printf("pshard: resumed from the checkpoints of step %lld; training to step %lld\n",
                static_cast<long long>(resumed), static_cast<long long>(spec.steps));
    if (resumed >= spec.steps) {
      std::printf(
          "pshard: the job is already at step %lld: nothing to train. To train longer, pass a larger --steps and "
          "either --schedule_steps=%lld (the steps after %lld run at the schedule's final rate, --min_lr) or "
          "--allow_schedule_change (the cosine is stretched to the new end)\n",
          static_cast<long long>(resumed), static_cast<long long>(spec.schedule_steps),
          static_cast<long long>(spec.schedule_steps));
    }
  }
  std::fflush(stdout);
  auto write_prometheus_config = [&] {
    std::ofstream(spec.run_dir + "/prometheus.yml") << LocalPrometheusConfig(server_metrics, trainer_metrics);
  };

  std::string topology_flag;
  if (!spec.topology_file.empty()) {
    topology_flag = absl::StrCat("--topology=", spec.topology_file);
  } else if (spec.fabric_group_size > 1 || spec.paired) {
    const std::string path = spec.run_dir + "/topology.json";
    std::ofstream(path) << LocalTopology(addresses, spec.num_trainers, spec.fabric_group_size, spec.paired);
    topology_flag = absl::StrCat("--topology=", path);
  }
  std::string link_dir_flag;
  if (spec.emulated_links) {
    const std::string dir = spec.run_dir + "/links";
    std::filesystem::remove_all(dir, error);  // buckets of an earlier run in this folder
    std::filesystem::create_directories(dir, error);
    if (error) return fail(absl::InternalError(absl::StrCat("cannot create ", dir, ": ", error.message())));
    link_dir_flag = absl::StrCat("--link_dir=", dir);
  }
  std::vector<std::string> logs;
  std::vector<std::vector<std::string>> trainer_argv;
  std::vector<int> restarts(spec.num_trainers, 0);
  std::vector<int> server_restarts(spec.num_servers, 0);
  // Every trainer writes to its log in the run folder; trainer 0's is also
  // followed onto this process's output.
  LogFollower trainer0(absl::StrCat(spec.run_dir, "/trainer0.log"));
  for (int r = 0; r < spec.num_trainers; ++r) {
    const std::string metrics = MetricsAddress(spec.metrics_port_base, 100 + r);
    std::vector<std::string> argv = {trainer_bin, absl::StrCat("--servers=", absl::StrJoin(addresses, ",")),
                                     absl::StrCat("--rank=", r), absl::StrCat("--metrics_address=", metrics)};
    if (kernel) {
      // Over its shaped link to the host, where the servers listen.
      std::vector<std::string> over_link;
      for (const std::string& a : addresses) over_link.push_back(kernel->HostAddressFor(r) + a.substr(a.rfind(':')));
      argv = kernel->ExecIn(r);
      for (std::string a : {trainer_bin, absl::StrCat("--servers=", absl::StrJoin(over_link, ",")),
                            absl::StrCat("--rank=", r), absl::StrCat("--metrics_address=", metrics),
                            std::string("--transport=grpc")}) {
        argv.push_back(std::move(a));
      }
    }
    if (spec.metrics_port_base != 0) trainer_metrics.push_back(metrics);
    argv.insert(argv.end(), spec.trainer_flags.begin(), spec.trainer_flags.end());
    if (r < spec.fabric_group_size) argv.insert(argv.end(), spec.evaluator_flags.begin(), spec.evaluator_flags.end());
    argv.insert(argv.end(), trainer_security.begin(), trainer_security.end());
    if (!topology_flag.empty()) argv.push_back(topology_flag);
    if (!link_dir_flag.empty()) argv.push_back(link_dir_flag);
    const std::string step_log = absl::StrCat(spec.run_dir, "/trainer", r, ".steps.jsonl");
    std::remove(step_log.c_str());  // an earlier run's in this folder
    argv.push_back(absl::StrCat("--step_log=", step_log));
    if (r != 0) argv.push_back("--log_every=0");
    logs.push_back(absl::StrCat(spec.run_dir, "/trainer", r, ".log"));
    trainer_argv.push_back(argv);
    absl::StatusOr<ChildProcess> child = ChildProcess::Spawn(argv, logs.back());
    if (!child.ok()) return fail(child.status());
    trainers.push_back(std::move(*child));
  }
  if (spec.metrics_port_base != 0) {
    write_prometheus_config();
    std::printf("pshard: metrics on ports %d.. (servers) and %d.. (trainers); Prometheus config: %s/prometheus.yml\n",
                spec.metrics_port_base, spec.metrics_port_base + 100, spec.run_dir.c_str());
    std::fflush(stdout);
  }

  // Watch: all trainers done is success; any failure or a signal stops all.
  while (true) {
    trainer0.Pump();
    if (g_signal != 0) {
      std::printf("\npshard: interrupted; stopping trainers and servers\n");
      std::fflush(stdout);
      fail(absl::OkStatus()).IgnoreError();
      return absl::CancelledError("interrupted");
    }
    // Servers first: a trainer fails soon after a server it needs dies, and
    // the server is the cause to report.
    for (int s = 0; s < spec.num_servers; ++s) {
      std::optional<int> code = servers[s].Poll();
      if (!code) continue;
      const std::string log = absl::StrCat(spec.run_dir, "/server", s, ".log");
      // A server that died comes back on its port and restores its newest
      // checkpoint; the trainers notice, rejoin, and roll the others back
      // to that step. One that exited with an error decided to.
      if (*code > 128 && server_restarts[s] < spec.server_restarts) {
        ++server_restarts[s];
        std::printf("pshard: shard server %d died (signal %d); restarting it on port %d (%d of %d restarts): it "
                    "restores its newest checkpoint and the trainers roll the job back to it\n",
                    s, *code - 128, server_ports[s], server_restarts[s], spec.server_restarts);
        std::fflush(stdout);
        absl::StatusOr<int> port = start_server(s, server_ports[s], server_metrics_ports[s]);
        if (!port.ok()) return fail(port.status());
        continue;
      }
      return fail(absl::InternalError(
          absl::StrCat("shard server ", s, " exited early with code ", *code, "\n", Tail(log))));
    }
    bool all_done = true;
    for (int r = 0; r < spec.num_trainers; ++r) {
      std::optional<int> code = trainers[r].Poll();
      if (!code) {
        all_done = false;
        continue;
      }
      // A trainer that died (a signal: killed, out of memory, a crash) is
      // started again: it rejoins at the servers' step and recomputes it
      // (its data is a function of seed, step and rank). A trainer that
      // exited with an error decided to: that ends the job.
      if (*code > 128 && restarts[r] < spec.trainer_restarts) {
        ++restarts[r];
        std::printf("pshard: trainer %d died (signal %d); restarting it (%d of %d restarts): it rejoins and "
                    "redoes its step\n",
                    r, *code - 128, restarts[r], spec.trainer_restarts);
        std::fflush(stdout);
        absl::StatusOr<ChildProcess> child = ChildProcess::Spawn(trainer_argv[r], logs[r]);
        if (!child.ok()) return fail(child.status());
        trainers[r] = std::move(*child);
        all_done = false;
        continue;
      }
      if (*code != 0) {
        trainer0.Pump();
        return fail(absl::InternalError(absl::StrCat("trainer ", r, " exited with code ", *code, " (see ", logs[r],
                                                     ")", r == 0 ? "" : "\n", r == 0 ? "" : Tail(logs[r]))));
      }
    }
    if (all_done) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  trainer0.Pump();
  StopAll(servers, absl::Seconds(10));
  for (int s = 0; s < spec.num_servers; ++s) {
    if (servers[s].Poll().value_or(-1) != 0) {
      return absl::InternalError(absl::StrCat("shard server ", s, " did not shut down cleanly (code ",
                                              servers[s].Poll().value_or(-1), ")"));
    }
  }
  if (!spec.checkpoint_dir.empty()) {
    // What a user asked to keep is on disk, or the job failed.
    const int64_t last = std::max(spec.steps, resumed);
    std::vector<int> missing;
    for (int s = 0; s < spec.num_servers; ++s) {
      if (!absl::c_linear_search(ListCheckpointSteps(spec.checkpoint_dir, s, spec.num_servers), last)) {
        missing.push_back(s);
      }
    }
    if (!missing.empty()) {
      return absl::DataLossError(absl::StrCat("the checkpoint of the last step (", last, ") of shard(s) ",
                                              absl::StrJoin(missing, ", "), " is not in ", spec.checkpoint_dir,
                                              " (see the servers' logs in ", spec.run_dir, ")"));
    }
  }
  int restarted = 0, servers_restarted = 0;
  for (int n : restarts) restarted += n;
  for (int n : server_restarts) servers_restarted += n;
  std::vector<std::string> after;
  if (restarted > 0) after.push_back(absl::StrCat(restarted, " trainer restarts"));
  if (servers_restarted > 0) after.push_back(absl::StrCat(servers_restarted, " server restarts"));
  std::printf("pshard: all %d trainers finished%s; %d shard servers shut down cleanly\n", spec.num_trainers,
              after.empty() ? "" : absl::StrCat(" (after ", absl::StrJoin(after, ", "), ")").c_str(), spec.num_servers);
  return absl::OkStatus();
}

}  // namespace pshard
