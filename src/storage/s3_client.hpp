#pragma once
// S3 operations with retries (internal to the storage layer): HeadObject, ListObjectsV2,
// ranged GetObject, and PutObject/CreateBucket for test fixtures and tools. Every failure
// is one weightstream::Error naming the bucket, key, range, HTTP status, S3 error code,
// request id and attempts; secrets never appear in it.

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "storage/http_client.hpp"
#include "storage/retry_policy.hpp"
#include "storage/s3_credentials.hpp"
#include "storage/s3_listing.hpp"
#include "storage/s3_signer.hpp"
#include "weightstream/error.hpp"
#include "weightstream/options.hpp"
#include "weightstream/storage.hpp"

namespace weightstream::s3 {

using storage::HttpClient;
using storage::HttpRequest;
using storage::HttpResponse;
using storage::HttpSettings;

/// Where requests go: scheme, host and addressing, derived from S3Options.
struct Endpoint {
  std::string scheme = "https";
  std::string authority;  ///< host[:port]
  std::string base_path;  ///< path of a custom endpoint URL, without a trailing '/'
  bool custom = false;    ///< set by an option rather than derived from the region
  S3Addressing addressing = S3Addressing::kPath;

  /// Parses options.endpoint, or derives AWS's endpoint for options.region.
  /// Throws Error(kConfig) on an endpoint that is not an http:// or https:// URL.
  static Endpoint from_options(const S3Options& options);
  /// Whether `bucket` is addressed virtual-hosted (bucket.host) under this endpoint.
  bool virtual_hosted(std::string_view bucket) const;
};

/// A request target: URL, Host header and the encoded path that SigV4 signs.
struct Target {
  std::string url;
  std::string host;
  std::string encoded_path;
};

/// Metadata of one object.
struct ObjectHead {
  uint64_t size = 0;
  std::string etag;
  std::string checksum_crc32c;  ///< base64, when the server sent x-amz-checksum-crc32c
  std::string checksum_sha256;  ///< base64, when the server sent x-amz-checksum-sha256
};

/// Thread-safe client of one S3-compatible endpoint.
class S3Client {
 public:
  /// Resolves credentials and the endpoint now (errors surface at open, not at first read).
  explicit S3Client(S3Options options);

  const S3Options& options() const noexcept { return options_; }
  const Endpoint& endpoint() const noexcept { return endpoint_; }
  const Credentials& credentials() const noexcept { return signer_.credentials(); }

  /// The target for `bucket`/`key` (key may be empty for bucket-level requests).
  Target target(std::string_view bucket, std::string_view key, const std::vector<Field>& query = {}) const;

  /// HeadObject. With `checksums`, asks for stored checksums (x-amz-checksum-mode).
  /// Throws Error(kNotFound) for a missing object, with the usual context.
  ObjectHead head_object(std::string_view bucket, std::string_view key, bool checksums = false);

  /// One ListObjectsV2 page of keys under `prefix` (with `delimiter`, keys below the next
  /// delimiter are rolled up into common prefixes).
  ListPage list_page(std::string_view bucket, std::string_view prefix, std::string_view delimiter,
                     std::string_view continuation_token, unsigned max_keys = 1000);
  /// Every object under `prefix`, following continuation tokens. Throws Error(kFormat)
  /// if the server repeats a token or exceeds `max_pages`.
  std::vector<ListedObject> list_objects(std::string_view bucket, std::string_view prefix,
                                         std::string_view delimiter, unsigned max_keys = 1000,
                                         size_t max_pages = 1'000'000);

  /// Reads bytes [offset, offset + destination.size()) of an object in one ranged GET,
  /// retried as S3Options say, and checks Content-Range and the length against the range.
  /// With `whole_object_size` set (offset 0, destination the whole object), sends a plain
  /// GET that asks for the stored checksums and verifies any it gets. `object_uri` is for
  /// messages. Returns the object's total size from Content-Range.
  uint64_t get_range(std::string_view bucket, std::string_view key, uint64_t offset, std::span<std::byte> destination,
                     std::optional<uint64_t> whole_object_size = std::nullopt);
  /// The same, with the body scattered across `segments` one after another (a range of
  /// several tensors into their own memory): one request however many segments. A whole
  /// object's checksums are checked only when it lands in one segment.
  uint64_t get_range(std::string_view bucket, std::string_view key, uint64_t offset,
                     std::span<const std::span<std::byte>> segments,
                     std::optional<uint64_t> whole_object_size = std::nullopt);

  /// PutObject of a small body, with extra headers (x-amz-checksum-crc32c, say). For test
  /// fixtures and tools; not retried beyond the usual policy.
  void put_object(std::string_view bucket, std::string_view key, std::string_view body,
                  const std::vector<Field>& extra_headers = {});
  /// CreateBucket (an existing bucket owned by the caller is fine).
  void create_bucket(std::string_view bucket);

  /// A presigned GET URL for `bucket`/`key`, valid `expires_seconds` from `amz_date`.
  std::string presign_get(std::string_view bucket, std::string_view key, uint64_t expires_seconds,
                          std::string_view amz_date) const;

  /// Its requests, retries and whole-object checksum mismatches so far.
  StorageStats stats() const noexcept { return {requests_.load(), retries_.load(), checksum_failures_.load()}; }
  /// Pooled HTTP handles created so far (connection reuse keeps this small).
  size_t connections_opened() const { return http_.handles_created(); }

  /// Why one attempt failed, and whether another may succeed (the shared retry policy's).
  using Failure = storage::AttemptFailure;
  /// storage::with_retries under this client's policy, counting its retries and masking
  /// its secrets: throws one Error that starts with `operation` ("cannot read 0+4096 bytes
  /// of s3://b/k").
  void with_retries(const std::string& operation, const std::function<std::optional<Failure>(double)>& attempt);

 private:
  HttpResponse send(HttpRequest request, std::string_view bucket, std::string_view key,
                    const std::vector<Field>& query, std::string_view payload_hash = kEmptyPayloadSha256);
  Failure http_failure(const HttpResponse& response, std::string_view bucket, std::string_view key) const;
  /// Text from a server (an error document, a header) with every occurrence of the secret
  /// key or session token masked, then cut to `limit` characters.
  std::string server_text(std::string_view text, size_t limit = std::string::npos) const;

  S3Options options_;
  Endpoint endpoint_;
  SigV4Signer signer_;
  storage::RetryPolicy retry_;
  HttpClient http_;
  std::atomic<uint64_t> requests_{0};
  std::atomic<uint64_t> retries_{0};
  std::atomic<uint64_t> checksum_failures_{0};
};

/// "s3://bucket/key".
std::string s3_uri(std::string_view bucket, std::string_view key);

}  // namespace weightstream::s3
