// pshard-entrypoint: the container entrypoint. Reads the environment (see
// tools/entrypoint.h), shapes the link with tbf when asked and able, drops
// root, and execs pshard-server or pshard-trainer; `health` checks the local
// server over grpc.health.v1 (for compose health checks).
#include <grp.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "common/security/security.h"
#include "proto/health.grpc.pb.h"
#include "tools/entrypoint.h"

extern char** environ;

namespace {

using pshard::entrypoint::LaunchPlan;

int Fail(const std::string& message) {
  std::fprintf(stderr, "pshard-entrypoint: %s\n", message.c_str());
  return 2;
}

int CheckHealth(const LaunchPlan& plan) {
  const std::string& address = plan.health_address;
  pshard::SecurityOptions tls;
  tls.tls_ca = plan.health_tls_ca;
  tls.tls_server_name = plan.health_tls_server_name;
  absl::StatusOr<std::shared_ptr<const pshard::ClientSecurity>> security =
      pshard::ClientSecurity::Create(tls, pshard::Role::kReader);
  if (!security.ok()) return Fail(std::string(security.status().message()));
  auto stub = grpc::health::v1::Health::NewStub((*security)->NewChannel(address));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(3)));
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status s = stub->Check(&ctx, request, &response);
  if (!s.ok()) {
    std::fprintf(stderr, "pshard-entrypoint: health of %s: %s\n", address.c_str(), s.error_message().c_str());
    return 1;
  }
  if (response.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    std::fprintf(stderr, "pshard-entrypoint: %s is not serving (status %d)\n", address.c_str(),
                 static_cast<int>(response.status()));
    return 1;
  }
  return 0;
}

// Runs a command and returns its exit status (or -1 when it cannot start).
int Run(const std::vector<std::string>& command) {
  std::vector<char*> argv;
  for (const std::string& a : command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0) return -1;
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string FlagValue(const std::vector<std::string>& args, const std::string& flag) {
  const std::string prefix = absl::StrCat("--", flag, "=");
  std::string value;
  for (const std::string& a : args) {
    if (a.rfind(prefix, 0) == 0) value = a.substr(prefix.size());
  }
  return value;
}

// Gives the checkpoint folder to the user the program runs as (a named
// volume may arrive owned by root).
void PrepareStateDir(const LaunchPlan& plan) {
  const std::string dir = FlagValue(plan.args, "checkpoint_dir");
  if (dir.empty() || plan.uid < 0) return;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (::chown(dir.c_str(), plan.uid, plan.gid) != 0) {
    std::fprintf(stderr, "pshard-entrypoint: warning: cannot give %s to uid %d: %s\n", dir.c_str(), plan.uid,
                 std::strerror(errno));
  }
}

std::string ProgramPath(const std::string& program) {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const std::filesystem::path beside = self.parent_path() / program;
    if (std::filesystem::exists(beside, ec)) return beside.string();
  }
  return program;  // execvp searches PATH
}

}  // namespace

int main(int argc, char** argv) {
  pshard::entrypoint::Facts facts;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    const size_t eq = entry.find('=');
    if (eq != std::string::npos) facts.env[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) == 0) facts.hostname = host;
  facts.is_root = geteuid() == 0;
  facts.file_exists = [](const std::string& path) { return ::access(path.c_str(), R_OK) == 0; };

  absl::StatusOr<LaunchPlan> plan = pshard::entrypoint::Plan(std::vector<std::string>(argv + 1, argv + argc), facts);
  if (!plan.ok()) return Fail(std::string(plan.status().message()));
  if (plan->role == "health") return CheckHealth(*plan);

  if (plan->shaping) {
    const std::vector<std::string> tc = plan->shaping->TcCommand();
    const int rc = Run(tc);
    if (rc != 0) {
      const std::string what = absl::StrCat("`", absl::StrJoin(tc, " "), "` failed (exit ", rc,
                                            "; the container needs NET_ADMIN and iproute2)");
      if (!plan->shaping_may_fall_back) return Fail(what);
      std::fprintf(stderr, "pshard-entrypoint: warning: %s; emulating the rate in process instead\n", what.c_str());
      plan->shaping.reset();
      plan->unset_env.clear();
    }
  }
  for (const std::string& name : plan->unset_env) ::unsetenv(name.c_str());
  PrepareStateDir(*plan);
  if (plan->uid >= 0) {
    if (::setgroups(0, nullptr) != 0 || ::setgid(plan->gid) != 0 || ::setuid(plan->uid) != 0) {
      return Fail(absl::StrCat("cannot switch to uid ", plan->uid, ": ", std::strerror(errno)));
    }
  }
  std::fprintf(stderr, "pshard-entrypoint: %s\n", plan->Summary().c_str());
  std::fflush(stderr);

  const std::string path = ProgramPath(plan->program);
  std::vector<char*> child_argv;
  child_argv.push_back(const_cast<char*>(plan->program.c_str()));
  for (std::string& a : plan->args) child_argv.push_back(a.data());
  child_argv.push_back(nullptr);
  ::execvp(path.c_str(), child_argv.data());
  return Fail(absl::StrCat("cannot start ", path, ": ", std::strerror(errno)));
}
