#pragma once
/// @file stream.hpp
/// The stream layer: a Checkpoint (shards, headers, index, config) opened from any
/// Storage, and the Streamer that plans reads, runs a reader pool, stages through a
/// bounded pool of buffers and delivers each completed piece to a sink.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "weightstream/device.hpp"
#include "weightstream/format.hpp"
#include "weightstream/options.hpp"
#include "weightstream/stats.hpp"
#include "weightstream/storage.hpp"

namespace weightstream {

/// One shard file of a checkpoint.
struct ShardInfo {
  std::string name;  ///< object name in the storage root
  uint64_t size = 0;
  SafetensorsHeader header;
};

/// One tensor of a checkpoint, located in its shard.
struct CheckpointTensor {
  std::string name;
  Dtype dtype = Dtype::kU8;
  std::vector<int64_t> shape;
  uint32_t shard = 0;      ///< index into Checkpoint::shards()
  uint64_t offset = 0;     ///< absolute byte offset in the shard file
  uint64_t bytes = 0;
};

/// A safetensors checkpoint: a single file, or a directory/prefix of shards with or
/// without model.safetensors.index.json. Headers are read and validated on open.
class Checkpoint {
 public:
  /// Opens `uri` (path, file://, s3://). Throws Error naming the object and the rule
  /// broken: no safetensors files, a malformed header or index, an index naming a missing
  /// shard, a tensor in two shards, index and shard headers that disagree.
  static Checkpoint open(std::string_view uri, const Options& options);
  /// Opens from an existing storage root; `single_object` limits it to one file.
  static Checkpoint open(std::shared_ptr<Storage> storage, const std::string& single_object = {});

  const std::string& uri() const noexcept { return uri_; }
  Storage& storage() const noexcept { return *storage_; }
  const std::vector<ShardInfo>& shards() const noexcept { return shards_; }
  /// Tensors in file order (shard by shard, offset by offset).
  const std::vector<CheckpointTensor>& tensors() const noexcept { return tensors_; }
  /// Index into tensors() of a tensor, or nullopt.
  std::optional<size_t> find(std::string_view name) const;
  /// The index, when the checkpoint has one.
  const std::optional<CheckpointIndex>& index() const noexcept { return index_; }
  /// Text of config.json beside the shards, when there is one.
  const std::optional<std::string>& config_json() const noexcept { return config_json_; }
  /// Sum of all tensors' bytes.
  uint64_t tensor_bytes() const noexcept;
  /// URI of shard `shard` for messages.
  std::string shard_uri(uint32_t shard) const;

 private:
  std::string uri_;
  std::shared_ptr<Storage> storage_;
  std::vector<ShardInfo> shards_;
  std::vector<CheckpointTensor> tensors_;
  std::optional<CheckpointIndex> index_;
  std::optional<std::string> config_json_;
  std::unordered_map<std::string, size_t> by_name_;
};

/// Part (or all) of one checkpoint tensor that a sink wants: one range, or `runs` ranges of
/// equal length at a fixed stride (a column window of every row of a row-major tensor).
struct TensorRequest {
  size_t tensor = 0;   ///< index into Checkpoint::tensors()
  ByteRange range;     ///< bytes within the tensor (the first run); length 0 means "to the end" (one run only)
  uint64_t runs = 1;   ///< runs of range.length bytes; run k starts at range.offset + k * stride
  uint64_t stride = 0;  ///< bytes from one run's start to the next's (at least range.length); unused for one run

  /// The bytes from the first run's start to the last run's end (range itself for one run).
  ByteRange extent() const noexcept {
    return runs <= 1 ? range : ByteRange{range.offset, (runs - 1) * stride + range.length};
  }
  /// The bytes of the runs (without the gaps between them).
  uint64_t run_bytes() const noexcept { return runs <= 1 ? range.length : runs * range.length; }
};

/// A completed run of bytes of one request, delivered to a sink.
struct TensorPiece {
  size_t request = 0;            ///< index into the request list
  const CheckpointTensor* tensor = nullptr;
  /// Offset of `bytes` within the request's extent (TensorRequest::extent(), from its
  /// first byte). A piece of a request of several runs may span the gaps between its runs:
  /// the bytes there are unspecified (a staged read leaves them unread), and a sink takes
  /// only the runs' bytes from it.
  uint64_t offset = 0;
  std::span<const std::byte> bytes;
  /// Keeps the staging buffer that holds `bytes` alive; a sink that finishes with the
  /// bytes later (an async copy) keeps a copy of it. Empty for direct reads.
  std::shared_ptr<const void> keepalive;
  /// `bytes` are lent by the storage (Storage::borrow: a view of its pages): unchanged while
  /// `keepalive` lives, and holding them takes no staging buffer the stream waits for.
  bool lent = false;
  /// `bytes` hold only the runs of a request of several runs, back to back, from the run
  /// that starts at `offset` (a whole number of runs; TensorSink::takes_packed_runs()).
  bool packed = false;
};

/// Receives pieces. Called from reader threads: pieces of different requests arrive
/// concurrently; pieces of one request arrive in order when StreamOptions say so.
class TensorSink {
 public:
  virtual ~TensorSink() = default;
  /// Host memory the bytes of request `request` may be read into directly (no staging),
  /// or nullptr to stage them. Must hold the whole requested range. Not asked for a request
  /// of several runs: those are always staged.
  virtual std::byte* direct_destination(size_t /*request*/) { return nullptr; }
  /// Whether pieces of one request must arrive in offset order (hashing needs this).
  virtual bool wants_ordered_pieces() const { return false; }
  /// Whether every piece must arrive in the stream's read order, one at a time: shard by
  /// shard, by offset, which is file order (and offset order within each request). An
  /// update sender wants it: its receiver writes a layer once all of it has arrived, and a
  /// checkpoint stores a layer's tensors together, so in file order layers complete one
  /// after another; in the readers' order they interleave, and most of each bucket waits.
  virtual bool wants_file_order() const { return false; }
  /// Whether pieces may point straight into storage's views of the files (its mapping of
  /// them) instead of staging: for a sink that copies the bytes elsewhere anyway (an update
  /// sender into its bucket, a session into host parameters). Where views serve reads
  /// (Storage::views_serve_reads: local files at --io auto or mmap), reads that are not
  /// direct then cost no copy into staging and no staging memory (a read of runs: the view of
  /// its whole range); a piece's keepalive holds its view.
  virtual bool takes_views() const { return false; }
  /// Whether pieces of a request of several runs may arrive packed (TensorPiece::packed):
  /// staged as exactly the runs' bytes, so a rank's column window of a row-split tensor
  /// costs no staging, copy or transfer for the other ranks' columns. The stream then also
  /// gathers small requests that lie apart in a file into one read and one staging buffer
  /// (each piece still one contiguous range of its tensor), so a rank that keeps slices of
  /// many small tensors (MoE experts, their scales) reads them in few reads. For a sink
  /// that copies pieces onwards (to a GPU); never with ordered pieces.
  virtual bool takes_packed_runs() const { return false; }
  /// Consumes one piece. An exception fails the stream and cancels the other readers.
  virtual void consume(TensorPiece&& piece) = 0;
  /// Consumes the pieces of one read together (a sink that copies them to a GPU lands a
  /// read's many small tensors in one copy). The stream calls it instead of consume() for
  /// every read whose pieces may arrive together (none wants ordered pieces); by default
  /// it consumes them one by one.
  virtual void consume_batch(std::span<TensorPiece> pieces) {
    for (TensorPiece& piece : pieces) consume(std::move(piece));
  }
  /// All pieces of request `request` were consumed.
  virtual void request_complete(size_t /*request*/) {}
  /// Every request completed; waits for work the sink still has in flight.
  virtual void finish() {}
};

/// Counters of one stream.
struct StreamStats {
  uint64_t tensors = 0;             ///< requests delivered whole
  uint64_t bytes = 0;               ///< bytes delivered to the sink
  uint64_t bytes_read = 0;          ///< bytes read from storage (merged reads may cover gaps; see Storage::read_runs)
  uint64_t reads = 0;               ///< read calls issued
  uint64_t peak_staging_bytes = 0;  ///< most staging memory held at once
  uint64_t shards_read = 0;         ///< distinct shards touched
  double seconds = 0;
  /// Where the readers' time went, summed over the reader threads of the staged path: in
  /// storage reads, handing pieces to the sink (for a GPU: issuing their copies), and
  /// waiting for a free staging buffer. Against readers x seconds, they show what bounds a
  /// load (bench/staging_sweep.sh prints them).
  double read_seconds = 0;
  double deliver_seconds = 0;
  double staging_wait_seconds = 0;
  /// The storage's requests during the stream (Storage::stats(): zero for local files).
  uint64_t storage_requests = 0;
  uint64_t storage_retries = 0;
  uint64_t storage_checksum_failures = 0;
  double gbps() const noexcept { return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0; }
};

/// The counters of `stats` by name: tensors, bytes, bytes_read, reads, shards_read, seconds,
/// gbps, peak_staging_bytes, read_seconds, deliver_seconds, staging_wait_seconds, storage_requests,
/// storage_retries, storage_checksum_failures.
std::vector<StatField> stat_fields(const StreamStats& stats);

/// Progress callback: bytes delivered so far, bytes in total. Called on the thread that
/// started the load, about every 100 ms. An exception it throws cancels the load: the
/// readers stop after their current read and the load throws that exception.
using ProgressCallback = std::function<void(uint64_t done, uint64_t total)>;

/// Streams `requests` from `checkpoint` into `sink`. Every requested byte is delivered
/// exactly once or the call throws; the first error cancels the other readers and is the
/// error thrown. Staging memory never exceeds options.memory_limit. The runs of a request
/// of several runs are read into one staging buffer per read of at most the chunk size,
/// laid out as in the tensor, by Storage::read_runs (one request or one gathered copy for
/// many runs, not one a row), and delivered as one piece per read.
StreamStats stream_tensors(const Checkpoint& checkpoint, std::span<const TensorRequest> requests,
                           TensorSink& sink, const StreamOptions& options,
                           const ProgressCallback& progress = {}, HostMemory staging = HostMemory::kPageable);

/// Streams `requests` into `sink` for a consumer that writes into memory of `device`: for
/// the host, as stream_tensors() does (pageable staging, direct reads where the sink offers
/// them); for a GPU, by the path options.gpu_path names:
///  - staged: pinned staging buffers, which the copy engine reads directly;
///  - auto: staged; for local shards the page cache holds (probed with RWF_NOWAIT reads of a
///    few pages each) and buffered reads, in the warm shape: at most 10 readers, reads of at
///    most 4 MiB copied out of a mapping of each shard (as --io mmap reads), and at most
///    160 MiB of staging, so staging stays in the CPU's cache, with prefetchers mapping the
///    reads' pages ahead (StreamOptions::prefetchers);
///  - mapped: local shards mapped read-only, windows of them registered with CUDA and
///    handed to the sink in place (no read(2), no copy into staging); a piece's keepalive
///    holds its window's registration, and registered windows stay within
///    options.memory_limit. Throws Error(kUnsupported) for storage that is not local files.
///  - both: the two at once on disjoint tensors, options.mapped_share of the bytes mapped (a
///    quarter of the workers register windows, the rest read into staging; each side gets
///    its share of options.memory_limit). Local files only, as mapped.
/// The sink keeps a piece's keepalive until its copy of the bytes has landed.
StreamStats stream_tensors_for_device(const Device& device, const Checkpoint& checkpoint,
                                      std::span<const TensorRequest> requests, TensorSink& sink,
                                      const StreamOptions& options, const ProgressCallback& progress = {});

/// Requests for every tensor of the checkpoint, whole.
std::vector<TensorRequest> all_tensors(const Checkpoint& checkpoint);

/// Hash functions for digests.
enum class HashKind { kSha256, kXxh64 };
std::string_view hash_name(HashKind kind) noexcept;
HashKind parse_hash(std::string_view text);

/// The digest of one tensor's bytes (lowercase hex).
struct TensorDigest {
  std::string name;
  std::string hex;
};

/// Hashes every tensor's bytes as streamed (host staging), in bounded memory. Digests are
/// in the order of Checkpoint::tensors(). (digest_checkpoint in load.hpp also hashes what a
/// GPU holds after a load.)
std::vector<TensorDigest> digest_streamed(const Checkpoint& checkpoint, HashKind kind, const StreamOptions& options,
                                          StreamStats* stats = nullptr, const ProgressCallback& progress = {});
/// The same for several hash kinds in one pass over the bytes: result[k] holds the digests
/// of kinds[k]. Throws Error(kInvalidArgument) for no kinds.
std::vector<std::vector<TensorDigest>> digest_streamed(const Checkpoint& checkpoint, const std::vector<HashKind>& kinds,
                                                       const StreamOptions& options, StreamStats* stats = nullptr,
                                                       const ProgressCallback& progress = {});

/// The content digest of a checkpoint: xxh64 (16 lowercase hex digits) over every tensor's
/// name, dtype, shape and the xxh64 of its bytes, in name order. Two checkpoints have the
/// same content digest when they hold the same tensors with the same bytes, whatever their
/// shard files, index or config.json. `xxh64` are the tensors' digests of kind kXxh64 in
/// the order of Checkpoint::tensors() (digest_streamed's, digest_checkpoint's); throws
/// Error(kInvalidArgument) naming the checkpoint when they are not those.
std::string content_digest(const Checkpoint& checkpoint, std::span<const TensorDigest> xxh64);

/// Incremental hasher over one of the HashKinds.
class Hasher {
 public:
  explicit Hasher(HashKind kind);
  Hasher(Hasher&&) noexcept;
  Hasher& operator=(Hasher&&) noexcept;
  ~Hasher();
  void update(std::span<const std::byte> bytes);
  /// Lowercase hex of the digest; the hasher is spent afterwards.
  std::string finish();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace weightstream
