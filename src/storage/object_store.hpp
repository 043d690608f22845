#pragma once
// What the Storage of every object store (s3://, gs://, az://) needs of its service, internal to
// the storage layer: list one level of a prefix, an object's size and stored checksums,
// and a ranged read into memory, each already retried under the shared policy. One
// Storage implementation (object_store_storage.cpp) does the rest for all of them: names
// under the prefix, sizes seen, reads split into parallel pieces, whole objects checked
// against their stored checksums.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weightstream/options.hpp"
#include "weightstream/storage.hpp"

namespace weightstream::storage {

/// One object of a listing.
struct ListedKey {
  std::string key;
  uint64_t size = 0;
};

/// An object's size and the checksums its store keeps of it whole.
struct ObjectMetadata {
  uint64_t size = 0;
  /// Base64 of the big-endian CRC-32C of the whole object; empty when the store has none.
  std::string crc32c;
  /// Base64 of the SHA-256 of the whole object; empty when the store has none.
  std::string sha256;
  /// How messages name those checksums ("x-amz-checksum-crc32c", "crc32c").
  std::string crc32c_name = "crc32c";
  std::string sha256_name = "sha256";
};

/// One bucket (or container) of one service. Thread-safe.
class ObjectStore {
 public:
  virtual ~ObjectStore() = default;
  /// The object's URI for messages ("gs://bucket/key"); with an empty key, the bucket's.
  virtual std::string uri(std::string_view key) const = 0;
  /// The objects directly under `prefix` (empty, or ending in '/'): keys below the next
  /// '/' are left out, as a directory listing leaves out its subdirectories' files.
  virtual std::vector<ListedKey> list(std::string_view prefix) = 0;
  /// The object's size, and with `checksums` the whole-object checksums the store keeps.
  /// Throws Error(kNotFound) naming the object when it is missing.
  virtual ObjectMetadata metadata(std::string_view key, bool checksums) = 0;
  /// Reads bytes [offset, offset + size of segments) into `segments`, one after another,
  /// in one request. With `whole_object_size` (offset 0, one segment holding the object),
  /// the store may check the bytes against its checksums in the same request.
  virtual void read(std::string_view key, uint64_t offset, std::span<const std::span<std::byte>> segments,
                    std::optional<uint64_t> whole_object_size) = 0;
  /// The transfer settings the reads run under (request_bytes, max_connections,
  /// max_attempts of S3Options: one set for every object store).
  virtual const S3Options& transfer() const = 0;
  /// Its client's requests, retries and checksum mismatches so far.
  virtual StorageStats stats() const = 0;
};

/// The Storage of the objects under `prefix` of `store`: a flat directory.
std::unique_ptr<Storage> make_object_store_storage(std::unique_ptr<ObjectStore> store, std::string prefix);

}  // namespace weightstream::storage
