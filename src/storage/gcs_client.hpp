#pragma once
// Google Cloud Storage's JSON API with retries (internal to the storage layer): object
// metadata, listings, ranged media downloads, and bucket creation and small uploads for test
// fixtures and tools. https://cloud.google.com/storage/docs/json_api/v1/objects
// Every failure is one weightstream::Error naming the gs:// object, the HTTP status, the
// service's reason and the attempts; no secret appears in it.

#include <atomic>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "storage/gcs_credentials.hpp"
#include "storage/http_client.hpp"
#include "storage/object_store.hpp"
#include "storage/retry_policy.hpp"
#include "weightstream/options.hpp"
#include "weightstream/storage.hpp"

namespace weightstream::gcs {

/// Whether `bucket` follows GCS's naming rules (https://cloud.google.com/storage/docs/buckets#naming).
bool valid_bucket_name(std::string_view bucket);

/// "gs://bucket/key".
std::string gcs_uri(std::string_view bucket, std::string_view key);

/// One page of an objects.list response.
struct ListPage {
  std::vector<storage::ListedKey> objects;
  std::vector<std::string> prefixes;
  std::string next_page_token;  ///< empty on the last page
};
/// Parses an objects.list response body. Throws Error(kFormat) on malformed JSON, an item
/// without a name, or a size that is not a whole number of bytes below 2^64 (the API sends
/// sizes as decimal strings).
ListPage parse_list_page(std::string_view json);

/// The parts of a JSON API error body ({"error":{"code":…,"message":…,"errors":[{"reason":…}]}}).
struct ErrorBody {
  std::string reason;   ///< errors[0].reason, e.g. "notFound"
  std::string message;  ///< error.message
};
/// Parses an error body leniently: anything else yields empty fields. Fields are cut short.
ErrorBody parse_error_body(std::string_view json);

/// Thread-safe client of one GCS endpoint (Google's, or an emulator's).
class GcsClient {
 public:
  /// Picks the endpoint and the credentials now (a bad key file fails here). Reads run under
  /// the transfer fields of `transfer` (connections, timeouts, attempts, request size).
  GcsClient(const GcsOptions& options, const S3Options& transfer);

  const S3Options& transfer() const noexcept { return transfer_; }
  /// "https://storage.googleapis.com", or the emulator's URL.
  const std::string& endpoint() const noexcept { return endpoint_; }
  const TokenSource& credentials() const noexcept { return tokens_; }

  /// objects.get: the object's size and CRC-32C. Throws Error(kNotFound) for a missing object.
  storage::ObjectMetadata metadata(std::string_view bucket, std::string_view key);
  /// One objects.list page under `prefix`, with `delimiter` rolling deeper names into prefixes.
  ListPage list_page(std::string_view bucket, std::string_view prefix, std::string_view delimiter,
                     std::string_view page_token);
  /// Every object under `prefix`, following page tokens. Throws Error(kNotFound) for a
  /// missing bucket, Error(kFormat) if the server repeats a token or passes `max_pages`.
  std::vector<storage::ListedKey> list_objects(std::string_view bucket, std::string_view prefix,
                                               std::string_view delimiter, size_t max_pages = 1'000'000);
  /// Reads bytes [offset, offset + size of segments) in one ranged media download, checking
  /// Content-Range and the length. With `whole_object_size` (offset 0, one segment, the whole
  /// object), a plain download checked against the CRC-32C in x-goog-hash.
  void get_range(std::string_view bucket, std::string_view key, uint64_t offset,
                 std::span<const std::span<std::byte>> segments, std::optional<uint64_t> whole_object_size);

  /// buckets.insert (an existing bucket is fine). For test fixtures and tools.
  void create_bucket(std::string_view bucket, std::string_view project = "weightstream-test");
  /// A simple media upload of a small object. For test fixtures and tools.
  void put_object(std::string_view bucket, std::string_view key, std::string_view body);

  /// Its requests, retries and whole-object checksum mismatches so far.
  StorageStats stats() const noexcept { return {requests_.load(), retries_.load(), checksum_failures_.load()}; }
  /// Pooled HTTP handles created so far (connection reuse keeps this small).
  size_t connections_opened() const { return http_.handles_created(); }

 private:
  storage::HttpResponse send(storage::HttpRequest request);
  storage::AttemptFailure http_failure(const storage::HttpResponse& response, std::string_view bucket,
                                       std::string_view key, bool listing, bool& token_renewed);
  void with_retries(const std::string& operation,
                    const std::function<std::optional<storage::AttemptFailure>(double)>& attempt);
  std::string object_path(std::string_view bucket, std::string_view key) const;

  S3Options transfer_;
  std::string endpoint_;
  TokenSource tokens_;
  storage::RetryPolicy retry_;
  storage::HttpClient http_;
  std::atomic<uint64_t> requests_{0};
  std::atomic<uint64_t> retries_{0};
  std::atomic<uint64_t> checksum_failures_{0};
};

}  // namespace weightstream::gcs
