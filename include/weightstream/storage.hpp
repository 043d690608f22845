#pragma once
/// @file storage.hpp
/// The storage layer: URIs, and the Storage interface (list, stat, read a byte range, lend
/// a byte range) with its backends: local files and S3-compatible object storage. Mapping
/// files, mapping their pages ahead of a read and probing the page cache all happen here,
/// behind borrow(). Knows nothing of tensors.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weightstream/options.hpp"

namespace weightstream {

/// A parsed checkpoint location.
struct Uri {
  enum class Scheme { kFile, kS3, kGcs, kAzure, kHttp };
  Scheme scheme = Scheme::kFile;
  /// The text as given.
  std::string text;
  /// kFile: absolute or relative path. kS3, kGcs, kAzure: key or prefix (no leading '/'). kHttp: URL.
  std::string path;
  /// kS3, kGcs: bucket name. kAzure: container name.
  std::string bucket;
  /// kAzure: the storage account.
  std::string account;
  /// kAzure given as https://ACCOUNT.blob.core.windows.net/…: that endpoint
  /// ("https://ACCOUNT.blob.core.windows.net"); empty for az://.
  std::string endpoint;
};

/// Parses a plain path, file://PATH, s3://bucket/prefix, gs://bucket/prefix,
/// az://account/container/prefix, https://ACCOUNT.blob.core.windows.net/container/prefix or
/// http(s)://... URI.
/// Throws Error(kInvalidArgument) on an empty, malformed or unsupported URI.
Uri parse_uri(std::string_view text);

/// An object (file) in a storage root.
struct ObjectInfo {
  std::string name;  ///< name relative to the root, a plain file name
  uint64_t size = 0;
};

/// Bytes lent by Storage::borrow(): `span` stays valid, and is changed by nobody else, while
/// `keepalive` (or a copy of it) lives; the last copy gone returns them.
struct Bytes {
  std::span<const std::byte> span;
  std::shared_ptr<const void> keepalive;
  /// The same bytes, writable, when they were lent as a private view or a copy: a write
  /// changes only this process's copy, never the object. Null for a shared view.
  std::byte* writable = nullptr;
  /// True for a view of the object's pages (a mapping), false for a copy.
  bool view = false;
};

/// How Storage::borrow() lends bytes (modelled on Arrow's RandomAccessFile::ReadAt returning
/// a Buffer, with the mapping an option of the local backend).
struct BorrowOptions {
  enum class Sharing {
    kShared,   ///< a read-only view of the pages the page cache holds
    kPrivate,  ///< a copy-on-write view: writable, a write copies only the pages written
  };
  Sharing sharing = Sharing::kShared;
  /// Map the view's pages into this process before returning (reading them from disk on a
  /// cold cache), so that a later copy out of them costs only the copy. A hint: a range that
  /// cannot be mapped (a file that shrank) is left for the read of it to report.
  bool populate = false;
  /// Drop the view's pages from this process when the bytes are returned (they stay in the
  /// page cache): a reader holding only the ranges in flight keeps its resident set small.
  bool drop_when_returned = false;
  /// With populate: a range the object no longer holds (a file cut short since it was
  /// opened) throws Error(kIo) naming it, as a read would, instead of being left for a read
  /// to report: a view lent to a sink is read by no one who would.
  bool checked = false;
};

/// A byte range [offset, offset + length) of an object, a tensor or a buffer.
struct ByteRange {
  uint64_t offset = 0;
  uint64_t length = 0;
};

/// Where Storage::read_runs() puts each run: where it lies in the range read, or back to
/// back (a tensor-parallel rank's column window, or slices of many tensors, staged as
/// exactly their bytes).
enum class RunPlacement { kAtOffsets, kPacked };

/// Counters of the requests a storage root sent to its service since it was opened (object
/// stores: s3://, gs://, az://; all zero for local files). Read by the stream layer into
/// StreamStats, and by the metrics of `weightstream load` (docs/METRICS.md).
struct StorageStats {
  uint64_t requests = 0;  ///< HTTP attempts sent (reads, listings, metadata, access tokens)
  uint64_t retries = 0;   ///< attempts sent again after a retryable failure (5xx, 429, a reset, a stall)
  /// Reads whose bytes did not match the checksum the store keeps of the object (CRC-32C,
  /// SHA-256 or Content-MD5): each is read again, within the retry bound.
  uint64_t checksum_failures = 0;
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
  /// Reads the `runs` of `name` (ascending, disjoint byte ranges of the object within
  /// [offset, offset + destination.size())) into `destination`, each where it lies in that
  /// range: run r lands at destination[r.offset - offset]. What `destination` holds between
  /// runs afterwards is unspecified. With RunPlacement::kPacked the runs land back to back
  /// instead, from destination[0], and `destination` holds exactly their bytes (`offset` is
  /// then unused). A backend reads a gap between two runs with them, in one request, where
  /// that costs less than another request (run_merge_gap()); here, runs whose gap is at most
  /// run_merge_gap() share one read() (packed: into memory of its own, then copied out).
  /// Returns the bytes read from the object: the runs' and the gaps' read with them.
  /// Errors as read().
  virtual uint64_t read_runs(std::string_view name, uint64_t offset, std::span<std::byte> destination,
                             std::span<const ByteRange> runs, RunPlacement placement = RunPlacement::kAtOffsets);
  /// The largest gap between two runs that read_runs() reads rather than start another
  /// request: 64 KiB here. One more request costs about what reading 64 KiB costs on a local
  /// NVMe drive (a request's latency of 10-20 us at 3-7 GB/s), so below that a gap is
  /// cheaper read than skipped; backends that pay more per request say more (S3).
  virtual uint64_t run_merge_gap() const { return 64 * 1024; }
  /// Lends `length` bytes of `name` from `offset`. A backend that maps its objects
  /// (lends_views(): local files) returns a view of its mapping, shared or private as
  /// `options` say; every other backend reads the bytes into memory of their own (a copy,
  /// writable). Errors as read().
  virtual Bytes borrow(std::string_view name, uint64_t offset, uint64_t length, const BorrowOptions& options = {});
  /// Whether borrow() lends views of the objects' pages rather than copies (local files).
  virtual bool lends_views() const { return false; }
  /// Whether read() copies out of the views borrow() lends (local files read with
  /// LocalIo::kMmap). A reader then holds a view of its range while it reads, borrowed with
  /// drop_when_returned, and helpers may borrow ranges ahead of the readers with populate:
  /// a read of a range populated that way only copies.
  virtual bool reads_through_views() const { return false; }
  /// Whether a reader may take its bytes from borrow()'s views instead of read() (local files
  /// at --io auto or mmap; never where the caller chose pread, O_DIRECT or io_uring): the
  /// stream then lends a sink that takes views (TensorSink::takes_views) its ranges as views.
  virtual bool views_serve_reads() const { return false; }
  /// Reads in flight that this backend serves well (a hint for the stream layer).
  virtual unsigned preferred_concurrency() const { return 16; }
  /// The share (0 to 1) of `name` that the page cache holds now, from a few probes that
  /// read nothing from disk; std::nullopt where the backend cannot tell (object storage, a
  /// file system without RWF_NOWAIT).
  virtual std::optional<double> cached_share(std::string_view /*name*/) { return std::nullopt; }
  /// Its requests so far (thread-safe; zero where it sends none).
  virtual StorageStats stats() const { return {}; }
};

/// Opens the storage root that `uri` names. For a URI that names a single object the
/// root is its parent and `object` is set to its name; otherwise `object` is cleared.
std::unique_ptr<Storage> open_storage(const Uri& uri, const Options& options, std::string* object);

/// Local files under `directory`, read as `io` says (O_DIRECT and io_uring as options).
std::unique_ptr<Storage> open_local_storage(const std::string& directory, LocalIo io);

/// S3-compatible object storage under s3://bucket/prefix. Throws Error(kUnsupported)
/// where the build has no S3 support.
std::unique_ptr<Storage> open_s3_storage(const std::string& bucket, const std::string& prefix, const S3Options& options);

/// Google Cloud Storage under gs://bucket/prefix, through the JSON API: credentials from
/// options.gcs (an emulator, a service-account key file, the metadata server, or anonymous),
/// connections, request size, retries and timeouts from the transfer fields of options.s3.
/// Throws Error(kInvalidArgument) on a bucket name GCS does not allow, Error(kConfig) on an
/// unreadable or malformed key file.
std::unique_ptr<Storage> open_gcs_storage(const std::string& bucket, const std::string& prefix, const Options& options);

/// Azure Blob Storage under az://account/container/prefix (List Blobs, Get Blob Properties and
/// ranged Get Blob): endpoint and credentials from options.azure (a connection string, an
/// account key, a SAS token, a managed identity, or anonymous), connections, request size,
/// retries and timeouts from the transfer fields of options.s3. `endpoint` is the https URL
/// form's endpoint, empty for az://. Throws Error(kInvalidArgument) on an account or container
/// name Azure does not allow, Error(kConfig) on a malformed connection string, key or SAS token,
/// or credentials of another account.
std::unique_ptr<Storage> open_azure_storage(const std::string& account, const std::string& container,
                                            const std::string& prefix, const Options& options,
                                            const std::string& endpoint = {});

/// A presigned GET URL for s3://bucket/key (SigV4 query-string authentication), valid for
/// `expires_seconds` (1 to 604800) from `amz_date` (YYYYMMDDTHHMMSSZ; empty means now), signed
/// with the credentials, region, endpoint and addressing of `options`. Throws
/// Error(kInvalidArgument) on a bad expiry or date, and credential resolution's errors.
std::string presign_s3_url(const std::string& bucket, const std::string& key, const S3Options& options,
                           uint64_t expires_seconds, const std::string& amz_date = {});

/// Maps the pages of `length` bytes at `offset` of `view` (bytes a borrow() lent as a
/// view) into this process, from disk on a cold cache, so that touching them later does not
/// fault. `what` names the object in errors. Throws Error(kIo) when the pages are gone (the
/// object shrank since it was mapped). Does nothing for a copy.
void populate_view(const Bytes& view, uint64_t offset, uint64_t length, std::string_view what);

/// Reads a whole (small) object, refusing one larger than `max_bytes`.
std::string read_object(Storage& storage, std::string_view name, uint64_t max_bytes);

}  // namespace weightstream
