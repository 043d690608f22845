// Endpoint and credentials of the Azure Blob backend. Nothing here reads the environment:
// Azure's variables arrive already in AzureOptions (src/base/environment.cpp).
#include "storage/azure_credentials.hpp"

#include <algorithm>
#include <cctype>
#include <nlohmann/json.hpp>

#include "storage/s3_checksum.hpp"
#include "weightstream/error.hpp"

namespace weightstream::azure {
namespace {

// Token responses are small; a larger body is not one.
constexpr size_t kMaxTokenResponseBytes = 64 * 1024;

std::string lowercase(std::string_view text) {
  std::string out(text);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

std::string_view trim(std::string_view text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) text.remove_prefix(1);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.remove_suffix(1);
  return text;
}

// Text a server sent, cut short and kept printable, for messages.
std::string clip(std::string_view text, size_t limit = 200) {
  std::string out;
  for (char c : text.substr(0, limit)) out += (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) ? ' ' : c;
  if (text.size() > limit) out += "…";
  return out;
}

std::string percent_decode(std::string_view text) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '%' && i + 2 < text.size() && hex(text[i + 1]) >= 0 && hex(text[i + 2]) >= 0) {
      out += static_cast<char>(hex(text[i + 1]) * 16 + hex(text[i + 2]));
      i += 2;
    } else {
      out += text[i] == '+' ? ' ' : text[i];
    }
  }
  return out;
}

bool is_http_url(std::string_view url) {
  std::string lower = lowercase(url);
  const size_t start = lower.starts_with("http://") ? 7 : lower.starts_with("https://") ? 8 : 0;
  return start > 0 && url.size() > start && url.find_first_of("?#@ ", start) == std::string_view::npos;
}

std::string without_trailing_slash(std::string text) {
  while (text.ends_with('/')) text.pop_back();
  return text;
}

// The value of a JSON field that Azure's token endpoints send as a number or a decimal string.
std::optional<int64_t> json_seconds(const nlohmann::json& document, const char* field) {
  auto it = document.find(field);
  if (it == document.end()) return std::nullopt;
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_string()) {
    if (auto value = storage::parse_u64(it->get<std::string>()); value && *value < (uint64_t{1} << 62))
      return static_cast<int64_t>(*value);
  }
  return std::nullopt;
}

std::string json_string(const nlohmann::json& document, const char* field) {
  auto it = document.find(field);
  return it != document.end() && it->is_string() ? it->get<std::string>() : std::string();
}

}  // namespace

ConnectionString parse_connection_string(std::string_view text) {
  ConnectionString parsed;
  bool any_endpoint_part = false;
  size_t part_number = 0;
  for (size_t start = 0; start <= text.size();) {
    size_t end = text.find(';', start);
    if (end == std::string_view::npos) end = text.size();
    std::string_view part = trim(text.substr(start, end - start));
    start = end + 1;
    ++part_number;
    if (part.empty()) continue;  // "a=b;" ends with an empty part
    const size_t equals = part.find('=');
    // The value may hold the key: only the part's position is named.
    WS_EXPECT(equals != std::string_view::npos && equals > 0, ErrorCode::kConfig,
              "AZURE_STORAGE_CONNECTION_STRING: part " + std::to_string(part_number) +
                  " is not Name=value (expected e.g. AccountName=…;AccountKey=…)");
    const std::string name = lowercase(trim(part.substr(0, equals)));
    const std::string value(trim(part.substr(equals + 1)));
    if (name == "defaultendpointsprotocol") {
      parsed.protocol = lowercase(value);
      WS_EXPECT(parsed.protocol == "http" || parsed.protocol == "https", ErrorCode::kConfig,
                "AZURE_STORAGE_CONNECTION_STRING: DefaultEndpointsProtocol is '" + clip(value, 20) +
                    "', not http or https");
    } else if (name == "accountname") {
      parsed.account = value;
    } else if (name == "accountkey") {
      parsed.key = value;
    } else if (name == "sharedaccesssignature") {
      parsed.sas = value;
    } else if (name == "blobendpoint") {
      WS_EXPECT(is_http_url(value), ErrorCode::kConfig,
                "AZURE_STORAGE_CONNECTION_STRING: BlobEndpoint is not an http(s) URL without query or userinfo");
      parsed.blob_endpoint = without_trailing_slash(value);
      any_endpoint_part = true;
    } else if (name == "endpointsuffix") {
      parsed.endpoint_suffix = value;
    } else if (name == "usedevelopmentstorage") {
      parsed.development = lowercase(value) == "true";
    } else {
      // Other services' settings are fine; anything else is a mistake (an AccountKey whose
      // name was lost reads as a "name" of key material: it is not quoted).
      static constexpr std::string_view kOtherServices[] = {
          "queueendpoint", "tableendpoint", "fileendpoint", "dfsendpoint", "blobsecondaryendpoint",
          "queuesecondaryendpoint", "tablesecondaryendpoint", "filesecondaryendpoint", "developmentstorageproxyuri"};
      WS_EXPECT(std::find(std::begin(kOtherServices), std::end(kOtherServices), name) != std::end(kOtherServices),
                ErrorCode::kConfig,
                "AZURE_STORAGE_CONNECTION_STRING: part " + std::to_string(part_number) +
                    " is not a setting of a connection string (expected DefaultEndpointsProtocol, AccountName, "
                    "AccountKey, SharedAccessSignature, BlobEndpoint, EndpointSuffix or UseDevelopmentStorage)");
    }
  }
  if (parsed.development) {
    if (parsed.account.empty()) parsed.account = std::string(kDevelopmentAccount);
    if (parsed.key.empty() && parsed.sas.empty()) parsed.key = std::string(kDevelopmentKey);
    if (parsed.blob_endpoint.empty()) parsed.blob_endpoint = std::string(kDevelopmentBlobEndpoint);
    any_endpoint_part = true;
  }
  WS_EXPECT(!parsed.account.empty() || any_endpoint_part, ErrorCode::kConfig,
            "AZURE_STORAGE_CONNECTION_STRING names neither an AccountName nor a BlobEndpoint");
  WS_EXPECT(parsed.key.empty() || !parsed.account.empty(), ErrorCode::kConfig,
            "AZURE_STORAGE_CONNECTION_STRING has an AccountKey but no AccountName to sign with");
  return parsed;
}

std::string normalize_sas(std::string_view token, std::string_view origin) {
  token = trim(token);
  if (token.starts_with('?')) token.remove_prefix(1);
  const std::string text(token);
  WS_EXPECT(text.starts_with("sig=") || text.find("&sig=") != std::string::npos, ErrorCode::kConfig,
            std::string(origin) + " is not a SAS token: it has no sig= parameter");
  WS_EXPECT(std::none_of(text.begin(), text.end(),
                         [](unsigned char c) { return c <= 0x20 || c >= 0x7f || c == '#' || c == '?'; }),
            ErrorCode::kConfig, std::string(origin) + " holds characters a query string cannot (spaces, '#', '?')");
  return text;
}

bool valid_account_name(std::string_view account) {
  return account.size() >= 3 && account.size() <= 24 &&
         std::all_of(account.begin(), account.end(), [](char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'); });
}

bool valid_container_name(std::string_view container) {
  if (container == "$root") return true;
  auto alphanumeric = [](char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'); };
  return container.size() >= 3 && container.size() <= 63 && alphanumeric(container.front()) &&
         alphanumeric(container.back()) && container.find("--") == std::string_view::npos &&
         std::all_of(container.begin(), container.end(), [&](char c) { return alphanumeric(c) || c == '-'; });
}

Credentials::Credentials(std::string_view account, std::string_view uri_endpoint, const AzureOptions& options)
    : account_(account) {
  std::string key_origin;
  if (!options.connection_string.empty()) {
    connection_string_ = options.connection_string;
    ConnectionString parsed = parse_connection_string(options.connection_string);
    WS_EXPECT(parsed.account.empty() || parsed.account == account_, ErrorCode::kConfig,
              "AZURE_STORAGE_CONNECTION_STRING is for account '" + clip(parsed.account, 40) + "', not '" + account_ +
                  "' of the URI: its key or SAS would not be accepted there");
    if (!parsed.blob_endpoint.empty()) {
      endpoint_ = parsed.blob_endpoint;
    } else {
      endpoint_ = parsed.protocol + "://" + account_ + ".blob." + parsed.endpoint_suffix;
    }
    if (!parsed.key.empty()) {
      kind_ = Kind::kSharedKey;
      key_ = parsed.key;
      key_origin = "AccountKey of AZURE_STORAGE_CONNECTION_STRING";
      description_ = parsed.development ? "the storage emulator's well-known key (UseDevelopmentStorage=true)"
                                        : "the account key of AZURE_STORAGE_CONNECTION_STRING";
    } else if (!parsed.sas.empty()) {
      kind_ = Kind::kSas;
      sas_ = normalize_sas(parsed.sas, "SharedAccessSignature of AZURE_STORAGE_CONNECTION_STRING");
      description_ = "the SAS token of AZURE_STORAGE_CONNECTION_STRING";
    } else {
      description_ = "none (AZURE_STORAGE_CONNECTION_STRING has neither AccountKey nor SharedAccessSignature)";
    }
  } else {
    endpoint_ = uri_endpoint.empty() ? "https://" + account_ + ".blob.core.windows.net" : std::string(uri_endpoint);
    const bool other_account = !options.account.empty() && options.account != account_;
    if (!options.account_key.empty()) {
      WS_EXPECT(!other_account, ErrorCode::kConfig,
                "AZURE_STORAGE_KEY is the key of account '" + clip(options.account, 40) +
                    "' (AZURE_STORAGE_ACCOUNT), not of '" + account_ + "' of the URI");
      kind_ = Kind::kSharedKey;
      key_ = options.account_key;
      key_origin = "AZURE_STORAGE_KEY";
      description_ = "the account key of AZURE_STORAGE_KEY";
    } else if (!options.sas_token.empty()) {
      WS_EXPECT(!other_account, ErrorCode::kConfig,
                "AZURE_STORAGE_SAS_TOKEN is a token of account '" + clip(options.account, 40) +
                    "' (AZURE_STORAGE_ACCOUNT), not of '" + account_ + "' of the URI");
      kind_ = Kind::kSas;
      sas_ = normalize_sas(options.sas_token, "AZURE_STORAGE_SAS_TOKEN");
      description_ = "the SAS token of AZURE_STORAGE_SAS_TOKEN";
    } else if (options.anonymous) {
      description_ = "none (anonymous requests, WEIGHTSTREAM_AZURE_ANONYMOUS)";
    } else {
      kind_ = Kind::kManagedIdentity;
      std::vector<storage::Field> query;
      if (!options.identity_endpoint.empty() && !options.identity_header.empty()) {
        // App Service and Azure Functions (https://learn.microsoft.com/azure/app-service/overview-managed-identity#rest-endpoint-reference).
        query = {{"api-version", "2019-08-01"}, {"resource", std::string(kStorageResource)}};
        token_url_ = options.identity_endpoint;
        token_headers_ = {{"X-IDENTITY-HEADER", options.identity_header}};
        secrets_.push_back(options.identity_header);
        description_ = "the managed identity of App Service (IDENTITY_ENDPOINT " +
                       storage::redact_userinfo(options.identity_endpoint) + ")";
      } else {
        std::string host = options.imds_host;
        if (!host.starts_with("http://") && !host.starts_with("https://")) host = "http://" + host;
        host = without_trailing_slash(host);
        query = {{"api-version", "2018-02-01"}, {"resource", std::string(kStorageResource)}};
        token_url_ = host + "/metadata/identity/oauth2/token";
        token_headers_ = {{"Metadata", "true"}};
        description_ = "the managed identity of the machine (IMDS at " + storage::redact_userinfo(host) + ")";
      }
      if (!options.client_id.empty()) {
        query.emplace_back("client_id", options.client_id);
        description_ += " with client id " + clip(options.client_id, 60) + " (AZURE_CLIENT_ID)";
      }
      token_url_ += (token_url_.find('?') == std::string::npos ? "?" : "&") + storage::query_string(query);
    }
  }
  endpoint_ = without_trailing_slash(endpoint_);
  const size_t authority = endpoint_.find("://") + 3;
  const size_t path = endpoint_.find('/', authority);
  endpoint_path_ = path == std::string::npos ? std::string() : endpoint_.substr(path);
  WS_EXPECT(endpoint_.size() > authority && endpoint_.find_first_of("?#@ ", authority) == std::string::npos,
            ErrorCode::kConfig, "the Blob endpoint '" + storage::redact_userinfo(endpoint_) + "' has no usable host");
  if (kind_ == Kind::kSharedKey) {
    auto decoded = s3::base64_decode(key_);
    WS_EXPECT(decoded && !decoded->empty(), ErrorCode::kConfig,
              "the " + key_origin + " is not base64 (an account key is the 88 characters the portal shows)");
    decoded_key_ = std::move(*decoded);
  }
  if (kind_ == Kind::kSas) {
    // The signature as sent (percent-encoded) and as a server may echo it (decoded).
    for (size_t at = 0; at < sas_.size();) {
      size_t end = sas_.find('&', at);
      if (end == std::string::npos) end = sas_.size();
      std::string_view part = std::string_view(sas_).substr(at, end - at);
      if (part.starts_with("sig=") && part.size() > 4) {
        secrets_.emplace_back(part.substr(4));
        secrets_.push_back(percent_decode(part.substr(4)));
      }
      at = end + 1;
    }
  }
}

void Credentials::invalidate() {
  std::lock_guard lock(mutex_);
  if (!token_.empty()) previous_token_ = token_;
  token_.clear();
}

std::string Credentials::redact(std::string text) const {
  text = storage::mask_secrets(std::move(text), {connection_string_, key_, sas_});
  for (const auto& secret : secrets_) text = storage::mask_secrets(std::move(text), {secret});
  std::lock_guard lock(mutex_);
  return storage::mask_secrets(std::move(text), {token_, previous_token_});
}

std::string Credentials::authorization(const SharedKeyInput& input, storage::HttpClient& http,
                                       const storage::RetryPolicy& policy, std::atomic<uint64_t>& retries) {
  switch (kind_) {
    case Kind::kNone:
    case Kind::kSas:
      return {};
    case Kind::kSharedKey:
      return shared_key_authorization(account_, decoded_key_, input);
    case Kind::kManagedIdentity:
      break;
  }
  std::lock_guard lock(mutex_);
  const auto now = std::chrono::system_clock::now();
  if (token_.empty() || now + refresh_margin_ >= expiry_) return "Bearer " + fetch_token(http, policy, retries, now);
  return "Bearer " + token_;
}

std::string Credentials::fetch_token(storage::HttpClient& http, const storage::RetryPolicy& policy,
                                     std::atomic<uint64_t>& retries, std::chrono::system_clock::time_point now) {
  storage::RetryPolicy token_policy = policy;
  // Off Azure there is no identity endpoint: a few quick tries, not a long wait.
  token_policy.max_attempts = std::min(policy.max_attempts, 3u);
  auto redact_all = [&](std::string text) {
    text = storage::mask_secrets(std::move(text), {token_, previous_token_});
    for (const auto& secret : secrets_) text = storage::mask_secrets(std::move(text), {secret});
    return text;
  };
  std::string token;
  int64_t lifetime = 0;
  storage::with_retries(token_policy, "cannot get an access token from " + description_,
                        [&](double remaining) -> std::optional<storage::AttemptFailure> {
    storage::HttpRequest request;
    request.url = token_url_;
    request.headers = token_headers_;
    request.timeout_seconds = remaining;
    request.max_body_bytes = kMaxTokenResponseBytes;
    auto response = http.perform(request);
    if (response.transport_error != 0) {
      auto failure = storage::transport_failure(response, "the system CA store");
      failure.code = ErrorCode::kPermission;
      failure.advice = "no credentials for az://: off Azure there is no managed identity endpoint; set "
                       "AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_KEY (with AZURE_STORAGE_ACCOUNT) or "
                       "AZURE_STORAGE_SAS_TOKEN, or WEIGHTSTREAM_AZURE_ANONYMOUS=1 for a public container";
      return failure;
    }
    nlohmann::json document = nlohmann::json::parse(response.body, nullptr, false);
    if (response.status < 200 || response.status >= 300) {
      std::string cause = "HTTP " + std::to_string(response.status);
      if (document.is_object()) {
        // IMDS: {"error", "error_description"}; App Service: {"statusCode", "message"}.
        std::string error = json_string(document, "error");
        std::string description = json_string(document, "error_description");
        if (description.empty()) description = json_string(document, "message");
        if (!error.empty()) cause += " " + clip(redact_all(error), 80);
        if (!description.empty()) cause += ": " + clip(redact_all(description));
      } else if (!response.body.empty()) {
        cause += ": " + clip(redact_all(response.body), 120);
      }
      const long status = response.status;
      // IMDS answers 404 and 410 while it starts up, and 429 and 5xx under load: retried.
      storage::AttemptFailure failure(cause, status >= 500 || status == 429 || status == 404 || status == 410);
      if (!failure.retryable) {
        failure.code = ErrorCode::kPermission;
        failure.advice = "the identity endpoint refused: check that the machine has a managed identity "
                         "(and AZURE_CLIENT_ID, for a user-assigned one)";
      }
      return failure;
    }
    const auto expires_in = document.is_object() ? json_seconds(document, "expires_in") : std::nullopt;
    const auto expires_on = document.is_object() ? json_seconds(document, "expires_on") : std::nullopt;
    if (!document.is_object() || json_string(document, "access_token").empty() || (!expires_in && !expires_on))
      return storage::AttemptFailure{"the token response is not JSON with access_token and expires_in or expires_on",
                                     true};
    token = json_string(document, "access_token");
    const int64_t epoch = std::chrono::duration_cast<std::chrono::seconds>(now.time_since_epoch()).count();
    lifetime = expires_in ? *expires_in : *expires_on - epoch;
    return std::nullopt;
  }, retries, redact_all);
  if (!token_.empty()) previous_token_ = token_;
  token_ = std::move(token);
  lifetime = std::max<int64_t>(lifetime, 0);
  expiry_ = now + std::chrono::seconds(lifetime);
  // A token that lives less than twice the margin is renewed at half its life instead.
  refresh_margin_ = std::min<std::chrono::seconds>(kRefreshMargin, std::chrono::seconds(lifetime / 2));
  ++fetched_;
  return token_;
}

}  // namespace weightstream::azure
