#pragma once
// Credentials of the GCS backend (internal to the storage layer), found as Google's client
// libraries find them (https://cloud.google.com/docs/authentication/application-default-credentials):
// an emulator (STORAGE_EMULATOR_HOST) takes none; else a service-account key file
// (GOOGLE_APPLICATION_CREDENTIALS) signs a JWT that the key's token_uri exchanges for an
// access token (RFC 7523, https://developers.google.com/identity/protocols/oauth2/service-account),
// or gcloud's user credentials there ("type": "authorized_user") renew one with their
// refresh token (RFC 6749 section 6);
// else the metadata server of the machine hands one out. Anonymous requests only when asked
// for (WEIGHTSTREAM_GCS_ANONYMOUS), as google-cloud-cpp's MakeInsecureCredentials().
// Tokens are refreshed 5 minutes before they expire. No secret (private key, assertion,
// token) reaches a message: errors name the key file, the account and the endpoint only.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <mutex>
#include <string>
#include <string_view>

#include "storage/http_client.hpp"
#include "storage/retry_policy.hpp"
#include "weightstream/options.hpp"

namespace weightstream::gcs {

/// The scope of the tokens asked for: reading objects and listing them.
inline constexpr std::string_view kReadOnlyScope = "https://www.googleapis.com/auth/devstorage.read_only";
/// A token is renewed this long before it expires (half its lifetime, if that is shorter).
inline constexpr std::chrono::seconds kRefreshMargin{300};

/// The fields of a service-account key file that sign a token request.
struct ServiceAccount {
  std::string client_email;
  std::string private_key;     ///< PEM; a secret
  std::string private_key_id;  ///< the JWT header's "kid"
  std::string token_uri = "https://oauth2.googleapis.com/token";
  std::string origin;  ///< "/path/key.json (GOOGLE_APPLICATION_CREDENTIALS)", for messages
};

/// Parses a key file's text. Throws Error(kConfig) naming `origin` on malformed JSON, a
/// "type" other than service_account, or a missing client_email or private_key (the
/// values are never quoted).
ServiceAccount parse_service_account(std::string_view json, std::string_view origin);

/// Reads and parses the key file at `path`. Throws Error(kConfig) when it cannot be read.
ServiceAccount read_service_account(const std::string& path);

/// The fields of gcloud's user credentials (what `gcloud auth application-default login`
/// writes, "type": "authorized_user") that renew an access token.
struct AuthorizedUser {
  std::string client_id;
  std::string client_secret;  ///< a secret
  std::string refresh_token;  ///< a secret
  std::string token_uri = "https://oauth2.googleapis.com/token";
  std::string origin;  ///< as ServiceAccount::origin
};

/// Parses an authorized_user file's text. Throws Error(kConfig) naming `origin` on malformed
/// JSON, another "type", or a missing client_id, client_secret or refresh_token.
AuthorizedUser parse_authorized_user(std::string_view json, std::string_view origin);

/// The signed JWT (RS256) that asks token_uri for a token of `scope`: claims iss, scope,
/// aud = token_uri, iat = `now`, exp = `now` + 1 hour. Throws Error(kConfig) naming the key
/// file when its private_key is not a PEM private key that can sign with RS256.
std::string service_account_assertion(const ServiceAccount& account, int64_t now, std::string_view scope);

/// base64url without padding (RFC 7515 section 2), the encoding of a JWT's parts.
std::string base64url(std::string_view bytes);

/// Where bearer tokens come from; thread-safe. One per client.
class TokenSource {
 public:
  enum class Kind { kNone, kServiceAccount, kAuthorizedUser, kMetadataServer };

  /// Picks the source from `options` (reading the key file now, so a bad one fails at open).
  explicit TokenSource(const GcsOptions& options);

  Kind kind() const noexcept { return kind_; }
  /// Where credentials come from, for messages: "service account x@y of /k.json
  /// (GOOGLE_APPLICATION_CREDENTIALS)", "the metadata server http://… (GCE_METADATA_HOST)",
  /// "none (emulator at …)". Never a secret.
  const std::string& description() const noexcept { return description_; }

  /// The Authorization header's value ("Bearer …"), empty for kNone: the cached token, or a
  /// fresh one when it expires within kRefreshMargin. Throws Error(kPermission) when the
  /// token endpoint refuses, Error(kNetwork/kTimeout) when it cannot be reached.
  std::string authorization(storage::HttpClient& http, const storage::RetryPolicy& policy,
                            std::atomic<uint64_t>& retries);

  /// Forgets the cached token (after a 401), so the next request fetches a fresh one.
  void invalidate();

  /// `text` with the private key and every token handed out masked.
  std::string redact(std::string text) const;

  /// `text` with `extra` and every secret of redact() masked, the private key's PEM lines
  /// one by one too (a server may echo part of what it was sent).
  static std::string mask(std::string text, const ServiceAccount& account, std::initializer_list<std::string_view> extra);

  /// Tokens fetched so far (a test of refresh).
  uint64_t tokens_fetched() const noexcept { return fetched_.load(); }

 private:
  Kind kind_ = Kind::kNone;
  std::string description_;
  ServiceAccount account_;
  AuthorizedUser user_;
  std::string metadata_url_;
  mutable std::mutex mutex_;
  std::string token_;
  std::string previous_token_;
  std::chrono::system_clock::time_point expiry_{};
  std::chrono::seconds refresh_margin_ = kRefreshMargin;
  std::atomic<uint64_t> fetched_{0};
};

}  // namespace weightstream::gcs
