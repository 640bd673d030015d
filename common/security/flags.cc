#include "common/security/flags.h"

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate of this process (its subject's OU is its role: server, trainer or reader); with "
          "--tls_key. A server serves TLS with it; a client presents it");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA certificates: a server requires callers' certificates to chain to them; a client, the server's");
ABSL_FLAG(std::string, auth_token_file, "",
          "file of \"ROLE TOKEN\" lines: a server accepts each token as its role; a client sends its role's");
ABSL_FLAG(std::string, tls_server_name, "",
          "clients: the name servers' certificates must carry (default: the host dialled)");
ABSL_FLAG(int, tls_reload_seconds, 10, "how often certificate files are checked for changes (rotation)");

namespace pshard {

SecurityOptions SecurityOptionsFromFlags() {
  SecurityOptions options;
  options.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key = absl::GetFlag(FLAGS_tls_key);
  options.tls_ca = absl::GetFlag(FLAGS_tls_ca);
  options.auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  options.reload_interval = absl::Seconds(absl::GetFlag(FLAGS_tls_reload_seconds));
  return options;
}

std::vector<std::string> SecurityArguments(const SecurityOptions& options) {
  std::vector<std::string> args;
  auto add = [&](const char* flag, const std::string& value) {
    if (!value.empty()) args.push_back(absl::StrCat("--", flag, "=", value));
  };
  add("tls_cert", options.tls_cert);
  add("tls_key", options.tls_key);
  add("tls_ca", options.tls_ca);
  add("auth_token_file", options.auth_token_file);
  add("tls_server_name", options.tls_server_name);
  if (options.reload_interval != absl::Seconds(10)) {
    args.push_back(absl::StrCat("--tls_reload_seconds=", absl::ToInt64Seconds(options.reload_interval)));
  }
  return args;
}

}  // namespace pshard
