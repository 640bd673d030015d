// Who is calling: a server's per-call check of a caller's token and TLS
// certificate, giving the caller's role or why it has none.
#ifndef PSHARD_COMMON_SECURITY_CALLER_AUTHENTICATOR_H_
#define PSHARD_COMMON_SECURITY_CALLER_AUTHENTICATOR_H_

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/security/security.h"
#include "grpcpp/server_context.h"

namespace pshard {

/// Why a caller was refused (a bounded metric label).
enum class AuthFailure {
  kNoCredentials,         ///< neither the certificate nor the token that is required
  kWrongToken,            ///< a token that is not any role's
  kUntrustedCertificate,  ///< a certificate that does not chain to the CA (or expired)
  kNoRole,                ///< a trusted certificate that names no known role
  kRoleMismatch,          ///< certificate and token name different roles
  kWrongRole,             ///< a role this call is not allowed to
  kUnknownSession,        ///< a UCX peer whose session token was not issued to it at Join
};
inline constexpr int kNumAuthFailures = 7;
const char* AuthFailureName(AuthFailure failure);

/// The outcome of identifying a caller: a role, or a refusal whose status
/// (UNAUTHENTICATED or PERMISSION_DENIED) says what was missing.
struct CallerCheck {
  std::optional<Role> role;
  AuthFailure failure = AuthFailure::kNoCredentials;
  absl::Status refusal;
};

/// Checks callers against a server's SecurityOptions: with a CA, every call
/// must come with a certificate that chains to it (re-read when the CA file
/// changes, so that rotation works) and names a role; with a token file,
/// with a token of some role; with both, both, naming the same role.
/// Thread-safe.
class CallerAuthenticator {
 public:
  static absl::StatusOr<std::unique_ptr<CallerAuthenticator>> Create(const SecurityOptions& options);
  ~CallerAuthenticator();

  /// False when the server authenticates nobody (every call is allowed).
  bool enabled() const { return check_certificates_ || check_tokens_; }

  /// The role of `ctx`'s caller.
  CallerCheck Identify(const grpc::ServerContextBase& ctx);

  /// The same, from a token and a PEM certificate chain (leaf first) as
  /// they arrived; empty strings when absent.
  CallerCheck Identify(absl::string_view authorization, absl::string_view pem_chain);

 private:
  struct Store;
  CallerAuthenticator() = default;
  CallerCheck VerifyChain(const std::string& pem_chain) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReloadCaIfChanged() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  bool check_certificates_ = false;
  bool check_tokens_ = false;
  std::array<std::string, kNumRoles> tokens_;
  std::string ca_path_;
  absl::Duration reload_interval_;
  absl::Mutex mu_;
  std::unique_ptr<Store> store_ ABSL_GUARDED_BY(mu_);
  absl::Time next_reload_check_ ABSL_GUARDED_BY(mu_);
  // Verdicts by certificate chain, so that a connection's calls verify once;
  // bounded (cleared when full) and cleared when the CA changes.
  absl::flat_hash_map<std::string, CallerCheck> verdicts_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pshard

#endif  // PSHARD_COMMON_SECURITY_CALLER_AUTHENTICATOR_H_
