#include "common/security/caller_authenticator.h"

#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>
#include <openssl/x509v3.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/security/auth_context.h"

namespace pshard {
namespace {

constexpr const char* kFailureNames[kNumAuthFailures] = {
    "no_credentials", "wrong_token", "untrusted_certificate", "no_role", "role_mismatch", "wrong_role",
    "unknown_session"};
constexpr size_t kMaxVerdicts = 4096;
constexpr absl::string_view kBearer = "Bearer ";

CallerCheck Refuse(AuthFailure failure, absl::Status status) {
  CallerCheck check;
  check.failure = failure;
  check.refusal = std::move(status);
  return check;
}

CallerCheck Accept(Role role) {
  CallerCheck check;
  check.role = role;
  return check;
}

std::string OpenSslError() {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return "no details";
  char text[256];
  ERR_error_string_n(e, text, sizeof text);
  return text;
}

struct X509Deleter {
  void operator()(X509* x) const { X509_free(x); }
};
using X509Ptr = std::unique_ptr<X509, X509Deleter>;

// Every certificate in `pem`, in order.
std::vector<X509Ptr> ParseCertificates(absl::string_view pem) {
  std::vector<X509Ptr> certificates;
  BIO* bio = BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()));
  if (bio == nullptr) return certificates;
  while (X509* x = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr)) certificates.emplace_back(x);
  ERR_clear_error();  // the end of the input reads as an error
  BIO_free(bio);
  return certificates;
}

// The known roles among the subject's organizational units.
std::vector<Role> RolesOf(X509* certificate) {
  std::vector<Role> roles;
  X509_NAME* subject = X509_get_subject_name(certificate);
  for (int i = X509_NAME_get_index_by_NID(subject, NID_organizationalUnitName, -1); i >= 0;
       i = X509_NAME_get_index_by_NID(subject, NID_organizationalUnitName, i)) {
    ASN1_STRING* value = X509_NAME_ENTRY_get_data(X509_NAME_get_entry(subject, i));
    const std::string_view ou(reinterpret_cast<const char*>(ASN1_STRING_get0_data(value)),
                              static_cast<size_t>(ASN1_STRING_length(value)));
    if (std::optional<Role> role = RoleFromName(ou); role && std::find(roles.begin(), roles.end(), *role) == roles.end()) {
      roles.push_back(*role);
    }
  }
  return roles;
}

std::string AuthProperty(const grpc::AuthContext& auth, const char* name) {
  std::string value;
  for (const grpc::string_ref& v : auth.FindPropertyValues(name)) value.append(v.data(), v.size());
  return value;
}

}  // namespace

const char* AuthFailureName(AuthFailure failure) { return kFailureNames[static_cast<int>(failure)]; }

struct CallerAuthenticator::Store {
  X509_STORE* store = nullptr;
  std::filesystem::file_time_type modified;
  ~Store() { X509_STORE_free(store); }
};

namespace {

// The CA file as a verification store, or why it cannot be one.
absl::StatusOr<X509_STORE*> LoadStore(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("--tls_ca=", path, ": cannot read the file"));
  std::stringstream text;
  text << in.rdbuf();
  std::vector<X509Ptr> cas = ParseCertificates(text.str());
  if (cas.empty()) return absl::InvalidArgumentError(absl::StrCat("--tls_ca=", path, ": no PEM certificates in it"));
  X509_STORE* store = X509_STORE_new();
  for (const X509Ptr& ca : cas) {
    if (X509_STORE_add_cert(store, ca.get()) != 1) {
      const std::string why = OpenSslError();
      X509_STORE_free(store);
      return absl::InvalidArgumentError(absl::StrCat("--tls_ca=", path, ": ", why));
    }
  }
  return store;
}

}  // namespace

absl::StatusOr<std::unique_ptr<CallerAuthenticator>> CallerAuthenticator::Create(const SecurityOptions& options) {
  if (absl::Status s = options.Validate(/*server=*/true); !s.ok()) return s;
  std::unique_ptr<CallerAuthenticator> a(new CallerAuthenticator());
  a->reload_interval_ = options.reload_interval;
  if (!options.auth_token_file.empty()) {
    absl::StatusOr<std::array<std::string, kNumRoles>> tokens = ReadTokenFile(options.auth_token_file);
    if (!tokens.ok()) return tokens.status();
    a->tokens_ = *tokens;
    a->check_tokens_ = true;
  }
  if (!options.tls_ca.empty()) {
    absl::StatusOr<X509_STORE*> store = LoadStore(options.tls_ca);
    if (!store.ok()) return store.status();
    absl::MutexLock lock(&a->mu_);
    a->store_ = std::make_unique<Store>();
    a->store_->store = *store;
    std::error_code ignored;
    a->store_->modified = std::filesystem::last_write_time(options.tls_ca, ignored);
    a->next_reload_check_ = absl::Now() + a->reload_interval_;
    a->ca_path_ = options.tls_ca;
    a->check_certificates_ = true;
  }
  return a;
}

CallerAuthenticator::~CallerAuthenticator() = default;

void CallerAuthenticator::ReloadCaIfChanged() {
  const absl::Time now = absl::Now();
  if (now < next_reload_check_) return;
  next_reload_check_ = now + reload_interval_;
  verdicts_.clear();  // so that a certificate that expired since is judged again
  std::error_code error;
  const std::filesystem::file_time_type modified = std::filesystem::last_write_time(ca_path_, error);
  if (error || modified == store_->modified) return;
  absl::StatusOr<X509_STORE*> store = LoadStore(ca_path_);
  if (!store.ok()) {
    std::fprintf(stderr, "pshard: keeping the CA certificates loaded before: %s\n",
                 std::string(store.status().message()).c_str());
    return;
  }
  X509_STORE_free(store_->store);
  store_->store = *store;
  store_->modified = modified;
  verdicts_.clear();
}

CallerCheck CallerAuthenticator::VerifyChain(const std::string& pem_chain) {
  std::vector<X509Ptr> chain = ParseCertificates(pem_chain);
  if (chain.empty()) {
    return Refuse(AuthFailure::kUntrustedCertificate,
                  absl::UnauthenticatedError("the client certificate cannot be read"));
  }
  STACK_OF(X509)* untrusted = sk_X509_new_null();
  for (size_t i = 1; i < chain.size(); ++i) sk_X509_push(untrusted, chain[i].get());
  X509_STORE_CTX* ctx = X509_STORE_CTX_new();
  int ok = X509_STORE_CTX_init(ctx, store_->store, chain[0].get(), untrusted);
  if (ok == 1) {
    X509_STORE_CTX_set_purpose(ctx, X509_PURPOSE_SSL_CLIENT);
    ok = X509_verify_cert(ctx);
  }
  const std::string why = ok == 1 ? "" : X509_verify_cert_error_string(X509_STORE_CTX_get_error(ctx));
  X509_STORE_CTX_free(ctx);
  sk_X509_free(untrusted);
  ERR_clear_error();
  if (ok != 1) {
    return Refuse(AuthFailure::kUntrustedCertificate,
                  absl::UnauthenticatedError(absl::StrCat("client certificate refused: ", why,
                                                          " (it must be signed by this server's CA)")));
  }
  const std::vector<Role> roles = RolesOf(chain[0].get());
  if (roles.size() != 1) {
    return Refuse(AuthFailure::kNoRole,
                  absl::PermissionDeniedError(absl::StrCat(
                      "the client certificate names ", roles.empty() ? "no role" : "more than one role",
                      ": its subject needs exactly one OU of server, trainer or reader")));
  }
  return Accept(roles[0]);
}

CallerCheck CallerAuthenticator::Identify(const grpc::ServerContextBase& ctx) {
  if (!enabled()) return Identify("", "");
  std::string authorization;
  auto range = ctx.client_metadata().equal_range(kTokenMetadataKey);
  if (range.first != range.second) authorization.assign(range.first->second.data(), range.first->second.size());
  std::string pem;
  if (check_certificates_) {
    const std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
    if (auth != nullptr) {
      pem = AuthProperty(*auth, GRPC_X509_PEM_CERT_PROPERTY_NAME);
      if (!pem.empty()) pem += AuthProperty(*auth, GRPC_X509_PEM_CERT_CHAIN_PROPERTY_NAME);
    }
  }
  return Identify(authorization, pem);
}

CallerCheck CallerAuthenticator::Identify(absl::string_view authorization, absl::string_view pem_chain) {
  if (!enabled()) return Accept(Role::kServer);  // unused: nothing is refused
  std::optional<Role> certificate_role;
  if (check_certificates_) {
    if (pem_chain.empty()) {
      return Refuse(AuthFailure::kNoCredentials,
                    absl::UnauthenticatedError("no client certificate: this server requires one signed by its CA"));
    }
    absl::MutexLock lock(&mu_);
    ReloadCaIfChanged();
    const std::string key(pem_chain);
    auto it = verdicts_.find(key);
    if (it == verdicts_.end()) {
      if (verdicts_.size() >= kMaxVerdicts) verdicts_.clear();
      it = verdicts_.emplace(key, VerifyChain(key)).first;
    }
    if (!it->second.role) return it->second;
    certificate_role = it->second.role;
  }
  if (!check_tokens_) return Accept(*certificate_role);
  if (authorization.empty()) {
    return Refuse(AuthFailure::kNoCredentials,
                  absl::UnauthenticatedError("no token: this server requires one (--auth_token_file)"));
  }
  std::optional<Role> token_role;
  if (absl::StartsWith(authorization, kBearer)) {
    const absl::string_view token = authorization.substr(kBearer.size());
    for (int i = 0; i < kNumRoles; ++i) {
      const std::string& known = tokens_[i];
      if (!known.empty() && known.size() == token.size() &&
          CRYPTO_memcmp(known.data(), token.data(), token.size()) == 0) {
        token_role = static_cast<Role>(i);
      }
    }
  }
  if (!token_role) return Refuse(AuthFailure::kWrongToken, absl::UnauthenticatedError("wrong token"));
  if (certificate_role && *certificate_role != *token_role) {
    return Refuse(AuthFailure::kRoleMismatch,
                  absl::PermissionDeniedError(absl::StrCat("the certificate's role (", RoleName(*certificate_role),
                                                           ") and the token's (", RoleName(*token_role),
                                                           ") differ")));
  }
  return Accept(*token_role);
}

}  // namespace pshard
