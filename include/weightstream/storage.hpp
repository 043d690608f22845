#pragma once
/// @file storage.hpp
/// The storage layer: URIs, and the Storage interface (list, stat, ranged read) with its
/// backends: local files and S3-compatible object storage. Knows nothing of tensors.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weightstream/options.hpp"

namespace weightstream {

/// A parsed checkpoint location.
struct Uri {
  enum class Scheme { kFile, kS3, kHttp };
  Scheme scheme = Scheme::kFile;
  /// The text as given.
  std::string text;
  /// kFile: absolute or relative path. kS3: key or prefix (no leading '/'). kHttp: URL.
  std::string path;
  /// kS3: bucket name.
  std::string bucket;
};

/// Parses a plain path, file://PATH, s3://bucket/prefix or http(s)://... URI.
/// Throws Error(kInvalidArgument) on an empty, malformed or unsupported URI.
Uri parse_uri(std::string_view text);

/// An object (file) in a storage root.
struct ObjectInfo {
  std::string name;  ///< name relative to the root, a plain file name
  uint64_t size = 0;
};

/// A flat namespace of objects under one root: a local directory or an S3 prefix.
/// Implementations are thread-safe: reads may run concurrently from many threads.
class Storage {
 public:
  virtual ~Storage() = default;
  /// The root, as a URI for messages ("/models/llama", "s3://bucket/prefix").
  virtual std::string root_uri() const = 0;
  /// The URI of one object, for messages.
  virtual std::string object_uri(std::string_view name) const = 0;
  /// Objects directly under the root (not recursive), in no particular order.
  virtual std::vector<ObjectInfo> list() = 0;
  /// Size of one object. Throws Error(kNotFound) when it does not exist.
  virtual ObjectInfo stat(std::string_view name) = 0;
  /// Reads exactly destination.size() bytes of `name` starting at `offset`. Throws an
  /// Error naming the object, the range, the operation and the cause; never returns short.
  virtual void read(std::string_view name, uint64_t offset, std::span<std::byte> destination) = 0;
  /// Reads consecutive bytes of `name` from `offset` into `segments`, one after another:
  /// the first segment takes the first segment.size() bytes, and so on (a scatter read, as
  /// preadv). Errors as read(). Here one read() per segment; a backend that pays per
  /// request (S3) reads them in as few requests as it would read their sum.
  virtual void read_scattered(std::string_view name, uint64_t offset, std::span<const std::span<std::byte>> segments);
  /// Whether prefetch() and release() do anything here: true where reads copy out of a
  /// mapping of the file, whose pages must be mapped into this process before the copy.
  virtual bool prefetches() const { return false; }
  /// Prepares a later read() of exactly this range (maps its pages), so that read costs
  /// only its copy. A hint: never throws, never changes what a read returns; a range that
  /// is not there (a file that shrank) is left for the read to report.
  virtual void prefetch(std::string_view /*name*/, uint64_t /*offset*/, uint64_t /*length*/) noexcept {}
  /// The caller is done reading this range: its pages may be dropped from this process
  /// (they stay in the page cache). Never throws.
  virtual void release(std::string_view /*name*/, uint64_t /*offset*/, uint64_t /*length*/) noexcept {}
  /// Reads in flight that this backend serves well (a hint for the stream layer).
  virtual unsigned preferred_concurrency() const { return 16; }
  /// Local path of an object when the backend is the local file system, else empty.
  virtual std::string local_path(std::string_view /*name*/) const { return {}; }
  /// The same objects read by the local read method `io` (a storage of its own, with its
  /// own descriptors and mappings), or null where reads are not local (S3).
  virtual std::unique_ptr<Storage> with_local_io(LocalIo /*io*/) const { return nullptr; }
};

/// Opens the storage root that `uri` names. For a URI that names a single object the
/// root is its parent and `object` is set to its name; otherwise `object` is cleared.
std::unique_ptr<Storage> open_storage(const Uri& uri, const Options& options, std::string* object);

/// Local files under `directory`, read as `io` says (O_DIRECT and io_uring as options).
std::unique_ptr<Storage> open_local_storage(const std::string& directory, LocalIo io);

/// S3-compatible object storage under s3://bucket/prefix. Throws Error(kUnsupported)
/// where the build has no S3 support.
std::unique_ptr<Storage> open_s3_storage(const std::string& bucket, const std::string& prefix, const S3Options& options);

/// A presigned GET URL for s3://bucket/key (SigV4 query-string authentication), valid for
/// `expires_seconds` (1 to 604800) from `amz_date` (YYYYMMDDTHHMMSSZ; empty means now), signed
/// with the credentials, region, endpoint and addressing of `options`. Throws
/// Error(kInvalidArgument) on a bad expiry or date, and credential resolution's errors.
std::string presign_s3_url(const std::string& bucket, const std::string& key, const S3Options& options,
                           uint64_t expires_seconds, const std::string& amz_date = {});

/// Reads a whole (small) object, refusing one larger than `max_bytes`.
std::string read_object(Storage& storage, std::string_view name, uint64_t max_bytes);

}  // namespace weightstream
