// The container entrypoint's decisions (tools/entrypoint.h) from an
// environment, arguments and a hostname: the input is text, one entry a
// line. "NAME=value" sets a variable, "@name" the hostname, "!root" runs
// as root, "?path" makes a file exist; any other line is an argument, in
// order. A plan decided names a known role and its program, puts the
// index it found among the servers or trainers it counted, passes the
// arguments after the role on last, and is decided the same way twice.
#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "fuzz/harness.h"
#include "tools/entrypoint.h"

namespace pshard::fuzz {
namespace {

using entrypoint::Facts;
using entrypoint::LaunchPlan;

void CheckPlan(const LaunchPlan& plan, const std::vector<std::string>& args) {
  Require((plan.role == "server" && plan.program == "pshard-server") ||
              (plan.role == "trainer" && plan.program == "pshard-trainer") ||
              (plan.role == "health" && plan.program.empty() && !plan.health_address.empty()),
          absl::StrCat("a plan of role \"", plan.role, "\" runs \"", plan.program, "\""));
  Require(!plan.Summary().empty(), "a plan without a summary");
  if (plan.shaping) {
    Require(plan.shaping->rate_bits_per_second > 0 && plan.shaping->burst_bytes > 0 &&
                plan.shaping->TcCommand().size() == 13,
            "shaping without a rate");
  }
  if (plan.role == "health") return;
  const bool role_argument = !args.empty() && !absl::StartsWith(args[0], "-");
  const size_t passed = args.size() - (role_argument ? 1 : 0);
  Require(plan.args.size() >= passed &&
              std::equal(args.end() - passed, args.end(), plan.args.end() - passed),
          "the arguments after the role are not passed on last");
  const std::string index_flag = plan.role == "server" ? "--shard_index=" : "--rank=";
  int flags = 0;
  for (const std::string& a : plan.args) flags += absl::StartsWith(a, index_flag) ? 1 : 0;
  Require(flags >= 1, absl::StrCat("a ", plan.role, " plan without ", index_flag));
}

void FuzzEntrypoint(absl::string_view text) {
  Facts facts;
  std::set<std::string> files;
  std::vector<std::string> args;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::ConsumePrefix(&line, "@")) {
      facts.hostname = std::string(line);
    } else if (line == "!root") {
      facts.is_root = true;
    } else if (absl::ConsumePrefix(&line, "?")) {
      files.insert(std::string(line));
    } else if (const size_t eq = line.find('='); eq != absl::string_view::npos && eq > 0 && line[0] != '-') {
      facts.env[std::string(line.substr(0, eq))] = std::string(line.substr(eq + 1));
    } else {
      args.emplace_back(line);
    }
  }
  facts.file_exists = [&files](const std::string& path) { return files.count(path) > 0; };
  const absl::StatusOr<LaunchPlan> plan = entrypoint::Plan(args, facts);
  const absl::StatusOr<LaunchPlan> again = entrypoint::Plan(args, facts);
  Require(plan.ok() == again.ok() && (!plan.ok() || plan->Summary() == again->Summary()),
          "the same environment decided two ways");
  if (plan.ok()) CheckPlan(*plan, args);
}

}  // namespace
}  // namespace pshard::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pshard::fuzz::FuzzEntrypoint(absl::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
