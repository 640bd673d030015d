// The security flags shared by pshard-server, pshard-trainer and the pshard
// CLI (only their mains link this).
#ifndef PSHARD_COMMON_SECURITY_FLAGS_H_
#define PSHARD_COMMON_SECURITY_FLAGS_H_

#include <string>
#include <vector>

#include "common/security/security.h"

namespace pshard {

/// --tls_cert, --tls_key, --tls_ca, --auth_token_file, --tls_server_name,
/// --tls_reload_seconds as options.
SecurityOptions SecurityOptionsFromFlags();

/// The same settings as command-line arguments for a child process (only
/// those that are set).
std::vector<std::string> SecurityArguments(const SecurityOptions& options);

}  // namespace pshard

#endif  // PSHARD_COMMON_SECURITY_FLAGS_H_
