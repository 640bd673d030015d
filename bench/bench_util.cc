#include "bench/bench_util.h"

#include <arpa/inet.h>
#include <signal.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <regex>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tools/process.h"
#include "trainer_client/model/gpt_spec.h"

namespace pshard::bench {

int OneBlockWidth(double unit_mib, double bytes_per_element) {
  // One transformer block holds 12 C^2 + 13 C parameters: pick C for the size.
  const double elements = unit_mib * 1048576.0 / bytes_per_element;
  int width = static_cast<int>(std::sqrt(elements / 12.0));
  return width - width % 4;
}

JobConfig OneBlockJob(double unit_mib, double bytes_per_element, int num_shards) {
  JobConfig job;
  job.model = MakeGptSpec(GptConfig{.num_layers = 1,
                                    .d_model = OneBlockWidth(unit_mib, bytes_per_element),
                                    .num_heads = 4,
                                    .context = 64,
                                    .vocab = 256})
                  .value();
  job.num_shards = num_shards;
  return job;
}

void ServerProcesses::Stop() {
  for (ChildProcess& c : children) c.Signal(SIGTERM);
  for (ChildProcess& c : children) c.WaitUntil(absl::Now() + absl::Seconds(20));
}

absl::StatusOr<ServerProcesses> StartServerProcesses(const std::string& bin_dir, int num_shards,
                                                     const std::vector<std::string>& args, const std::string& dir) {
  ServerProcesses servers;
  for (int s = 0; s < num_shards; ++s) {
    const std::string port_file = absl::StrCat(dir, "/port", s);
    std::vector<std::string> argv = {bin_dir + "/pshard-server", absl::StrCat("--shard_index=", s),
                                     absl::StrCat("--num_shards=", num_shards),
                                     absl::StrCat("--port_file=", port_file)};
    if (s > 0) argv.push_back(absl::StrCat("--coordinator=", servers.addresses[0]));
    argv.insert(argv.end(), args.begin(), args.end());
    absl::StatusOr<ChildProcess> child = ChildProcess::Spawn(argv, absl::StrCat(dir, "/server", s, ".log"));
    if (!child.ok()) {
      servers.Stop();
      return child.status();
    }
    servers.children.push_back(std::move(*child));
    absl::StatusOr<int> port = WaitForPortFile(port_file, servers.children.back(), absl::Seconds(120));
    if (!port.ok()) {
      servers.Stop();
      return port.status();
    }
    servers.addresses.push_back(absl::StrCat("127.0.0.1:", *port));
  }
  return servers;
}

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "benchmark failed: %s\n", status.ToString().c_str());
  return 1;
}

absl::StatusOr<int> PickFreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    close(fd);
    return absl::UnavailableError("cannot bind a loopback port");
  }
  close(fd);
  return ntohs(addr.sin_port);
}

bool MeetsFloor(const std::string& what, double ratio, double goal, double fraction) {
  if (ratio >= fraction * goal) return true;
  std::fprintf(stderr, "below the floor: %s ratio %.2f < %.2f (%.2f of the goal %.2f)\n", what.c_str(), ratio,
               fraction * goal, fraction, goal);
  return false;
}

absl::StatusOr<double> IperfLoopbackBytesPerSecond(int seconds, int streams) {
  absl::StatusOr<int> port = PickFreePort();
  if (!port.ok()) return port.status();
  absl::StatusOr<ChildProcess> server =
      ChildProcess::Spawn({"/usr/bin/iperf3", "-s", "-1", "-B", "127.0.0.1", "-p", absl::StrCat(*port)}, "/dev/null");
  if (!server.ok()) return server.status();
  absl::SleepFor(absl::Milliseconds(500));
  const std::string cmd =
      absl::StrCat("/usr/bin/iperf3 -c 127.0.0.1 -p ", *port, " -t ", seconds, " -P ", streams, " -J 2>&1");
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return absl::InternalError("cannot run iperf3");
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), pipe)) out.append(buf, n);
  pclose(pipe);
  server->WaitUntil(absl::Now() + absl::Seconds(5));
  // The receiver's total over every stream: "sum_received": { ... "bits_per_second": X
  std::smatch m;
  if (!std::regex_search(out, m, std::regex(R"re("sum_received"\s*:\s*\{[^}]*"bits_per_second"\s*:\s*([0-9.e+]+))re"))) {
    return absl::InternalError(absl::StrCat("could not read iperf3's result:\n", out.substr(0, 2000)));
  }
  return std::stod(m[1]) / 8.0;
}

absl::StatusOr<ProcessMemory> ReadProcessMemory(int pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  if (!in) return absl::NotFoundError(absl::StrCat("no process ", pid));
  ProcessMemory mem;
  std::string line;
  while (std::getline(in, line)) {
    long long kb = 0;
    if (std::sscanf(line.c_str(), "VmRSS: %lld kB", &kb) == 1) mem.rss = kb * 1024;
    if (std::sscanf(line.c_str(), "VmHWM: %lld kB", &kb) == 1) mem.peak_rss = kb * 1024;
  }
  return mem;
}

}  // namespace pshard::bench
