// GCS JSON API requests, under the shared retry policy of storage/retry_policy.hpp. Retried
// as Google advises (https://cloud.google.com/storage/docs/retry-strategy): 408, 429, 5xx
// and transport failures; a 401 once more with a fresh token. Not retried: 403, 404, other 4xx.
#include "storage/gcs_client.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "storage/shared/read_destination.hpp"
#include "storage/s3_checksum.hpp"
#include "weightstream/error.hpp"

namespace weightstream::gcs {
namespace {

using storage::AttemptFailure;
using storage::describe_range;
using storage::Field;
using storage::HttpRequest;
using storage::HttpResponse;

// Listings, metadata and error documents are small; a larger body is not one of them.
constexpr size_t kMaxDocumentBytes = 64 * 1024 * 1024;

// Text a server sent, cut short and kept printable, for messages.
std::string clip(std::string_view text, size_t limit = 200) {
  std::string out;
  for (char c : text.substr(0, limit)) out += (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) ? '?' : c;
  if (text.size() > limit) out += "…";
  return out;
}

std::string json_string(const nlohmann::json& document, const char* field) {
  auto it = document.find(field);
  return it != document.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// The JSON API sends 64-bit numbers (size) as decimal strings.
std::optional<uint64_t> json_size(const nlohmann::json& document) {
  auto it = document.find("size");
  if (it == document.end()) return std::nullopt;
  if (it->is_string()) return storage::parse_u64(it->get<std::string>());
  if (it->is_number_unsigned()) return it->get<uint64_t>();
  return std::nullopt;
}

std::string endpoint_of(const GcsOptions& options) {
  std::string endpoint = options.emulator_host.empty() ? options.endpoint : options.emulator_host;
  // STORAGE_EMULATOR_HOST is "host:port" in Google's examples and a URL in others.
  if (!endpoint.starts_with("http://") && !endpoint.starts_with("https://")) endpoint = "http://" + endpoint;
  while (endpoint.ends_with('/')) endpoint.pop_back();
  WS_EXPECT(endpoint.find_first_of("?#@ ", endpoint.find("://") + 3) == std::string::npos &&
                endpoint.size() > endpoint.find("://") + 3,
            ErrorCode::kConfig,
            "GCS endpoint '" + storage::redact_userinfo(endpoint) + "' has no usable host (STORAGE_EMULATOR_HOST)");
  return endpoint;
}

storage::HttpSettings settings_of(const S3Options& transfer) {
  storage::HttpSettings settings = storage::transfer_settings(transfer);
  settings.ca_bundle.clear();  // AWS_CA_BUNDLE is AWS's: Google's endpoint is checked against the system's CAs
  settings.verify_tls = true;
  return settings;
}

}  // namespace

std::string gcs_uri(std::string_view bucket, std::string_view key) {
  return "gs://" + std::string(bucket) + "/" + std::string(key);
}

ListPage parse_list_page(std::string_view json) {
  nlohmann::json document = nlohmann::json::parse(json, nullptr, false);
  WS_EXPECT(!document.is_discarded() && document.is_object(), ErrorCode::kFormat,
            "malformed objects.list response: not a JSON object");
  ListPage page;
  if (auto items = document.find("items"); items != document.end()) {
    WS_EXPECT(items->is_array(), ErrorCode::kFormat, "malformed objects.list response: 'items' is not an array");
    for (const auto& item : *items) {
      WS_EXPECT(item.is_object() && !json_string(item, "name").empty(), ErrorCode::kFormat,
                "malformed objects.list response: an item without a name");
      auto size = json_size(item);
      WS_EXPECT(size.has_value(), ErrorCode::kFormat,
                "malformed objects.list response: object '" + clip(json_string(item, "name")) +
                    "' has no size that is a whole number of bytes");
      page.objects.push_back({json_string(item, "name"), *size});
    }
  }
  if (auto prefixes = document.find("prefixes"); prefixes != document.end() && prefixes->is_array()) {
    for (const auto& prefix : *prefixes)
      if (prefix.is_string()) page.prefixes.push_back(prefix.get<std::string>());
  }
  page.next_page_token = json_string(document, "nextPageToken");
  return page;
}

ErrorBody parse_error_body(std::string_view json) {
  ErrorBody body;
  nlohmann::json document = nlohmann::json::parse(json, nullptr, false);
  if (document.is_discarded() || !document.is_object()) return body;
  auto error = document.find("error");
  if (error == document.end() || !error->is_object()) return body;
  body.message = clip(json_string(*error, "message"));
  if (auto errors = error->find("errors"); errors != error->end() && errors->is_array() && !errors->empty() &&
                                          errors->front().is_object()) {
    body.reason = clip(json_string(errors->front(), "reason"), 60);
  }
  return body;
}

GcsClient::GcsClient(const GcsOptions& options, const S3Options& transfer)
    : transfer_(transfer),
      endpoint_(endpoint_of(options)),
      tokens_(options),
      retry_(storage::retry_policy(transfer_, endpoint_)),
      http_(settings_of(transfer_)) {
  if (transfer_.max_attempts == 0) transfer_.max_attempts = 1;
}

std::string GcsClient::object_path(std::string_view bucket, std::string_view key) const {
  // The object name is one path segment: its '/' are encoded too.
  return "/b/" + storage::uri_encode(bucket, false) + "/o/" + storage::uri_encode(key, false);
}

HttpResponse GcsClient::send(HttpRequest request) {
  ++requests_;
  return http_.perform(request);
}

void GcsClient::with_retries(const std::string& operation,
                             const std::function<std::optional<AttemptFailure>(double)>& attempt) {
  storage::with_retries(retry_, operation, [&](double remaining) -> std::optional<AttemptFailure> {
    try {
      return attempt(remaining);
    } catch (const Error& error) {
      // A token that cannot be had: its own message says why, after the operation's.
      return AttemptFailure{error.what(), false, error.code()};
    }
  }, retries_, [this](std::string text) { return tokens_.redact(std::move(text)); });
}

AttemptFailure GcsClient::http_failure(const HttpResponse& response, std::string_view bucket, std::string_view key,
                                       bool listing, bool& token_renewed) {
  if (response.transport_error != 0) return storage::transport_failure(response, "the system CA store");
  ErrorBody body = parse_error_body(tokens_.redact(response.body));
  const std::string request_id = tokens_.redact(clip(response.header("x-guploader-uploadid"), 100));
  const long status = response.status;
  AttemptFailure failure;
  failure.cause = "HTTP " + std::to_string(status);
  if (!body.reason.empty()) failure.cause += " " + body.reason;
  failure.kind = failure.cause;
  if (!body.message.empty()) failure.cause += ": " + body.message;
  if (!request_id.empty()) failure.cause += " (request id " + request_id + ")";
  if (status >= 500 || status == 429 || status == 408) {
    failure.retryable = true;
    return failure;
  }
  failure.retryable = false;
  if (status == 401 || status == 403) {
    failure.code = ErrorCode::kPermission;
    if (status == 401 && tokens_.kind() != TokenSource::Kind::kNone && !token_renewed) {
      // An expired or revoked token: one more attempt, with a fresh one (as Google's
      // libraries do); a fresh token refused too is a credential problem, not retried.
      tokens_.invalidate();
      token_renewed = true;
      failure.retryable = true;
    }
    failure.advice = "a credential problem: check the credentials (from " + tokens_.description() +
                     ") and that they may read gs://" + std::string(bucket);
  } else if (status == 404) {
    failure.code = ErrorCode::kNotFound;
    if (listing) {
      failure.cause = "no bucket gs://" + std::string(bucket) + " (" + failure.cause + ")";
      failure.advice = "check the bucket name '" + std::string(bucket) + "' and the endpoint " + endpoint_;
    } else {
      failure.cause = "no object " + gcs_uri(bucket, key) + " (" + failure.cause + ")";
      failure.advice = "check the bucket '" + std::string(bucket) + "', the object name and the prefix of the URI";
    }
  } else if (status == 416) {
    failure.code = ErrorCode::kIo;
    failure.advice = "the range starts past the end of the object";
  }
  return failure;
}

storage::ObjectMetadata GcsClient::metadata(std::string_view bucket, std::string_view key) {
  storage::ObjectMetadata metadata;
  metadata.crc32c_name = "crc32c";
  bool token_renewed = false;  // after a 401, once per request
  with_retries("cannot stat " + gcs_uri(bucket, key), [&](double remaining) -> std::optional<AttemptFailure> {
    HttpRequest request;
    request.url = endpoint_ + "/storage/v1" + object_path(bucket, key) + "?fields=size%2Ccrc32c";
    request.timeout_seconds = remaining;
    request.max_body_bytes = kMaxDocumentBytes;
    if (auto authorization = tokens_.authorization(http_, retry_, retries_); !authorization.empty())
      request.headers.emplace_back("Authorization", std::move(authorization));
    auto response = send(std::move(request));
    if (response.transport_error != 0 || response.status < 200 || response.status >= 300)
      return http_failure(response, bucket, key, false, token_renewed);
    nlohmann::json document = nlohmann::json::parse(response.body, nullptr, false);
    auto size = document.is_object() ? json_size(document) : std::nullopt;
    if (!size) return AttemptFailure{"the object's metadata has no valid size", true};
    metadata.size = *size;
    metadata.crc32c = json_string(document, "crc32c");
    return std::nullopt;
  });
  return metadata;
}

ListPage GcsClient::list_page(std::string_view bucket, std::string_view prefix, std::string_view delimiter,
                              std::string_view page_token) {
  std::vector<Field> query = {{"maxResults", "1000"}, {"fields", "items(name,size),prefixes,nextPageToken"}};
  if (!prefix.empty()) query.emplace_back("prefix", std::string(prefix));
  if (!delimiter.empty()) query.emplace_back("delimiter", std::string(delimiter));
  if (!page_token.empty()) query.emplace_back("pageToken", std::string(page_token));
  ListPage page;
  bool token_renewed = false;  // after a 401, once per request
  with_retries("cannot list " + gcs_uri(bucket, prefix), [&](double remaining) -> std::optional<AttemptFailure> {
    HttpRequest request;
    request.url = endpoint_ + "/storage/v1/b/" + storage::uri_encode(bucket, false) + "/o?" +
                  storage::query_string(query);
    request.timeout_seconds = remaining;
    request.max_body_bytes = kMaxDocumentBytes;
    if (auto authorization = tokens_.authorization(http_, retry_, retries_); !authorization.empty())
      request.headers.emplace_back("Authorization", std::move(authorization));
    auto response = send(std::move(request));
    if (response.transport_error != 0 || response.status < 200 || response.status >= 300)
      return http_failure(response, bucket, prefix, true, token_renewed);
    try {
      page = parse_list_page(response.body);
    } catch (const Error& error) {
      return AttemptFailure{error.what(), false, ErrorCode::kFormat};
    }
    return std::nullopt;
  });
  return page;
}

std::vector<storage::ListedKey> GcsClient::list_objects(std::string_view bucket, std::string_view prefix,
                                                        std::string_view delimiter, size_t max_pages) {
  std::vector<storage::ListedKey> objects;
  std::string token;
  std::vector<std::string> seen_tokens;
  for (size_t pages = 0;; ++pages) {
    WS_EXPECT(pages < max_pages, ErrorCode::kFormat,
              "cannot list " + gcs_uri(bucket, prefix) + ": more than " + std::to_string(max_pages) + " pages");
    ListPage page = list_page(bucket, prefix, delimiter, token);
    for (auto& object : page.objects) objects.push_back(std::move(object));
    if (page.next_page_token.empty()) break;
    // A server that hands back a token it already gave would loop forever.
    WS_EXPECT(std::find(seen_tokens.begin(), seen_tokens.end(), page.next_page_token) == seen_tokens.end() &&
                  page.next_page_token != token,
              ErrorCode::kFormat, "cannot list " + gcs_uri(bucket, prefix) + ": the server repeated a page token");
    seen_tokens.push_back(page.next_page_token);
    token = std::move(page.next_page_token);
  }
  return objects;
}

void GcsClient::get_range(std::string_view bucket, std::string_view key, uint64_t offset,
                          std::span<const std::span<std::byte>> segments, std::optional<uint64_t> whole_object_size) {
  const uint64_t size = storage::segments_bytes(segments);
  WS_EXPECT(size > 0, ErrorCode::kInternal, "get_range of zero bytes");
  WS_EXPECT(offset <= UINT64_MAX - size, ErrorCode::kInvalidArgument,
            "cannot read " + describe_range(offset, size) + " of " + gcs_uri(bucket, key) + ": the range overflows");
  const bool whole = whole_object_size && offset == 0 && *whole_object_size == size && segments.size() == 1;
  const std::string url = endpoint_ + "/download/storage/v1" + object_path(bucket, key) + "?alt=media";
  bool token_renewed = false;  // after a 401, once per request
  with_retries("cannot read " + describe_range(offset, size) + " of " + gcs_uri(bucket, key),
               [&](double remaining) -> std::optional<AttemptFailure> {
    HttpRequest request;
    request.url = url;
    request.timeout_seconds = remaining;
    request.destination = segments;
    request.into_destination = true;
    if (!whole)
      request.headers.emplace_back("Range", "bytes=" + std::to_string(offset) + "-" + std::to_string(offset + size - 1));
    if (auto authorization = tokens_.authorization(http_, retry_, retries_); !authorization.empty())
      request.headers.emplace_back("Authorization", std::move(authorization));
    auto response = send(std::move(request));
    const bool success_status = response.status >= 200 && response.status < 300;
    if ((response.transport_error != 0 && !response.overflow) || !success_status)
      return http_failure(response, bucket, key, false, token_renewed);
    const std::string request_id = tokens_.redact(clip(response.header("x-guploader-uploadid"), 100));
    const std::string id_note = request_id.empty() ? "" : " (request id " + request_id + ")";
    auto check = storage::check_range_response(response, offset, size, whole, id_note);
    if (check.failure) return check.failure;
    if (whole) {
      // x-goog-hash: crc32c=BASE64,md5=BASE64 covers the whole object, so it is checked only here.
      const std::string hashes = response.header("x-goog-hash");
      for (size_t at = 0; at < hashes.size();) {
        size_t end = hashes.find(',', at);
        if (end == std::string::npos) end = hashes.size();
        std::string_view part = std::string_view(hashes).substr(at, end - at);
        while (part.starts_with(' ')) part.remove_prefix(1);
        if (part.starts_with("crc32c=")) {
          const std::string expected(part.substr(7));
          const std::string actual = s3::crc32c_header_value(segments[0]);
          if (expected != actual) {
            ++checksum_failures_;
            return AttemptFailure{"checksum mismatch: crc32c is " + clip(expected, 20) + " but the bytes received give " +
                                      actual + id_note,
                                  true};
          }
        }
        at = end + 1;
      }
    }
    return std::nullopt;
  });
}

void GcsClient::create_bucket(std::string_view bucket, std::string_view project) {
  const std::string body = nlohmann::json{{"name", std::string(bucket)}}.dump();
  bool token_renewed = false;  // after a 401, once per request
  with_retries("cannot create bucket gs://" + std::string(bucket), [&](double remaining) -> std::optional<AttemptFailure> {
    HttpRequest request;
    request.method = "POST";
    request.url = endpoint_ + "/storage/v1/b?" + storage::query_string({{"project", std::string(project)}});
    request.upload = body;
    request.timeout_seconds = remaining;
    request.headers.emplace_back("Content-Type", "application/json");
    if (auto authorization = tokens_.authorization(http_, retry_, retries_); !authorization.empty())
      request.headers.emplace_back("Authorization", std::move(authorization));
    auto response = send(std::move(request));
    if (response.status == 409) return std::nullopt;  // it exists already
    if (response.transport_error != 0 || response.status < 200 || response.status >= 300)
      return http_failure(response, bucket, "", true, token_renewed);
    return std::nullopt;
  });
}

void GcsClient::put_object(std::string_view bucket, std::string_view key, std::string_view body) {
  bool token_renewed = false;  // after a 401, once per request
  with_retries("cannot write " + std::to_string(body.size()) + " bytes to " + gcs_uri(bucket, key),
               [&](double remaining) -> std::optional<AttemptFailure> {
    HttpRequest request;
    request.method = "POST";
    request.url = endpoint_ + "/upload/storage/v1/b/" + storage::uri_encode(bucket, false) + "/o?" +
                  storage::query_string({{"uploadType", "media"}, {"name", std::string(key)}});
    request.upload = body;
    request.timeout_seconds = remaining;
    request.headers.emplace_back("Content-Type", "application/octet-stream");
    if (auto authorization = tokens_.authorization(http_, retry_, retries_); !authorization.empty())
      request.headers.emplace_back("Authorization", std::move(authorization));
    auto response = send(std::move(request));
    if (response.transport_error != 0 || response.status < 200 || response.status >= 300)
      return http_failure(response, bucket, key, false, token_renewed);
    return std::nullopt;
  });
}

}  // namespace weightstream::gcs
