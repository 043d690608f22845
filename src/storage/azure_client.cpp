// Blob service requests, under the shared retry policy of storage/retry_policy.hpp. Retried as
// Azure's SDKs retry (https://learn.microsoft.com/azure/storage/blobs/storage-retry-policy):
// 408, 429, 5xx and transport failures; a 401 once more with a fresh token. Not retried: 403
// (AuthenticationFailed, AuthorizationPermissionMismatch), 404, other 4xx.
#include "storage/azure_client.hpp"

#include <openssl/evp.h>

#include <algorithm>

#include "storage/shared/read_destination.hpp"
#include "storage/s3_checksum.hpp"
#include "weightstream/error.hpp"

namespace weightstream::azure {
namespace {

using storage::AttemptFailure;
using storage::describe_range;
using storage::Field;
using storage::HttpRequest;
using storage::HttpResponse;

// Listings and error documents are small; a larger body is not one of them.
constexpr size_t kMaxDocumentBytes = 64 * 1024 * 1024;
// The most names one List Blobs page may hold.
constexpr const char* kMaxResults = "5000";

// Text a server sent, cut short and kept printable, for messages.
std::string clip(std::string_view text, size_t limit = 200) {
  std::string out;
  for (char c : text.substr(0, limit)) out += (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) ? '?' : c;
  if (text.size() > limit) out += "…";
  return out;
}

std::optional<uint64_t> parse_size(std::string_view text) { return storage::parse_u64(text); }

struct DigestContextDeleter {
  void operator()(EVP_MD_CTX* context) const { EVP_MD_CTX_free(context); }
};

// base64 of the MD5 of `bytes`: what Content-MD5 carries.
std::string md5_base64(std::span<const std::byte> bytes) {
  std::unique_ptr<EVP_MD_CTX, DigestContextDeleter> context(EVP_MD_CTX_new());
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  WS_EXPECT(context && EVP_DigestInit_ex(context.get(), EVP_md5(), nullptr) == 1 &&
                EVP_DigestUpdate(context.get(), bytes.data(), bytes.size()) == 1 &&
                EVP_DigestFinal_ex(context.get(), digest, &length) == 1,
            ErrorCode::kInternal, "MD5 is not available from OpenSSL");
  return s3::base64_encode(std::string_view(reinterpret_cast<const char*>(digest), length));
}

storage::HttpSettings settings_of(const S3Options& transfer) {
  storage::HttpSettings settings = storage::transfer_settings(transfer);
  settings.ca_bundle.clear();  // AWS_CA_BUNDLE is AWS's: Azure's endpoint is checked against the system's CAs
  settings.verify_tls = true;
  return settings;
}

}  // namespace

std::string azure_uri(std::string_view account, std::string_view container, std::string_view key) {
  return "az://" + std::string(account) + "/" + std::string(container) + "/" + std::string(key);
}

BlobClient::BlobClient(std::string account, std::string_view uri_endpoint, const AzureOptions& options,
                       const S3Options& transfer)
    : transfer_(transfer),
      credentials_(account, uri_endpoint, options),
      retry_(storage::retry_policy(transfer_, credentials_.endpoint())),
      http_(settings_of(transfer_)) {
  if (transfer_.max_attempts == 0) transfer_.max_attempts = 1;
}

HttpRequest BlobClient::build(std::string method, const std::string& encoded_path, std::vector<Field> query,
                              std::vector<Field> headers, std::string& signature) {
  SharedKeyInput input;
  input.method = std::move(method);
  input.encoded_path = credentials_.endpoint_path() + encoded_path;
  input.query = std::move(query);
  input.headers = std::move(headers);
  input.headers.emplace_back("x-ms-date", rfc1123_date(std::chrono::system_clock::now()));
  input.headers.emplace_back("x-ms-version", std::string(kApiVersion));
  HttpRequest request;
  request.method = input.method;
  request.url = credentials_.endpoint() + encoded_path;
  std::string query_text = storage::query_string(input.query);
  if (!credentials_.sas().empty()) query_text += (query_text.empty() ? "" : "&") + credentials_.sas();
  if (!query_text.empty()) request.url += "?" + query_text;
  std::string authorization = credentials_.authorization(input, http_, retry_, retries_);
  request.headers = std::move(input.headers);
  if (!authorization.empty()) {
    // A server that refuses a signature may quote it back ("The MAC signature found in the
    // HTTP request '…'"): what follows "SharedKey account:" or "Bearer " is masked too.
    const size_t cut = authorization.starts_with("SharedKey ") ? authorization.find(':') + 1 : authorization.find(' ') + 1;
    signature = authorization.substr(cut);
    request.headers.emplace_back("Authorization", std::move(authorization));
  }
  return request;
}

HttpResponse BlobClient::send(const HttpRequest& request) {
  ++requests_;
  return http_.perform(request);
}

std::string BlobClient::redact(std::string text, const std::string& signature) const {
  return credentials_.redact(storage::mask_secrets(std::move(text), {signature}));
}

void BlobClient::with_retries(const std::string& operation,
                              const std::function<std::optional<AttemptFailure>(double)>& attempt) {
  storage::with_retries(retry_, operation, [&](double remaining) -> std::optional<AttemptFailure> {
    try {
      return attempt(remaining);
    } catch (const Error& error) {
      // A token that cannot be had: its own message says why, after the operation's.
      return AttemptFailure{error.what(), false, error.code()};
    }
  }, retries_, [this](std::string text) { return credentials_.redact(std::move(text)); });
}

AttemptFailure BlobClient::http_failure(const HttpResponse& response, std::string_view container, std::string_view key,
                                        bool listing, bool& token_renewed, const std::string& signature) {
  if (response.transport_error != 0) return storage::transport_failure(response, "the system CA store");
  // Redacted field by field after parsing: "<redacted>" inside the XML would break it.
  ErrorBody body = parse_error_body(response.body, [&](std::string text) { return redact(std::move(text), signature); });
  // A HEAD's answer has no body: the code comes in x-ms-error-code.
  if (body.code.empty()) body.code = clip(redact(response.header("x-ms-error-code"), signature), 80);
  const std::string request_id = clip(redact(response.header("x-ms-request-id"), signature), 100);
  const long status = response.status;
  AttemptFailure failure;
  failure.cause = "HTTP " + std::to_string(status);
  if (!body.code.empty()) failure.cause += " " + body.code;
  failure.kind = failure.cause;
  if (!body.message.empty()) failure.cause += ": " + body.message;
  if (!body.detail.empty()) failure.cause += " (" + body.detail + ")";
  if (!request_id.empty()) failure.cause += " (request id " + request_id + ")";
  if (status >= 500 || status == 429 || status == 408) {
    failure.retryable = true;
    return failure;
  }
  failure.retryable = false;
  const std::string container_uri = "az://" + account() + "/" + std::string(container);
  if (status == 401 || status == 403) {
    failure.code = ErrorCode::kPermission;
    if (status == 401 && credentials_.kind() == Credentials::Kind::kManagedIdentity && !token_renewed) {
      // An expired or revoked token: one more attempt, with a fresh one; a fresh token
      // refused too is a credential problem, not retried.
      credentials_.invalidate();
      token_renewed = true;
      failure.retryable = true;
    }
    failure.advice = "a credential problem: check the credentials (" + credentials_.description() +
                     ") and that they may read " + container_uri;
  } else if (status == 404) {
    failure.code = ErrorCode::kNotFound;
    if (listing || body.code == "ContainerNotFound") {
      failure.cause = "no container " + container_uri + " (" + failure.cause + ")";
      failure.advice = "check the account '" + account() + "', the container name '" + std::string(container) +
                       "' and the endpoint " + endpoint();
    } else {
      failure.cause = "no object " + azure_uri(account(), container, key) + " (" + failure.cause + ")";
      failure.advice = "check the container '" + std::string(container) + "', the blob name and the prefix of the URI";
    }
  } else if (status == 416) {
    failure.code = ErrorCode::kIo;
    failure.advice = "the range starts past the end of the blob";
  }
  return failure;
}

storage::ObjectMetadata BlobClient::metadata(std::string_view container, std::string_view key) {
  storage::ObjectMetadata metadata;
  const std::string path = "/" + storage::uri_encode(container, false) + "/" + storage::uri_encode(key, true);
  bool token_renewed = false;  // after a 401, once per request
  with_retries("cannot stat " + azure_uri(account(), container, key), [&](double remaining) -> std::optional<AttemptFailure> {
    std::string signature;
    HttpRequest request = build("HEAD", path, {}, {}, signature);
    request.timeout_seconds = remaining;
    auto response = send(request);
    if (response.transport_error != 0 || response.status < 200 || response.status >= 300)
      return http_failure(response, container, key, false, token_renewed, signature);
    auto size = parse_size(response.header("content-length"));
    if (!size) return AttemptFailure{"the blob's properties have no valid Content-Length", true};
    metadata.size = *size;
    return std::nullopt;
  });
  return metadata;
}

ListPage BlobClient::list_page(std::string_view container, std::string_view prefix, std::string_view delimiter,
                               std::string_view marker) {
  std::vector<Field> query = {{"restype", "container"}, {"comp", "list"}, {"maxresults", kMaxResults}};
  if (!prefix.empty()) query.emplace_back("prefix", std::string(prefix));
  if (!delimiter.empty()) query.emplace_back("delimiter", std::string(delimiter));
  if (!marker.empty()) query.emplace_back("marker", std::string(marker));
  const std::string path = "/" + storage::uri_encode(container, false);
  ListPage page;
  bool token_renewed = false;  // after a 401, once per request
  with_retries("cannot list " + azure_uri(account(), container, prefix), [&](double remaining) -> std::optional<AttemptFailure> {
    std::string signature;
    HttpRequest request = build("GET", path, query, {}, signature);
    request.timeout_seconds = remaining;
    request.max_body_bytes = kMaxDocumentBytes;
    auto response = send(request);
    if (response.transport_error != 0 || response.status < 200 || response.status >= 300)
      return http_failure(response, container, prefix, true, token_renewed, signature);
    try {
      page = parse_list_page(response.body);
    } catch (const Error& error) {
      return AttemptFailure{error.what(), false, ErrorCode::kFormat};
    }
    return std::nullopt;
  });
  return page;
}

std::vector<storage::ListedKey> BlobClient::list_blobs(std::string_view container, std::string_view prefix,
                                                       std::string_view delimiter, size_t max_pages) {
  std::vector<storage::ListedKey> objects;
  std::string marker;
  std::vector<std::string> seen_markers;
  for (size_t pages = 0;; ++pages) {
    WS_EXPECT(pages < max_pages, ErrorCode::kFormat,
              "cannot list " + azure_uri(account(), container, prefix) + ": more than " + std::to_string(max_pages) +
                  " pages");
    ListPage page = list_page(container, prefix, delimiter, marker);
    for (auto& object : page.objects) objects.push_back(std::move(object));
    if (page.next_marker.empty()) break;
    // A server that hands back a marker it already gave would loop forever.
    WS_EXPECT(std::find(seen_markers.begin(), seen_markers.end(), page.next_marker) == seen_markers.end(),
              ErrorCode::kFormat, "cannot list " + azure_uri(account(), container, prefix) + ": the server repeated a marker");
    seen_markers.push_back(page.next_marker);
    marker = std::move(page.next_marker);
  }
  return objects;
}

void BlobClient::get_range(std::string_view container, std::string_view key, uint64_t offset,
                           std::span<const std::span<std::byte>> segments, std::optional<uint64_t> whole_object_size) {
  const uint64_t size = storage::segments_bytes(segments);
  WS_EXPECT(size > 0, ErrorCode::kInternal, "get_range of zero bytes");
  const std::string object = azure_uri(account(), container, key);
  WS_EXPECT(offset <= UINT64_MAX - size, ErrorCode::kInvalidArgument,
            "cannot read " + describe_range(offset, size) + " of " + object + ": the range overflows");
  const bool whole = whole_object_size && offset == 0 && *whole_object_size == size && segments.size() == 1;
  const std::string path = "/" + storage::uri_encode(container, false) + "/" + storage::uri_encode(key, true);
  bool token_renewed = false;  // after a 401, once per request
  with_retries("cannot read " + describe_range(offset, size) + " of " + object,
               [&](double remaining) -> std::optional<AttemptFailure> {
    std::vector<Field> headers;
    if (!whole)
      headers.emplace_back("x-ms-range", "bytes=" + std::to_string(offset) + "-" + std::to_string(offset + size - 1));
    std::string signature;
    HttpRequest request = build("GET", path, {}, std::move(headers), signature);
    request.timeout_seconds = remaining;
    request.destination = segments;
    request.into_destination = true;
    auto response = send(request);
    const bool success_status = response.status >= 200 && response.status < 300;
    if ((response.transport_error != 0 && !response.overflow) || !success_status)
      return http_failure(response, container, key, false, token_renewed, signature);
    const std::string request_id = clip(redact(response.header("x-ms-request-id"), signature), 100);
    const std::string id_note = request_id.empty() ? "" : " (request id " + request_id + ")";
    auto check = storage::check_range_response(response, offset, size, whole, id_note);
    if (check.failure) return check.failure;
    if (whole) {
      // Content-MD5 of a whole-blob Get Blob is the MD5 stored with the blob (when it has one).
      const std::string expected = response.header("content-md5");
      if (!expected.empty()) {
        const std::string actual = md5_base64(segments[0]);
        if (expected != actual) {
          ++checksum_failures_;
          return AttemptFailure{"checksum mismatch: Content-MD5 is " + clip(expected, 30) +
                                    " but the bytes received give " + actual + id_note,
                                true};
        }
      }
    }
    return std::nullopt;
  });
}

void BlobClient::create_container(std::string_view container) {
  const std::string path = "/" + storage::uri_encode(container, false);
  bool token_renewed = false;  // after a 401, once per request
  with_retries("cannot create container az://" + account() + "/" + std::string(container),
               [&](double remaining) -> std::optional<AttemptFailure> {
    std::string signature;
    HttpRequest request = build("PUT", path, {{"restype", "container"}}, {{"Content-Length", "0"}}, signature);
    request.headers.erase(std::remove_if(request.headers.begin(), request.headers.end(),
                                         [](const Field& field) { return field.first == "Content-Length"; }),
                          request.headers.end());  // libcurl sends the length of the (empty) upload itself
    request.timeout_seconds = remaining;
    auto response = send(request);
    if (response.status == 409) return std::nullopt;  // ContainerAlreadyExists
    if (response.transport_error != 0 || response.status < 200 || response.status >= 300)
      return http_failure(response, container, "", true, token_renewed, signature);
    return std::nullopt;
  });
}

void BlobClient::put_blob(std::string_view container, std::string_view key, std::string_view body) {
  const std::string path = "/" + storage::uri_encode(container, false) + "/" + storage::uri_encode(key, true);
  bool token_renewed = false;  // after a 401, once per request
  with_retries("cannot write " + std::to_string(body.size()) + " bytes to " + azure_uri(account(), container, key),
               [&](double remaining) -> std::optional<AttemptFailure> {
    std::string signature;
    // Content-Length is signed (empty when zero); libcurl sends the one it computes, the same.
    HttpRequest request = build("PUT", path, {},
                                {{"Content-Length", std::to_string(body.size())},
                                 {"Content-Type", "application/octet-stream"},
                                 {"x-ms-blob-type", "BlockBlob"}},
                                signature);
    request.headers.erase(std::remove_if(request.headers.begin(), request.headers.end(),
                                         [](const Field& field) { return field.first == "Content-Length"; }),
                          request.headers.end());
    request.upload = body;
    request.timeout_seconds = remaining;
    auto response = send(request);
    if (response.transport_error != 0 || response.status < 200 || response.status >= 300)
      return http_failure(response, container, key, false, token_renewed, signature);
    return std::nullopt;
  });
}

}  // namespace weightstream::azure
