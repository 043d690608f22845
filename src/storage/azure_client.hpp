#pragma once
// Azure Blob Storage's REST API with retries (internal to the storage layer): Get Blob
// Properties, List Blobs and ranged Get Blob, for one account of one endpoint (Azure's, or an
// emulator's). https://learn.microsoft.com/rest/api/storageservices/blob-service-rest-api
// Every failure is one weightstream::Error naming the az:// object, the HTTP status, the
// service's error code and request id, and the attempts; no secret appears in it.

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "storage/azure_credentials.hpp"
#include "storage/azure_listing.hpp"
#include "storage/http_client.hpp"
#include "storage/object_store.hpp"
#include "storage/retry_policy.hpp"
#include "weightstream/options.hpp"
#include "weightstream/storage.hpp"

namespace weightstream::azure {

/// "az://account/container/key".
std::string azure_uri(std::string_view account, std::string_view container, std::string_view key);

/// Thread-safe client of one account's Blob service.
class BlobClient {
 public:
  /// Picks the endpoint and the credentials now (a malformed connection string, key or SAS
  /// fails here). Reads run under the transfer fields of `transfer`.
  BlobClient(std::string account, std::string_view uri_endpoint, const AzureOptions& options, const S3Options& transfer);

  const S3Options& transfer() const noexcept { return transfer_; }
  const std::string& account() const noexcept { return credentials_.account(); }
  const std::string& endpoint() const noexcept { return credentials_.endpoint(); }
  const Credentials& credentials() const noexcept { return credentials_; }

  /// Get Blob Properties: the blob's size. Throws Error(kNotFound) for a missing blob or container.
  storage::ObjectMetadata metadata(std::string_view container, std::string_view key);
  /// One List Blobs page under `prefix`, with `delimiter` rolling deeper names into prefixes.
  ListPage list_page(std::string_view container, std::string_view prefix, std::string_view delimiter,
                     std::string_view marker);
  /// Every blob under `prefix`, following markers. Throws Error(kNotFound) for a missing
  /// container, Error(kFormat) if the server repeats a marker or passes `max_pages`.
  std::vector<storage::ListedKey> list_blobs(std::string_view container, std::string_view prefix,
                                             std::string_view delimiter, size_t max_pages = 1'000'000);
  /// Reads bytes [offset, offset + size of segments) in one Get Blob with x-ms-range,
  /// checking Content-Range and the length. With `whole_object_size` (offset 0, one segment,
  /// the whole blob), a plain Get Blob checked against the blob's Content-MD5 where it has one.
  void get_range(std::string_view container, std::string_view key, uint64_t offset,
                 std::span<const std::span<std::byte>> segments, std::optional<uint64_t> whole_object_size);

  /// Create Container (an existing one is fine). For test fixtures and tools.
  void create_container(std::string_view container);
  /// Put Blob of a small block blob. For test fixtures and tools.
  void put_blob(std::string_view container, std::string_view key, std::string_view body);

  /// Its requests, retries and whole-object checksum mismatches so far.
  StorageStats stats() const noexcept { return {requests_.load(), retries_.load(), checksum_failures_.load()}; }

 private:
  /// A request to `encoded_path` (below the endpoint's path) with x-ms-date, x-ms-version,
  /// the SAS or the Authorization; `signature` receives what may be echoed back of it.
  storage::HttpRequest build(std::string method, const std::string& encoded_path, std::vector<storage::Field> query,
                             std::vector<storage::Field> headers, std::string& signature);
  storage::HttpResponse send(const storage::HttpRequest& request);
  storage::AttemptFailure http_failure(const storage::HttpResponse& response, std::string_view container,
                                       std::string_view key, bool listing, bool& token_renewed,
                                       const std::string& signature);
  void with_retries(const std::string& operation,
                    const std::function<std::optional<storage::AttemptFailure>(double)>& attempt);
  std::string redact(std::string text, const std::string& signature) const;

  S3Options transfer_;
  Credentials credentials_;
  storage::RetryPolicy retry_;
  storage::HttpClient http_;
  std::atomic<uint64_t> requests_{0};
  std::atomic<uint64_t> retries_{0};
  std::atomic<uint64_t> checksum_failures_{0};
};

}  // namespace weightstream::azure
