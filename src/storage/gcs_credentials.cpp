// Credentials of the GCS backend. Nothing here reads the environment: Google's variables
// arrive already in GcsOptions (src/base/environment.cpp).
#include "storage/gcs_credentials.hpp"

#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "storage/s3_checksum.hpp"
#include "weightstream/error.hpp"

namespace weightstream::gcs {
namespace {

// A key file is a few KiB; refuse anything absurd rather than read it whole.
constexpr uintmax_t kMaxKeyFileBytes = 1 * kMiB;
// Token responses are small; a larger body is not one.
constexpr size_t kMaxTokenResponseBytes = 64 * 1024;
// The lifetime asked of a signed assertion: Google accepts at most one hour.
constexpr int64_t kAssertionSeconds = 3600;

struct BioDeleter {
  void operator()(BIO* bio) const { BIO_free(bio); }
};
struct KeyDeleter {
  void operator()(EVP_PKEY* key) const { EVP_PKEY_free(key); }
};
struct DigestContextDeleter {
  void operator()(EVP_MD_CTX* context) const { EVP_MD_CTX_free(context); }
};

std::string json_string(const nlohmann::json& document, const char* field) {
  auto it = document.find(field);
  return it != document.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// Text a server sent, cut short and kept printable, for messages.
std::string clip(std::string_view text, size_t limit = 200) {
  std::string out;
  for (char c : text.substr(0, limit)) out += (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) ? ' ' : c;
  return out;
}

}  // namespace

std::string base64url(std::string_view bytes) {
  std::string text = s3::base64_encode(bytes);
  while (!text.empty() && text.back() == '=') text.pop_back();
  for (char& c : text) {
    if (c == '+') c = '-';
    else if (c == '/') c = '_';
  }
  return text;
}

ServiceAccount parse_service_account(std::string_view json, std::string_view origin) {
  nlohmann::json document = nlohmann::json::parse(json, nullptr, false);
  // The parser's message may quote the text, which holds the private key: not repeated.
  WS_EXPECT(!document.is_discarded() && document.is_object(), ErrorCode::kConfig,
            "the credentials file " + std::string(origin) + " is not a JSON object (expected a service-account key)");
  const std::string type = json_string(document, "type");
  WS_EXPECT(type == "service_account", ErrorCode::kConfig,
            "the credentials file " + std::string(origin) + " has type '" + clip(type, 40) +
                "'; gs:// reads with a service-account key (type service_account), gcloud's user credentials "
                "(type authorized_user), the metadata server, or WEIGHTSTREAM_GCS_ANONYMOUS=1");
  ServiceAccount account;
  account.origin = std::string(origin);
  account.client_email = json_string(document, "client_email");
  account.private_key = json_string(document, "private_key");
  account.private_key_id = json_string(document, "private_key_id");
  if (auto uri = json_string(document, "token_uri"); !uri.empty()) account.token_uri = uri;
  WS_EXPECT(!account.client_email.empty(), ErrorCode::kConfig,
            "the credentials file " + std::string(origin) + " has no client_email");
  WS_EXPECT(!account.private_key.empty(), ErrorCode::kConfig,
            "the credentials file " + std::string(origin) + " has no private_key");
  WS_EXPECT(account.token_uri.starts_with("https://") || account.token_uri.starts_with("http://"), ErrorCode::kConfig,
            "the credentials file " + std::string(origin) + " has a token_uri that is not an http(s) URL");
  return account;
}

AuthorizedUser parse_authorized_user(std::string_view json, std::string_view origin) {
  nlohmann::json document = nlohmann::json::parse(json, nullptr, false);
  WS_EXPECT(!document.is_discarded() && document.is_object() && json_string(document, "type") == "authorized_user",
            ErrorCode::kConfig, "the credentials file " + std::string(origin) + " is not gcloud's user credentials");
  AuthorizedUser user;
  user.origin = std::string(origin);
  user.client_id = json_string(document, "client_id");
  user.client_secret = json_string(document, "client_secret");
  user.refresh_token = json_string(document, "refresh_token");
  if (auto uri = json_string(document, "token_uri"); !uri.empty()) user.token_uri = uri;
  for (auto [field, value] : {std::pair{"client_id", &user.client_id}, std::pair{"client_secret", &user.client_secret},
                              std::pair{"refresh_token", &user.refresh_token}}) {
    WS_EXPECT(!value->empty(), ErrorCode::kConfig,
              "the credentials file " + std::string(origin) + " (authorized_user) has no " + field);
  }
  WS_EXPECT(user.token_uri.starts_with("https://") || user.token_uri.starts_with("http://"), ErrorCode::kConfig,
            "the credentials file " + std::string(origin) + " has a token_uri that is not an http(s) URL");
  return user;
}

namespace {

// The text of the credentials file at `path`, bounded.
std::string read_credentials_text(const std::string& path, const std::string& origin) {
  std::error_code error;
  auto size = std::filesystem::file_size(path, error);
  WS_EXPECT(!error, ErrorCode::kConfig, "cannot read the credentials file " + origin + ": " + error.message());
  WS_EXPECT(size <= kMaxKeyFileBytes, ErrorCode::kConfig,
            "the credentials file " + origin + " is " + std::to_string(size) + " bytes, too large for a key file");
  std::ifstream file(path, std::ios::binary);
  std::ostringstream text;
  text << file.rdbuf();
  WS_EXPECT(file.good() || file.eof(), ErrorCode::kConfig, "cannot read the credentials file " + origin);
  return text.str();
}

// The "type" of a credentials file's JSON, or empty when it is not JSON with one.
std::string credentials_type(std::string_view json) {
  nlohmann::json document = nlohmann::json::parse(json, nullptr, false);
  return document.is_object() ? json_string(document, "type") : std::string();
}

// The failure of a token request the endpoint answered with a status other than 2xx: its
// error and description (masked), retryable for 5xx, 429 and 408, else a permission error with
// what to check for this kind of credentials.
storage::AttemptFailure token_refusal(const storage::HttpResponse& response, const nlohmann::json& document,
                                      TokenSource::Kind kind, const std::function<std::string(std::string)>& redact) {
  std::string cause = "HTTP " + std::to_string(response.status);
  if (document.is_object()) {
    std::string error = json_string(document, "error");
    std::string description = json_string(document, "error_description");
    if (!error.empty()) cause += " " + clip(redact(error), 80);
    if (!description.empty()) cause += ": " + clip(redact(description));
  } else if (!response.body.empty()) {
    cause += ": " + clip(redact(response.body), 120);
  }
  const long status = response.status;
  storage::AttemptFailure failure(cause, status >= 500 || status == 429 || status == 408);
  if (!failure.retryable) {
    failure.code = ErrorCode::kPermission;
    failure.advice = kind == TokenSource::Kind::kServiceAccount
                         ? "the token endpoint refused the service account's key: check that the key file is "
                           "current (not deleted or disabled) and names the right account"
                     : kind == TokenSource::Kind::kAuthorizedUser
                         ? "the token endpoint refused the refresh token: run `gcloud auth application-default "
                           "login` again"
                         : "the metadata server refused: check the machine's service account";
  }
  return failure;
}

}  // namespace

ServiceAccount read_service_account(const std::string& path) {
  const std::string origin = path + " (GOOGLE_APPLICATION_CREDENTIALS)";
  return parse_service_account(read_credentials_text(path, origin), origin);
}

std::string service_account_assertion(const ServiceAccount& account, int64_t now, std::string_view scope) {
  nlohmann::json header = {{"alg", "RS256"}, {"typ", "JWT"}};
  if (!account.private_key_id.empty()) header["kid"] = account.private_key_id;
  nlohmann::json claims = {{"iss", account.client_email},
                           {"scope", std::string(scope)},
                           {"aud", account.token_uri},
                           {"iat", now},
                           {"exp", now + kAssertionSeconds}};
  const std::string signing_input = base64url(header.dump()) + "." + base64url(claims.dump());

  const std::string bad_key = "the private_key of the credentials file " + account.origin +
                              " is not a PEM private key that can sign RS256";
  std::unique_ptr<BIO, BioDeleter> bio(
      BIO_new_mem_buf(account.private_key.data(), static_cast<int>(account.private_key.size())));
  WS_EXPECT(bio != nullptr, ErrorCode::kInternal, "BIO_new_mem_buf failed");
  std::unique_ptr<EVP_PKEY, KeyDeleter> key(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
  WS_EXPECT(key != nullptr, ErrorCode::kConfig, bad_key);
  WS_EXPECT(EVP_PKEY_base_id(key.get()) == EVP_PKEY_RSA, ErrorCode::kConfig, bad_key + " (it is not an RSA key)");
  std::unique_ptr<EVP_MD_CTX, DigestContextDeleter> context(EVP_MD_CTX_new());
  WS_EXPECT(context != nullptr, ErrorCode::kInternal, "EVP_MD_CTX_new failed");
  size_t length = 0;
  bool signed_ok =
      EVP_DigestSignInit(context.get(), nullptr, EVP_sha256(), nullptr, key.get()) == 1 &&
      EVP_DigestSign(context.get(), nullptr, &length, reinterpret_cast<const unsigned char*>(signing_input.data()),
                     signing_input.size()) == 1;
  std::string signature(length, '\0');
  signed_ok = signed_ok && EVP_DigestSign(context.get(), reinterpret_cast<unsigned char*>(signature.data()), &length,
                                          reinterpret_cast<const unsigned char*>(signing_input.data()),
                                          signing_input.size()) == 1;
  WS_EXPECT(signed_ok, ErrorCode::kConfig, bad_key + " (signing failed)");
  signature.resize(length);
  return signing_input + "." + base64url(signature);
}

TokenSource::TokenSource(const GcsOptions& options) {
  if (!options.emulator_host.empty()) {
    description_ = "none (the emulator at " + storage::redact_userinfo(options.emulator_host) + ", STORAGE_EMULATOR_HOST)";
    return;
  }
  if (options.anonymous) {
    description_ = "none (anonymous requests, WEIGHTSTREAM_GCS_ANONYMOUS)";
    return;
  }
  if (!options.credentials_file.empty()) {
    const std::string origin = options.credentials_file + " (GOOGLE_APPLICATION_CREDENTIALS)";
    const std::string text = read_credentials_text(options.credentials_file, origin);
    if (credentials_type(text) == "authorized_user") {
      kind_ = Kind::kAuthorizedUser;
      user_ = parse_authorized_user(text, origin);
      description_ = "gcloud's user credentials (client " + clip(user_.client_id, 100) + ") of " + origin;
      return;
    }
    kind_ = Kind::kServiceAccount;
    account_ = parse_service_account(text, origin);
    description_ = "service account " + clip(account_.client_email, 120) + " of " + account_.origin;
    return;
  }
  kind_ = Kind::kMetadataServer;
  std::string host = options.metadata_host.empty() ? std::string("metadata.google.internal") : options.metadata_host;
  if (!host.starts_with("http://") && !host.starts_with("https://")) host = "http://" + host;
  while (host.ends_with('/')) host.pop_back();
  metadata_url_ = host + "/computeMetadata/v1/instance/service-accounts/default/token";
  description_ = "the metadata server " + storage::redact_userinfo(host) + " (GCE_METADATA_HOST; no GOOGLE_APPLICATION_CREDENTIALS)";
}

void TokenSource::invalidate() {
  std::lock_guard lock(mutex_);
  if (!token_.empty()) previous_token_ = token_;
  token_.clear();
}

std::string TokenSource::mask(std::string text, const ServiceAccount& account,
                              std::initializer_list<std::string_view> extra) {
  text = storage::mask_secrets(std::move(text), extra);
  text = storage::mask_secrets(std::move(text), {account.private_key});
  // Each line of the key's base64 body on its own: 64 characters no message has by chance.
  std::string_view key = account.private_key;
  for (size_t start = 0; start < key.size();) {
    size_t end = key.find('\n', start);
    if (end == std::string_view::npos) end = key.size();
    std::string_view line = key.substr(start, end - start);
    if (line.size() >= 16 && !line.starts_with("-----")) text = storage::mask_secrets(std::move(text), {line});
    start = end + 1;
  }
  return text;
}

std::string TokenSource::redact(std::string text) const {
  std::lock_guard lock(mutex_);
  return mask(std::move(text), account_, {token_, previous_token_, user_.client_secret, user_.refresh_token});
}

std::string TokenSource::authorization(storage::HttpClient& http, const storage::RetryPolicy& policy,
                                       std::atomic<uint64_t>& retries) {
  if (kind_ == Kind::kNone) return {};
  std::lock_guard lock(mutex_);
  const auto now = std::chrono::system_clock::now();
  if (!token_.empty() && now + refresh_margin_ < expiry_) return "Bearer " + token_;

  storage::HttpRequest base;
  std::string form;
  std::string assertion;
  std::string operation;
  storage::RetryPolicy token_policy = policy;
  if (kind_ == Kind::kServiceAccount) {
    const int64_t seconds = std::chrono::duration_cast<std::chrono::seconds>(now.time_since_epoch()).count();
    assertion = service_account_assertion(account_, seconds, kReadOnlyScope);
    form = "grant_type=" + storage::uri_encode("urn:ietf:params:oauth:grant-type:jwt-bearer", false) +
           "&assertion=" + assertion;
    base.method = "POST";
    base.url = account_.token_uri;
    base.headers.emplace_back("Content-Type", "application/x-www-form-urlencoded");
    operation = "cannot get an access token for " + description_ + " from " + storage::redact_userinfo(account_.token_uri);
  } else if (kind_ == Kind::kAuthorizedUser) {
    form = "grant_type=refresh_token&client_id=" + storage::uri_encode(user_.client_id, false) +
           "&client_secret=" + storage::uri_encode(user_.client_secret, false) +
           "&refresh_token=" + storage::uri_encode(user_.refresh_token, false);
    base.method = "POST";
    base.url = user_.token_uri;
    base.headers.emplace_back("Content-Type", "application/x-www-form-urlencoded");
    operation = "cannot get an access token for " + description_ + " from " + storage::redact_userinfo(user_.token_uri);
  } else {
    base.url = metadata_url_;
    base.headers.emplace_back("Metadata-Flavor", "Google");
    operation = "cannot get an access token from " + description_;
    // Off Google Cloud there is no metadata server: a few quick tries, not a long wait.
    token_policy.max_attempts = std::min(policy.max_attempts, 3u);
  }
  base.max_body_bytes = kMaxTokenResponseBytes;
  // The assertion is as good as a token for its hour: masked like one.
  auto redact_all = [&](std::string text) {
    return mask(std::move(text), account_,
                {form, assertion, token_, previous_token_, user_.client_secret, user_.refresh_token,
                 storage::uri_encode(user_.client_secret, false), storage::uri_encode(user_.refresh_token, false)});
  };
  std::string token;
  int64_t expires_in = 0;
  storage::with_retries(token_policy, operation, [&](double remaining) -> std::optional<storage::AttemptFailure> {
    storage::HttpRequest request = base;
    request.upload = form;
    request.timeout_seconds = remaining;
    auto response = http.perform(request);
    if (response.transport_error != 0) {
      auto failure = storage::transport_failure(response, "the system CA store");
      if (kind_ == Kind::kMetadataServer) {
        failure.code = ErrorCode::kPermission;
        failure.advice = "no credentials for gs://: off Google Cloud there is no metadata server; set "
                         "GOOGLE_APPLICATION_CREDENTIALS to a service-account key file, STORAGE_EMULATOR_HOST for an "
                         "emulator, or WEIGHTSTREAM_GCS_ANONYMOUS=1 for a public bucket";
      }
      return failure;
    }
    nlohmann::json document = nlohmann::json::parse(response.body, nullptr, false);
    if (response.status < 200 || response.status >= 300) return token_refusal(response, document, kind_, redact_all);
    if (!document.is_object() || json_string(document, "access_token").empty() ||
        !document.contains("expires_in") || !document["expires_in"].is_number_integer()) {
      return storage::AttemptFailure{"the token response is not JSON with access_token and expires_in", true};
    }
    token = json_string(document, "access_token");
    expires_in = document["expires_in"].get<int64_t>();
    return std::nullopt;
  }, retries, redact_all);
  if (!token_.empty()) previous_token_ = token_;
  token_ = std::move(token);
  expiry_ = now + std::chrono::seconds(std::max<int64_t>(expires_in, 0));
  // A token that lives less than twice the margin is renewed at half its life instead, so a
  // short-lived one is not fetched anew for every request.
  refresh_margin_ = std::min<std::chrono::seconds>(kRefreshMargin, std::chrono::seconds(std::max<int64_t>(expires_in, 0) / 2));
  ++fetched_;
  return "Bearer " + token_;
}

}  // namespace weightstream::gcs
