// S3 requests with retries, under the shared policy of storage/retry_policy.hpp. Retried: 5xx (503 SlowDown included), 429, 408, RequestTimeout, transport failures
// (reset, refused, stall, timeout) and bodies whose length or range is not the one asked
// for. Not retried: 403 and 404 (they will not change), other 4xx, TLS verification failures.
#include "storage/s3_client.hpp"

#include <curl/curl.h>

#include <charconv>
#include <chrono>
#include <cmath>
#include <initializer_list>
#include <random>
#include <thread>

#include "base/text.hpp"
#include "storage/shared/read_destination.hpp"
#include "storage/s3_checksum.hpp"

namespace weightstream::s3 {

using storage::describe_range;
using storage::mask_secrets;
using storage::parse_content_range;
using storage::parse_u64;
using storage::redact_userinfo;

namespace {





bool dns_compatible(std::string_view bucket) {
  // Virtual-hosted addressing needs a bucket that is a valid host label and has no dots
  // (dots break the wildcard TLS certificate). Others go path-style.
  if (bucket.size() < 3 || bucket.size() > 63) return false;
  for (char c : bucket) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-')) return false;
  }
  return bucket.front() != '-' && bucket.back() != '-';
}





}  // namespace

std::string s3_uri(std::string_view bucket, std::string_view key) {
  return "s3://" + std::string(bucket) + "/" + std::string(key);
}




Endpoint Endpoint::from_options(const S3Options& options) {
  Endpoint endpoint;
  endpoint.addressing = options.addressing;
  if (options.endpoint.empty()) {
    const std::string region = options.region.empty() ? "us-east-1" : options.region;
    // us-east-1 answers on the global name, which is also what AWS's examples sign.
    endpoint.authority = region == "us-east-1" ? "s3.amazonaws.com" : "s3." + region + ".amazonaws.com";
    return endpoint;
  }
  std::string_view text = options.endpoint;
  endpoint.custom = true;
  if (text.starts_with("https://")) {
    text.remove_prefix(8);
  } else if (text.starts_with("http://")) {
    // Plain HTTP only ever comes from an explicit endpoint (a local MinIO, moto, a proxy).
    endpoint.scheme = "http";
    text.remove_prefix(7);
  } else {
    WS_FAIL(ErrorCode::kConfig, "S3 endpoint '" + redact_userinfo(options.endpoint) +
                                    "' must start with http:// or https:// (AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL)");
  }
  auto slash = text.find('/');
  endpoint.authority = std::string(text.substr(0, slash));
  if (slash != std::string_view::npos) {
    std::string_view path = text.substr(slash);
    while (!path.empty() && path.back() == '/') path.remove_suffix(1);
    endpoint.base_path = std::string(path);
  }
  WS_EXPECT(!endpoint.authority.empty() && endpoint.authority.find_first_of("?#@ ") == std::string::npos,
            ErrorCode::kConfig,
            "S3 endpoint '" + redact_userinfo(options.endpoint) + "' has no usable host" +
                (endpoint.authority.find('@') != std::string::npos
                     ? std::string(" (credentials in the URL are not used: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)")
                     : std::string()));
  return endpoint;
}

bool Endpoint::virtual_hosted(std::string_view bucket) const {
  switch (addressing) {
    case S3Addressing::kPath:
      return false;
    case S3Addressing::kVirtual:
      return true;
    case S3Addressing::kAuto:
      return !custom && dns_compatible(bucket);
  }
  return false;
}

S3Client::S3Client(S3Options options)
    : options_(std::move(options)),
      endpoint_(Endpoint::from_options(options_)),
      signer_(resolve_credentials(options_), options_.region.empty() ? "us-east-1" : options_.region),
      retry_(storage::retry_policy(options_, endpoint_.scheme + "://" + endpoint_.authority)),
      http_(storage::transfer_settings(options_)) {
  if (options_.max_attempts == 0) options_.max_attempts = 1;
  if (!options_.verify_tls) {
    // Security bullet of issue 7: turning verification off is explicit and loud.
    std::fprintf(stderr, "weightstream: warning: TLS certificate verification is OFF for S3 endpoint %s\n",
                 endpoint_.authority.c_str());
  }
}

Target S3Client::target(std::string_view bucket, std::string_view key, const std::vector<Field>& query) const {
  Target target;
  const std::string encoded_key = uri_encode(key, true);
  if (endpoint_.virtual_hosted(bucket)) {
    target.host = std::string(bucket) + "." + endpoint_.authority;
    target.encoded_path = endpoint_.base_path + "/" + encoded_key;
  } else {
    target.host = endpoint_.authority;
    target.encoded_path = endpoint_.base_path + "/" + uri_encode(bucket, false);
    if (!key.empty()) target.encoded_path += "/" + encoded_key;
  }
  target.url = endpoint_.scheme + "://" + target.host + target.encoded_path;
  if (!query.empty()) target.url += "?" + canonical_query(query);
  return target;
}

HttpResponse S3Client::send(HttpRequest request, std::string_view bucket, std::string_view key,
                            const std::vector<Field>& query, std::string_view payload_hash) {
  Target where = target(bucket, key, query);
  SigningInput input;
  input.method = request.method;
  input.encoded_path = where.encoded_path;
  input.query = query;
  input.payload_hash = std::string(payload_hash);
  // Host is set explicitly so that the value signed is exactly the value sent.
  input.headers.emplace_back("host", where.host);
  for (auto& header : request.headers) input.headers.push_back(std::move(header));
  signer_.sign_headers(input, amz_date_now());
  request.headers = std::move(input.headers);
  request.url = std::move(where.url);
  ++requests_;
  return http_.perform(request);
}

S3Client::Failure S3Client::http_failure(const HttpResponse& response, std::string_view bucket,
                                         std::string_view key) const {
  Failure failure;
  if (response.transport_error != 0) return storage::transport_failure(response, "AWS_CA_BUNDLE");
  // Masked before parse_error_body cuts its fields, so that no prefix of a secret is left.
  ErrorBody body = parse_error_body(server_text(response.body));
  std::string request_id = server_text(response.header("x-amz-request-id"), 100);
  if (request_id.empty()) request_id = body.request_id.substr(0, 100);
  failure.cause = "HTTP " + std::to_string(response.status);
  if (!body.code.empty()) failure.cause += " " + body.code;
  failure.kind = failure.cause;
  if (!body.message.empty()) failure.cause += ": " + body.message;
  if (!request_id.empty()) failure.cause += " (request id " + request_id + ")";
  const long status = response.status;
  if (status >= 500 || status == 429 || status == 408 || body.code == "RequestTimeout" ||
      body.code == "SlowDown" || body.code == "InternalError") {
    failure.retryable = true;
    return failure;
  }
  failure.retryable = false;
  const std::string region = signer_.region();
  if (status == 403 || body.code == "AuthorizationHeaderMalformed" || body.code == "ExpiredToken" ||
      body.code == "InvalidAccessKeyId" || body.code == "SignatureDoesNotMatch") {
    failure.code = ErrorCode::kPermission;
    if (body.code == "RequestTimeTooSkewed") {
      failure.advice = "check this machine's clock: S3 rejects signatures more than 15 minutes off";
    } else {
      failure.advice = "check the credentials (from " + signer_.credentials().source + "), that they may read s3://" +
                       std::string(bucket) + ", and the region (" + region + ", AWS_REGION)";
    }
  } else if (status == 404) {
    failure.code = ErrorCode::kNotFound;
    if (body.code == "NoSuchBucket") {
      failure.advice = "check the bucket name '" + std::string(bucket) + "' and the endpoint";
    } else {
      failure.advice = "check the bucket '" + std::string(bucket) + "', the key '" + std::string(key) +
                       "' and the prefix of the URI";
    }
  } else if (status == 301 || status == 307 || body.code == "PermanentRedirect") {
    failure.code = ErrorCode::kConfig;
    std::string other = server_text(response.header("x-amz-bucket-region"), 64);
    if (other.empty()) other = body.region;
    failure.advice = "the bucket lives in another region" + (other.empty() ? std::string() : " (" + other + ")") +
                     ": set AWS_REGION (now " + region + ") or the endpoint";
  } else if (status == 416) {
    failure.code = ErrorCode::kIo;
    failure.advice = "the range starts past the end of the object";
  }
  return failure;
}

std::string S3Client::server_text(std::string_view text, size_t limit) const {
  const Credentials& credentials = signer_.credentials();
  std::string masked = mask_secrets(std::string(text), {credentials.secret_access_key, credentials.session_token,
                                                        options_.secret_access_key, options_.session_token});
  return limit < masked.size() ? masked.substr(0, limit) : masked;
}

void S3Client::with_retries(const std::string& operation,
                            const std::function<std::optional<Failure>(double)>& attempt) {
  storage::with_retries(retry_, operation, attempt, retries_, [this](std::string text) { return server_text(text); });
}

ObjectHead S3Client::head_object(std::string_view bucket, std::string_view key, bool checksums) {
  ObjectHead head;
  with_retries("cannot stat " + s3_uri(bucket, key), [&](double remaining) -> std::optional<Failure> {
    HttpRequest request;
    request.method = "HEAD";
    request.timeout_seconds = remaining;
    if (checksums) request.headers.emplace_back("x-amz-checksum-mode", "ENABLED");
    auto response = send(std::move(request), bucket, key, {});
    if (response.transport_error != 0 || response.status < 200 || response.status >= 300) {
      return http_failure(response, bucket, key);
    }
    auto size = parse_u64(response.header("content-length"));
    if (!size) {
      return Failure{"HEAD response has no valid Content-Length ('" + response.header("content-length").substr(0, 40) + "')",
                     true};
    }
    head.size = *size;
    head.etag = response.header("etag");
    head.checksum_crc32c = response.header("x-amz-checksum-crc32c");
    head.checksum_sha256 = response.header("x-amz-checksum-sha256");
    return std::nullopt;
  });
  return head;
}

ListPage S3Client::list_page(std::string_view bucket, std::string_view prefix, std::string_view delimiter,
                             std::string_view continuation_token, unsigned max_keys) {
  std::vector<Field> query = {{"list-type", "2"}, {"max-keys", std::to_string(max_keys)}};
  if (!prefix.empty()) query.emplace_back("prefix", std::string(prefix));
  if (!delimiter.empty()) query.emplace_back("delimiter", std::string(delimiter));
  if (!continuation_token.empty()) query.emplace_back("continuation-token", std::string(continuation_token));
  ListPage page;
  const std::string operation = "cannot list " + s3_uri(bucket, prefix);
  with_retries(operation, [&](double remaining) -> std::optional<Failure> {
    HttpRequest request;
    request.timeout_seconds = remaining;
    auto response = send(std::move(request), bucket, "", query);
    if (response.transport_error != 0 || response.status < 200 || response.status >= 300) {
      auto failure = http_failure(response, bucket, prefix);
      if (response.status == 404 && failure.code == ErrorCode::kNotFound)
        failure.advice = "check the bucket name '" + std::string(bucket) + "' and the endpoint";
      return failure;
    }
    try {
      page = parse_list_page(response.body);
    } catch (const Error& error) {
      return Failure{error.what(), false, ErrorCode::kFormat};
    }
    return std::nullopt;
  });
  return page;
}

std::vector<ListedObject> S3Client::list_objects(std::string_view bucket, std::string_view prefix,
                                                 std::string_view delimiter, unsigned max_keys, size_t max_pages) {
  std::vector<ListedObject> objects;
  std::string token;
  std::vector<std::string> seen_tokens;
  for (size_t pages = 0;; ++pages) {
    WS_EXPECT(pages < max_pages, ErrorCode::kFormat,
              "cannot list " + s3_uri(bucket, prefix) + ": more than " + std::to_string(max_pages) + " pages");
    ListPage page = list_page(bucket, prefix, delimiter, token, max_keys);
    for (auto& object : page.objects) objects.push_back(std::move(object));
    if (!page.truncated) break;
    // A server that hands back a token it already gave would loop forever.
    WS_EXPECT(page.next_token != token && std::find(seen_tokens.begin(), seen_tokens.end(), page.next_token) ==
                                              seen_tokens.end(),
              ErrorCode::kFormat,
              "cannot list " + s3_uri(bucket, prefix) + ": the server repeated a continuation token");
    seen_tokens.push_back(page.next_token);
    token = page.next_token;
  }
  return objects;
}

uint64_t S3Client::get_range(std::string_view bucket, std::string_view key, uint64_t offset,
                             std::span<std::byte> destination, std::optional<uint64_t> whole_object_size) {
  const std::span<std::byte> segments[] = {destination};
  return get_range(bucket, key, offset, segments, whole_object_size);
}

uint64_t S3Client::get_range(std::string_view bucket, std::string_view key, uint64_t offset,
                             std::span<const std::span<std::byte>> segments,
                             std::optional<uint64_t> whole_object_size) {
  const uint64_t size = storage::segments_bytes(segments);
  WS_EXPECT(size > 0, ErrorCode::kInternal, "get_range of zero bytes");
  WS_EXPECT(offset <= UINT64_MAX - size, ErrorCode::kInvalidArgument,
            "cannot read " + describe_range(offset, size) + " of " + s3_uri(bucket, key) + ": the range overflows");
  const bool whole = whole_object_size && offset == 0 && *whole_object_size == size && segments.size() == 1;
  uint64_t total = 0;
  const std::string operation = "cannot read " + describe_range(offset, size) + " of " + s3_uri(bucket, key);
  with_retries(operation, [&](double remaining) -> std::optional<Failure> {
    HttpRequest request;
    request.timeout_seconds = remaining;
    request.destination = segments;
    request.into_destination = true;
    if (whole) {
      request.headers.emplace_back("x-amz-checksum-mode", "ENABLED");
    } else {
      request.headers.emplace_back("range",
                                   "bytes=" + std::to_string(offset) + "-" + std::to_string(offset + size - 1));
    }
    auto response = send(std::move(request), bucket, key, {});
    const bool success_status = response.status >= 200 && response.status < 300;
    if ((response.transport_error != 0 && !response.overflow) || !success_status)
      return http_failure(response, bucket, key);
    const std::string request_id = server_text(response.header("x-amz-request-id"), 100);
    const std::string id_note = request_id.empty() ? "" : " (request id " + request_id + ")";
    auto check = storage::check_range_response(response, offset, size, whole, id_note);
    if (check.failure) return check.failure;
    total = check.total;
    if (whole) {
      // Checksums stored with the object cover it whole, so they are checked only here.
      const std::span<const std::byte> destination = segments[0];
      auto crc = response.header("x-amz-checksum-crc32c");
      if (!crc.empty() && crc.find('-') == std::string::npos && crc32c_header_value(destination) != crc) {
        ++checksum_failures_;
        return Failure{"checksum mismatch: x-amz-checksum-crc32c is " + crc.substr(0, 20) +
                           " but the bytes received give " + crc32c_header_value(destination) + id_note,
                       true};
      }
      auto sha = response.header("x-amz-checksum-sha256");
      if (!sha.empty() && sha.find('-') == std::string::npos && sha256_header_value(destination) != sha) {
        ++checksum_failures_;
        return Failure{"checksum mismatch: x-amz-checksum-sha256 is " + sha.substr(0, 60) +
                           " but the bytes received give " + sha256_header_value(destination) + id_note,
                       true};
      }
    }
    return std::nullopt;
  });
  return total;
}

void S3Client::put_object(std::string_view bucket, std::string_view key, std::string_view body,
                          const std::vector<Field>& extra_headers) {
  const std::string payload_hash = sha256_hex(body);
  with_retries("cannot write " + std::to_string(body.size()) + " bytes to " + s3_uri(bucket, key),
               [&](double remaining) -> std::optional<Failure> {
                 HttpRequest request;
                 request.method = "PUT";
                 request.upload = body;
                 request.timeout_seconds = remaining;
                 request.headers = extra_headers;
                 auto response = send(std::move(request), bucket, key, {}, payload_hash);
                 if (response.transport_error != 0 || response.status < 200 || response.status >= 300)
                   return http_failure(response, bucket, key);
                 return std::nullopt;
               });
}

void S3Client::create_bucket(std::string_view bucket) {
  with_retries("cannot create bucket s3://" + std::string(bucket), [&](double remaining) -> std::optional<Failure> {
    HttpRequest request;
    request.method = "PUT";
    request.timeout_seconds = remaining;
    auto response = send(std::move(request), bucket, "", {});
    if (response.status == 409) return std::nullopt;  // BucketAlreadyOwnedByYou
    if (response.transport_error != 0 || response.status < 200 || response.status >= 300)
      return http_failure(response, bucket, "");
    return std::nullopt;
  });
}

std::string S3Client::presign_get(std::string_view bucket, std::string_view key, uint64_t expires_seconds,
                                  std::string_view amz_date) const {
  Target where = target(bucket, key);
  SigningInput input;
  input.method = "GET";
  input.encoded_path = where.encoded_path;
  input.headers.emplace_back("host", where.host);
  return where.url + "?" + signer_.presign_query(std::move(input), amz_date, expires_seconds);
}

}  // namespace weightstream::s3
