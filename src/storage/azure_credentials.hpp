#pragma once
// Endpoint and credentials of the Azure Blob backend (internal to the storage layer), found as
// Azure's tools find them: AZURE_STORAGE_CONNECTION_STRING (its account key, its SAS, its
// BlobEndpoint for an emulator, or UseDevelopmentStorage=true), else AZURE_STORAGE_KEY (Shared
// Key), else AZURE_STORAGE_SAS_TOKEN, else the machine's managed identity: App Service's
// IDENTITY_ENDPOINT with its IDENTITY_HEADER, or the instance metadata service (IMDS)
// (https://learn.microsoft.com/entra/identity/managed-identities-azure-resources/how-to-use-vm-token).
// Anonymous requests only when asked for (WEIGHTSTREAM_AZURE_ANONYMOUS). Tokens are renewed
// 5 minutes before they expire. No secret (key, SAS signature, identity header, token)
// reaches a message: errors name the variable, the account and the endpoint only.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "storage/azure_signer.hpp"
#include "storage/http_client.hpp"
#include "storage/retry_policy.hpp"
#include "weightstream/options.hpp"

namespace weightstream::azure {

/// The storage emulator's well-known account and key (public, the same in every emulator),
/// and its Blob endpoint: what UseDevelopmentStorage=true means.
/// https://learn.microsoft.com/azure/storage/common/storage-use-azurite#connection-strings
inline constexpr std::string_view kDevelopmentAccount = "devstoreaccount1";
inline constexpr std::string_view kDevelopmentKey =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";
inline constexpr std::string_view kDevelopmentBlobEndpoint = "http://127.0.0.1:10000/devstoreaccount1";
/// The resource managed-identity tokens are asked for: Azure Storage.
inline constexpr std::string_view kStorageResource = "https://storage.azure.com/";
/// A token is renewed this long before it expires (half its lifetime, if that is shorter).
inline constexpr std::chrono::seconds kRefreshMargin{300};

/// The fields of a connection string that the Blob service uses
/// (https://learn.microsoft.com/azure/storage/common/storage-configure-connection-string).
struct ConnectionString {
  std::string protocol = "https";  ///< DefaultEndpointsProtocol
  std::string account;             ///< AccountName
  std::string key;                 ///< AccountKey; a secret
  std::string sas;                 ///< SharedAccessSignature; a secret
  std::string blob_endpoint;       ///< BlobEndpoint, without a trailing '/'
  std::string endpoint_suffix = "core.windows.net";  ///< EndpointSuffix
  bool development = false;        ///< UseDevelopmentStorage=true
};

/// Parses AZURE_STORAGE_CONNECTION_STRING's text ("Name=value;…", names in any case; other
/// services' endpoints are ignored). Throws Error(kConfig) on a part without '=' or with a
/// name no connection string has, a
/// DefaultEndpointsProtocol other than http or https, a BlobEndpoint that is not an http(s)
/// URL, or a string that gives neither an account nor a BlobEndpoint. Messages quote names,
/// never values.
ConnectionString parse_connection_string(std::string_view text);

/// A SAS token without its leading '?'. Throws Error(kConfig) naming `origin` when it has no
/// sig= (not a SAS token) or holds characters a query string cannot.
std::string normalize_sas(std::string_view token, std::string_view origin);

/// Whether `account` follows Azure's rules: 3-24 characters of a-z and 0-9.
bool valid_account_name(std::string_view account);
/// Whether `container` follows Azure's rules: 3-63 characters of a-z, 0-9 and '-', starting
/// with a letter or digit, no "--", not ending in '-'; or "$root".
bool valid_container_name(std::string_view container);

/// Where requests go and how they are authorized; thread-safe. One per client.
class Credentials {
 public:
  enum class Kind { kNone, kSharedKey, kSas, kManagedIdentity };

  /// Picks the endpoint and the credentials for `account` from `options` (`uri_endpoint`:
  /// the https URL form's endpoint, or empty). Throws Error(kConfig) for a malformed
  /// connection string, key or SAS token, or for credentials of another account.
  Credentials(std::string_view account, std::string_view uri_endpoint, const AzureOptions& options);

  Kind kind() const noexcept { return kind_; }
  const std::string& account() const noexcept { return account_; }
  /// "https://account.blob.core.windows.net", or an emulator's "http://127.0.0.1:10000/devstoreaccount1".
  const std::string& endpoint() const noexcept { return endpoint_; }
  /// The path of the endpoint ("" or "/devstoreaccount1"), which every request path starts with.
  const std::string& endpoint_path() const noexcept { return endpoint_path_; }
  /// Where the credentials come from, for messages ("the account key of AZURE_STORAGE_KEY",
  /// "the managed identity (IMDS at http://…)"). Never a secret.
  const std::string& description() const noexcept { return description_; }
  /// The SAS token appended to every request's query (kSas), else empty.
  const std::string& sas() const noexcept { return sas_; }

  /// The Authorization header's value for `input` (whose headers hold x-ms-date and
  /// x-ms-version): "SharedKey account:…" (kSharedKey), "Bearer …" (kManagedIdentity, the
  /// cached token or a fresh one near its expiry), empty otherwise. Throws
  /// Error(kPermission) when the identity endpoint refuses, Error(kNetwork/kTimeout) when it
  /// cannot be reached.
  std::string authorization(const SharedKeyInput& input, storage::HttpClient& http,
                            const storage::RetryPolicy& policy, std::atomic<uint64_t>& retries);

  /// Forgets the cached token (after a 401), so the next request fetches a fresh one.
  void invalidate();

  /// `text` with the key, the SAS token and its signature, the identity header and every
  /// token handed out masked.
  std::string redact(std::string text) const;

  /// Tokens fetched so far (a test of renewal).
  uint64_t tokens_fetched() const noexcept { return fetched_.load(); }

 private:
  std::string fetch_token(storage::HttpClient& http, const storage::RetryPolicy& policy,
                          std::atomic<uint64_t>& retries, std::chrono::system_clock::time_point now);

  Kind kind_ = Kind::kNone;
  std::string account_;
  std::string endpoint_;
  std::string endpoint_path_;
  std::string description_;
  std::string key_;          ///< base64, as given
  std::string decoded_key_;  ///< the HMAC key
  std::string sas_;
  std::string connection_string_;
  std::string token_url_;
  std::vector<storage::Field> token_headers_;
  std::vector<std::string> secrets_;  ///< fixed secrets to mask (SAS signature forms, identity header)
  mutable std::mutex mutex_;
  std::string token_;
  std::string previous_token_;
  std::chrono::system_clock::time_point expiry_{};
  std::chrono::seconds refresh_margin_ = kRefreshMargin;
  std::atomic<uint64_t> fetched_{0};
};

}  // namespace weightstream::azure
