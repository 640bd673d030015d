#include "common/security/security.h"

#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "grpc/grpc_security.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_certificate_verifier.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "grpcpp/support/client_interceptor.h"

namespace pshard {
namespace {

constexpr const char* kRoleNames[kNumRoles] = {"server", "trainer", "reader"};
constexpr size_t kMinTokenLength = 16;

absl::Status Readable(const std::string& path, const char* flag) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("--", flag, "=", path, ": cannot read the file"));
  return absl::OkStatus();
}

// Adds the role's token to every call's initial metadata.
class TokenInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit TokenInterceptor(const std::string* value) : value_(value) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->insert({kTokenMetadataKey, *value_});
    }
    methods->Proceed();
  }

 private:
  const std::string* const value_;  // owned by the factory
};

class TokenInterceptorFactory final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit TokenInterceptorFactory(std::string token) : value_(absl::StrCat("Bearer ", token)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(grpc::experimental::ClientRpcInfo*) override {
    return new TokenInterceptor(&value_);
  }

 private:
  const std::string value_;
};

unsigned RefreshSeconds(absl::Duration interval) {
  return static_cast<unsigned>(std::max<int64_t>(1, absl::ToInt64Seconds(interval)));
}

}  // namespace

const char* RoleName(Role role) { return kRoleNames[static_cast<int>(role)]; }

std::optional<Role> RoleFromName(std::string_view name) {
  for (int i = 0; i < kNumRoles; ++i) {
    if (name == kRoleNames[i]) return static_cast<Role>(i);
  }
  return std::nullopt;
}

absl::Status SecurityOptions::Validate(bool server) const {
  if (tls_cert.empty() != tls_key.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together: give both or neither");
  }
  if (!server && tls_identity() && tls_ca.empty()) {
    return absl::InvalidArgumentError("--tls_cert without --tls_ca: a client must know the CA of the servers");
  }
  if (server && !tls_ca.empty() && !tls_identity()) {
    return absl::InvalidArgumentError(
        "--tls_ca without --tls_cert/--tls_key: a server checks callers' certificates only when it serves TLS");
  }
  if (!tls_cert.empty()) {
    if (absl::Status s = Readable(tls_cert, "tls_cert"); !s.ok()) return s;
    if (absl::Status s = Readable(tls_key, "tls_key"); !s.ok()) return s;
  }
  if (!tls_ca.empty()) {
    if (absl::Status s = Readable(tls_ca, "tls_ca"); !s.ok()) return s;
  }
  if (!auth_token_file.empty()) {
    if (absl::StatusOr<std::array<std::string, kNumRoles>> t = ReadTokenFile(auth_token_file); !t.ok()) {
      return t.status();
    }
  }
  if (reload_interval < absl::Seconds(1)) {
    return absl::InvalidArgumentError("the certificate reload interval must be at least 1 s");
  }
  return absl::OkStatus();
}

std::string DescribeSecurity(const SecurityOptions& options) {
  std::string text = options.tls_identity() ? "TLS" : "plaintext";
  if (!options.tls_ca.empty()) absl::StrAppend(&text, ", client certificates required");
  if (!options.auth_token_file.empty()) absl::StrAppend(&text, ", tokens required");
  if (options.tls_ca.empty() && options.auth_token_file.empty()) absl::StrAppend(&text, ", no authentication");
  return text;
}

absl::StatusOr<std::array<std::string, kNumRoles>> ReadTokenFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("--auth_token_file=", path, ": cannot read the file"));
  std::stringstream text;
  text << in.rdbuf();
  std::array<std::string, kNumRoles> tokens;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text.str(), '\n')) {
    ++line_number;
    line = line.substr(0, line.find('#'));
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    const std::vector<absl::string_view> fields = absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    const std::string where = absl::StrCat(path, ":", line_number, ": ");
    if (fields.size() != 2) return absl::InvalidArgumentError(absl::StrCat(where, "expected \"ROLE TOKEN\""));
    const std::optional<Role> role = RoleFromName(std::string_view(fields[0].data(), fields[0].size()));
    if (!role) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "unknown role \"", fields[0], "\"; expected server, trainer or reader"));
    }
    std::string& slot = tokens[static_cast<int>(*role)];
    if (!slot.empty()) return absl::InvalidArgumentError(absl::StrCat(where, "role ", fields[0], " is listed twice"));
    if (fields[1].size() < kMinTokenLength) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "the ", fields[0], " token is shorter than ", kMinTokenLength, " characters"));
    }
    for (const std::string& other : tokens) {
      if (other == fields[1]) return absl::InvalidArgumentError(absl::StrCat(where, "two roles share one token"));
    }
    slot = std::string(fields[1]);
  }
  bool any = false;
  for (const std::string& t : tokens) any = any || !t.empty();
  if (!any) return absl::InvalidArgumentError(absl::StrCat("--auth_token_file=", path, ": no tokens in it"));
  return tokens;
}

absl::StatusOr<std::shared_ptr<const ClientSecurity>> ClientSecurity::Create(const SecurityOptions& options,
                                                                             Role role) {
  if (absl::Status s = options.Validate(/*server=*/false); !s.ok()) return s;
  std::shared_ptr<ClientSecurity> security(new ClientSecurity());
  security->role_ = role;
  security->server_name_ = options.tls_server_name;
  if (!options.auth_token_file.empty()) {
    absl::StatusOr<std::array<std::string, kNumRoles>> tokens = ReadTokenFile(options.auth_token_file);
    if (!tokens.ok()) return tokens.status();
    security->token_ = (*tokens)[static_cast<int>(role)];
    if (security->token_.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--auth_token_file=", options.auth_token_file,
                                                     " has no token for the role of this program (",
                                                     RoleName(role), ")"));
    }
  }
  if (options.tls_ca.empty()) {
    security->credentials_ = grpc::InsecureChannelCredentials();
    return security;
  }
  security->tls_ = true;
  const unsigned refresh = RefreshSeconds(options.reload_interval);
  auto provider = options.tls_identity()
                      ? std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
                            options.tls_key, options.tls_cert, options.tls_ca, refresh)
                      : std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(options.tls_ca, refresh);
  grpc::experimental::TlsChannelCredentialsOptions tls;
  tls.set_certificate_provider(provider);
  tls.watch_root_certs();
  if (options.tls_identity()) tls.watch_identity_key_cert_pairs();
  tls.set_verify_server_certs(true);
  // The chain is checked against the CA; this checks the server's name.
  tls.set_certificate_verifier(
      std::make_shared<grpc::experimental::CertificateVerifier>(grpc_tls_certificate_verifier_host_name_create()));
  security->credentials_ = grpc::experimental::TlsCredentials(tls);
  return security;
}

std::shared_ptr<grpc::Channel> ClientSecurity::NewChannel(const std::string& target,
                                                          grpc::ChannelArguments args) const {
  if (!server_name_.empty()) args.SetSslTargetNameOverride(server_name_);
  if (token_.empty()) return grpc::CreateCustomChannel(target, credentials_, args);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<TokenInterceptorFactory>(token_));
  return grpc::experimental::CreateCustomChannelWithInterceptors(target, credentials_, args,
                                                                 std::move(interceptors));
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(const SecurityOptions& options) {
  if (absl::Status s = options.Validate(/*server=*/true); !s.ok()) return s;
  if (!options.tls_identity()) return grpc::InsecureServerCredentials();
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      options.tls_key, options.tls_cert, RefreshSeconds(options.reload_interval));
  grpc::experimental::TlsServerCredentialsOptions tls(provider);
  tls.watch_identity_key_cert_pairs();
  // The handshake asks for a certificate without judging it: each call's
  // caller is then verified, refused and counted with a reason
  // (CallerAuthenticator), and health probes need no certificate.
  tls.set_cert_request_type(GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_BUT_DONT_VERIFY);
  return grpc::experimental::TlsServerCredentials(tls);
}

}  // namespace pshard
