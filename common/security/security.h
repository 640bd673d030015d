// Who may talk to a shard server: mutual TLS (roles in certificates) and
// shared tokens (roles in a token file), and the gRPC channels and server
// credentials that carry them.
#ifndef PSHARD_COMMON_SECURITY_SECURITY_H_
#define PSHARD_COMMON_SECURITY_SECURITY_H_

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace pshard {

/// What a caller is allowed to be. A certificate names its role in its
/// subject's organizational unit (OU=server, OU=trainer, OU=reader); a token
/// file names each role's token.
enum class Role { kServer, kTrainer, kReader };
inline constexpr int kNumRoles = 3;
const char* RoleName(Role role);
std::optional<Role> RoleFromName(std::string_view name);

/// How a process proves who it is, and checks whom it talks to. All empty:
/// plaintext and no authentication (the default, for trusted networks).
struct SecurityOptions {
  /// PEM certificate (chain) and private key of this process. A server
  /// serves TLS with them (and calls shard 0 with them); a client presents
  /// them. Both or neither.
  std::string tls_cert;
  std::string tls_key;
  /// PEM CA certificates. A server requires every caller's certificate to
  /// chain to them; a client requires the server's to.
  std::string tls_ca;
  /// Lines "ROLE TOKEN" (server, trainer, reader; '#' starts a comment).
  /// A server accepts each listed token as its role; a client sends its
  /// role's token with every call.
  std::string auth_token_file;
  /// Clients: the name servers' certificates must carry (empty: the host
  /// of the address dialled).
  std::string tls_server_name;
  /// How often certificate files are checked for changes (rotation).
  absl::Duration reload_interval = absl::Seconds(10);

  bool tls_identity() const { return !tls_cert.empty() || !tls_key.empty(); }
  bool any() const { return tls_identity() || !tls_ca.empty() || !auth_token_file.empty(); }
  /// Refuses inconsistent settings, naming the flag: a certificate without
  /// its key (or the reverse), a client that would talk TLS without a CA,
  /// files that cannot be read.
  absl::Status Validate(bool server) const;
};

/// How a server with these options talks to its callers, for its start
/// line: "TLS, client certificates required, tokens required" or
/// "plaintext, no authentication".
std::string DescribeSecurity(const SecurityOptions& options);

/// Tokens by role, read from a token file. A role without a line has none.
/// Refused: unknown roles, a role listed twice, the same token for two
/// roles, tokens shorter than 16 characters.
absl::StatusOr<std::array<std::string, kNumRoles>> ReadTokenFile(const std::string& path);

/// The metadata key a token travels in ("authorization: Bearer TOKEN").
inline constexpr char kTokenMetadataKey[] = "authorization";

/// A client's credentials for one role: every channel it opens to a shard
/// server carries them. Immutable; thread-safe.
class ClientSecurity {
 public:
  /// `options` empty: plaintext channels without a token.
  static absl::StatusOr<std::shared_ptr<const ClientSecurity>> Create(const SecurityOptions& options, Role role);
  /// A channel to `target` ("host:port") with these credentials.
  std::shared_ptr<grpc::Channel> NewChannel(const std::string& target,
                                            grpc::ChannelArguments args = grpc::ChannelArguments()) const;
  Role role() const { return role_; }
  bool tls() const { return tls_; }

 private:
  ClientSecurity() = default;
  Role role_ = Role::kReader;
  bool tls_ = false;
  std::string token_;
  std::string server_name_;
  std::shared_ptr<grpc::ChannelCredentials> credentials_;
};

/// The credentials a shard server listens with: TLS when it has a
/// certificate (asking callers for theirs; `CallerAuthenticator` checks
/// them per call, so a caller without one is refused and counted rather
/// than dropped in the handshake), plaintext otherwise.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(const SecurityOptions& options);

}  // namespace pshard

#endif  // PSHARD_COMMON_SECURITY_SECURITY_H_
