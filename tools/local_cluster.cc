#include "tools/local_cluster.h"

#include <signal.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/signals.h"
#include "common/status_macros.h"
#include "tools/process.h"

namespace pshard {
namespace {

std::atomic<int> g_signal{0};

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

}  // namespace

absl::Status RunLocalCluster(const LocalClusterSpec& spec) {
  if (spec.num_servers < 1 || spec.num_trainers < 1) {
    return absl::InvalidArgumentError(absl::StrCat("need at least one server and one trainer, got ",
                                                   spec.num_servers, " and ", spec.num_trainers));
  }
  CallOnTerminationSignal([](int signo) { g_signal = signo; });
  const std::string server_bin = spec.bin_dir + "/pshard-server";
  const std::string trainer_bin = spec.bin_dir + "/pshard-trainer";
  std::vector<ChildProcess> servers, trainers;
  std::vector<std::string> addresses;
  auto fail = [&](absl::Status s) {
    StopAll(trainers, absl::Seconds(5));
    StopAll(servers, absl::Seconds(5));
    return s;
  };

  for (int s = 0; s < spec.num_servers; ++s) {
    const std::string port_file = absl::StrCat(spec.run_dir, "/server", s, ".port");
    std::remove(port_file.c_str());
    std::vector<std::string> argv = {server_bin,
                                     absl::StrCat("--shard_index=", s),
                                     absl::StrCat("--num_shards=", spec.num_servers),
                                     absl::StrCat("--num_trainers=", spec.num_trainers),
                                     "--address=127.0.0.1:0",
                                     absl::StrCat("--port_file=", port_file)};
    if (s > 0) argv.push_back(absl::StrCat("--coordinator=", addresses[0]));
    argv.insert(argv.end(), spec.server_flags.begin(), spec.server_flags.end());
    const std::string log = absl::StrCat(spec.run_dir, "/server", s, ".log");
    absl::StatusOr<ChildProcess> child = ChildProcess::Spawn(argv, log);
    if (!child.ok()) return fail(child.status());
    servers.push_back(std::move(*child));
    absl::StatusOr<int> port = WaitForPortFile(port_file, servers.back(), absl::Seconds(30));
    if (!port.ok()) {
      return fail(absl::Status(port.status().code(),
                               absl::StrCat(port.status().message(), "\n--- ", log, " ---\n", Tail(log))));
    }
    addresses.push_back(absl::StrCat("127.0.0.1:", *port));
  }
  std::printf("pshard: %d shard servers up (%s); starting %d trainers; logs in %s\n", spec.num_servers,
              absl::StrJoin(addresses, ", ").c_str(), spec.num_trainers, spec.run_dir.c_str());
  std::fflush(stdout);

  std::vector<std::string> logs;
  for (int r = 0; r < spec.num_trainers; ++r) {
    std::vector<std::string> argv = {trainer_bin, absl::StrCat("--servers=", absl::StrJoin(addresses, ",")),
                                     absl::StrCat("--rank=", r)};
    argv.insert(argv.end(), spec.trainer_flags.begin(), spec.trainer_flags.end());
    if (r != 0) argv.push_back("--log_every=0");
    logs.push_back(r == 0 ? std::string() : absl::StrCat(spec.run_dir, "/trainer", r, ".log"));
    absl::StatusOr<ChildProcess> child = ChildProcess::Spawn(argv, logs.back());
    if (!child.ok()) return fail(child.status());
    trainers.push_back(std::move(*child));
  }

  // Watch: all trainers done is success; any failure or a signal stops all.
  while (true) {
    if (g_signal != 0) {
      std::printf("\npshard: interrupted; stopping trainers and servers\n");
      std::fflush(stdout);
      fail(absl::OkStatus()).IgnoreError();
      return absl::CancelledError("interrupted");
    }
    bool all_done = true;
    for (int r = 0; r < spec.num_trainers; ++r) {
      std::optional<int> code = trainers[r].Poll();
      if (!code) {
        all_done = false;
        continue;
      }
      if (*code != 0) {
        const std::string where = r == 0 ? std::string("its output above") : logs[r];
        return fail(absl::InternalError(absl::StrCat("trainer ", r, " exited with code ", *code, " (see ",
                                                     where, ")", r == 0 ? "" : "\n", r == 0 ? "" : Tail(logs[r]))));
      }
    }
    for (int s = 0; s < spec.num_servers; ++s) {
      if (std::optional<int> code = servers[s].Poll()) {
        const std::string log = absl::StrCat(spec.run_dir, "/server", s, ".log");
        return fail(absl::InternalError(
            absl::StrCat("shard server ", s, " exited early with code ", *code, "\n", Tail(log))));
      }
    }
    if (all_done) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  StopAll(servers, absl::Seconds(10));
  for (int s = 0; s < spec.num_servers; ++s) {
    if (servers[s].Poll().value_or(-1) != 0) {
      return absl::InternalError(absl::StrCat("shard server ", s, " did not shut down cleanly (code ",
                                              servers[s].Poll().value_or(-1), ")"));
    }
  }
  std::printf("pshard: all %d trainers finished; %d shard servers shut down cleanly\n", spec.num_trainers,
              spec.num_servers);
  return absl::OkStatus();
}

}  // namespace pshard
