// The load layer (load.hpp): feeds a Checkpoint's stream into a LoadSession (each rank reads only
// the byte ranges it needs, and the session receives the pieces as the source completes
// them), the identity layout, and the plain load and digest built on it.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <optional>
#include <thread>

#include "base/parallel.hpp"
#include "base/text.hpp"
#include "weightstream/error.hpp"
#include "weightstream/load.hpp"

namespace weightstream {
namespace {

using Clock = std::chrono::steady_clock;

/// The dtype and shape a session sees of a checkpoint tensor: its own, except that a tensor
/// of a sub-byte dtype (F4, F6) is bytes (U8 of its byte count), as parameters hold whole bytes.
struct TensorShape {
  Dtype dtype;
  std::span<const int64_t> shape;
  std::vector<int64_t> bytes_shape;  ///< storage for the U8 shape
};

TensorShape session_shape(const CheckpointTensor& tensor) {
  if (dtype_bits(tensor.dtype) % 8 == 0) return {tensor.dtype, tensor.shape, {}};
  return {Dtype::kU8, {}, {static_cast<int64_t>(tensor.bytes)}};
}

/// Hands every piece of a stream to the session as a piece of its named tensor, with the
/// piece's keepalive (its staging buffer or mapped window), so copies onto a GPU need not
/// be waited for one by one. On the host, tensors the session can take in place are read
/// straight into parameter storage.
class SessionSink final : public TensorSink {
 public:
  SessionSink(const Checkpoint& checkpoint, const LoadPlan& plan, LoadSession& session)
      : plan_(plan), session_(session) {
    shapes_.reserve(plan.reads.size());
    for (const PlannedTensor& read : plan.reads) shapes_.push_back(session_shape(checkpoint.tensors()[read.tensor]));
    for (TensorShape& shape : shapes_) {
      if (!shape.bytes_shape.empty()) shape.shape = shape.bytes_shape;
    }
  }

  std::byte* direct_destination(size_t request) override {
    const PlannedTensor& read = plan_.reads[request];
    if (read.targets.size() != 1 || read.runs > 1) return nullptr;
    const TensorShape& shape = shapes_[request];
    const Parameter& parameter = session_.layout().parameters()[read.targets[0].first];
    return session_.direct_destination(parameter.parts[read.targets[0].second].tensor, shape.dtype, shape.shape,
                                       read.range.offset, read.range.length);
  }

  /// Host parameters take their bytes by a copy on the CPU: straight out of the file's
  /// mapping, rather than read into staging first and copied again (a tensor-parallel rank's
  /// column slices). A GPU's copies want pinned staging.
  bool takes_views() const override { return !session_.layout().device().is_cuda(); }

  /// Staged pieces may come packed: a column window as exactly its bytes (on a GPU one copy
  /// into the rank's compact part), slices of many small tensors in one staging buffer.
  bool takes_packed_runs() const override { return true; }

  void consume(TensorPiece&& piece) override { session_.load(view_of(std::move(piece))); }

  /// A read's pieces are one batch of the session: on a GPU its small tensors and column
  /// windows land in one copy and are written out by one kernel.
  void consume_batch(std::span<TensorPiece> pieces) override {
    std::vector<TensorView> views;
    views.reserve(pieces.size());
    for (TensorPiece& piece : pieces) views.push_back(view_of(std::move(piece)));
    session_.load(views);
  }

  void finish() override { session_.settle(); }

 private:
  TensorView view_of(TensorPiece&& piece) const {
    const CheckpointTensor& tensor = *piece.tensor;
    const TensorShape& shape = shapes_[piece.request];
    const PlannedTensor& read = plan_.reads[piece.request];
    // A packed piece: its runs, one per `stride` bytes of the tensor, back to back.
    const uint64_t run = piece.packed ? read.range.length : 0;
    const uint64_t stride = piece.packed ? read.stride : 0;
    const uint64_t runs = piece.packed ? piece.bytes.size() / run : 0;
    return TensorView{.name = tensor.name,
                      .dtype = shape.dtype,
                      .shape = shape.shape,
                      .data = piece.bytes.data(),
                      .offset = read.range.offset + piece.offset,
                      .bytes = piece.packed ? (runs - 1) * stride + run : piece.bytes.size(),
                      .packed_run = run,
                      .packed_stride = stride,
                      .lifetime = piece.lent ? SourceLifetime::kKeepalive : SourceLifetime::kCall,
                      .keepalive = std::move(piece.keepalive)};
  }

  const LoadPlan& plan_;
  LoadSession& session_;
  std::vector<TensorShape> shapes_;  // parallel to plan_.reads
};

/// The identity layout of the tensors not marked in `skipped` (parallel to the checkpoint's
/// tensors, or empty: none skipped); each skipped tensor is declared skipped with `reason`.
ModelLayout identity_layout_without(const Checkpoint& checkpoint, const std::vector<bool>& skipped,
                                    const std::string& reason) {
  ModelLayout layout;
  layout.set_description("identity layout of " + checkpoint.uri());
  const auto& tensors = checkpoint.tensors();
  for (size_t index = 0; index < tensors.size(); ++index) {
    const CheckpointTensor& tensor = tensors[index];
    if (!skipped.empty() && skipped[index]) {
      layout.add_skipped_tensor(tensor.name, reason);
      continue;
    }
    TensorShape shape = session_shape(tensor);
    std::vector<int64_t> dimensions = shape.bytes_shape.empty() ? tensor.shape : shape.bytes_shape;
    Parameter parameter;
    parameter.name = tensor.name;
    parameter.dtype = shape.dtype;
    parameter.load_dtype = shape.dtype;
    parameter.shape = dimensions;
    ParameterPart part;
    part.tensor = tensor.name;
    part.shape = dimensions;
    part.rows = part.tensor_rows();
    part.columns = part.tensor_columns();
    part.rule = "identity";
    parameter.parts.push_back(std::move(part));
    layout.add_parameter(std::move(parameter));
  }
  return layout;
}

/// The tensors of a host load (--io auto, the default, or mmap) that are handed out in place,
/// as addresses in a private copy-on-write mapping of their shard (a private view borrowed from its storage):
/// the page cache's pages, no copy, and no fresh page to zero. The mappings are the load's
/// own, never the storage's read mapping, so a write into a loaded tensor reaches no later
/// read of the checkpoint.
struct InPlaceTensors {
  std::vector<bool> taken;                     ///< parallel to Checkpoint::tensors()
  std::vector<Bytes> mappings;  ///< private views of whole shards, parallel to Checkpoint::shards(); empty where unused
  uint64_t tensors = 0;
  uint64_t bytes = 0;
  uint64_t shards_mapped = 0;
};

constexpr const char* kInPlaceReason = "taken in place from a copy-on-write mapping of its shard (--io auto or mmap)";

/// Whether a tensor of a local shard can be handed out in place: it has bytes, and its
/// offset in the file (so its address, the mapping being page-aligned) is a multiple of its
/// element size (a whole byte for sub-byte dtypes, which load as bytes). The others go to
/// the arena.
bool in_place_candidate(const CheckpointTensor& tensor) {
  uint64_t element_bytes = std::max<uint64_t>(dtype_bits(tensor.dtype) / 8, 1);
  return tensor.bytes > 0 && tensor.offset % element_bytes == 0;
}

/// Picks the tensors taken in place, maps each shard holding one, once (with
/// `copy_unmappable`, a shard on a file system that cannot map files is left to the arena
/// instead of failing the load), and maps the page cache's pages of those shards into the
/// process in `piece_bytes` pieces on up to `threads` threads (cold, the pieces are read from
/// disk in parallel; warm, the page-table work is shared out). `progress` is told on this thread as pieces finish, over `total`
/// bytes (the whole load); when it throws, the other threads stop after their piece. Throws
/// Error(kIo) naming the shard when it cannot be mapped, its size is no longer the one
/// recorded at open, or it shrinks while its pages are mapped.
InPlaceTensors map_in_place(const Checkpoint& checkpoint, uint64_t total, uint64_t piece_bytes, unsigned threads,
                            bool copy_unmappable, const ProgressCallback& progress) {
  const auto& tensors = checkpoint.tensors();
  const auto& shards = checkpoint.shards();
  InPlaceTensors in_place;
  in_place.taken.assign(tensors.size(), false);
  in_place.mappings.resize(shards.size());
  Storage& storage = checkpoint.storage();
  const bool views = storage.lends_views();  // local files: S3 shards go to the arena
  std::vector<uint64_t> shard_bytes(shards.size(), 0);
  for (const CheckpointTensor& tensor : tensors) {
    if (views && in_place_candidate(tensor)) shard_bytes[tensor.shard] += tensor.bytes;
  }
  struct Piece {
    size_t shard;
    uint64_t offset, length;
  };
  std::vector<Piece> pieces;
  for (size_t s = 0; s < shards.size(); ++s) {
    if (shard_bytes[s] == 0) continue;
    try {
      in_place.mappings[s] = storage.borrow(shards[s].name, 0, shards[s].size, {.sharing = BorrowOptions::Sharing::kPrivate});
    } catch (const Error& error) {
      // A file system that cannot map files (ENODEV: some FUSE and network mounts) leaves
      // the shard to the arena at --io auto, which reads it as pread would; --io mmap was
      // asked to map, and says why it cannot.
      if (!copy_unmappable || error.code() != ErrorCode::kUnsupported) throw;
      shard_bytes[s] = 0;
      continue;
    }
    ++in_place.shards_mapped;
    in_place.bytes += shard_bytes[s];
    for (uint64_t offset = 0; offset < shards[s].size; offset += piece_bytes) {
      pieces.push_back({s, offset, std::min(piece_bytes, shards[s].size - offset)});
    }
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    in_place.taken[i] = shard_bytes[tensors[i].shard] > 0 && in_place_candidate(tensors[i]);
    in_place.tensors += in_place.taken[i] ? 1 : 0;
  }
  // Progress counts the file bytes mapped, scaled to the tensor bytes they hold.
  uint64_t file_bytes = 0;
  for (const Piece& piece : pieces) file_bytes += piece.length;

  std::atomic<uint64_t> mapped{0};
  detail::run_parallel(pieces.size(), threads, [&](size_t worker, size_t p) {
    const Piece& piece = pieces[p];
    populate_view(in_place.mappings[piece.shard], piece.offset, piece.length, storage.object_uri(shards[piece.shard].name));
    uint64_t done = mapped.fetch_add(piece.length) + piece.length;
    // Progress from the calling thread only (a callback that throws, as an interrupted
    // Python caller's does, stops the other threads after their piece).
    if (progress && worker == 0) {
      progress(static_cast<uint64_t>(static_cast<double>(in_place.bytes) * done / file_bytes), total);
    }
  });
  if (progress && in_place.bytes > 0) progress(in_place.bytes, total);
  return in_place;
}


}  // namespace

TensorRequest PlannedTensor::request() const { return {tensor, range, runs, stride}; }

std::vector<TensorRequest> LoadPlan::requests() const {
  std::vector<TensorRequest> result;
  result.reserve(reads.size());
  for (const PlannedTensor& read : reads) result.push_back(read.request());
  return result;
}

LoadPlan LoadPlan::subset(std::span<const size_t> indices) const {
  LoadPlan plan;
  for (size_t index : indices) {
    plan.reads.push_back(reads.at(index));
    plan.bytes_to_read += reads[index].request().run_bytes();
  }
  return plan;
}

namespace {

/// The reads of a tensor that fills the parts `targets` of `layout` (its shape checked
/// against theirs): one part's rows, a contiguous range; one part's column window of its
/// rows, a run per row (`stride` the row's bytes); several parts of disjoint whole rows (a
/// sectioned split), one range each (sections that meet, one range); anything else (parts
/// sharing rows), the whole tensor.
/// Parts with no rows on this rank read nothing.
std::vector<PlannedTensor> plan_tensor_reads(const ModelLayout& layout, size_t index, uint64_t tensor_bytes,
                                             uint64_t element_bytes,
                                             const std::vector<std::pair<size_t, size_t>>& targets) {
  auto part_of = [&](const std::pair<size_t, size_t>& target) -> const ParameterPart& {
    return layout.parameters()[target.first].parts[target.second];
  };
  auto rows_range = [&](const ParameterPart& part) {
    const uint64_t row_bytes = static_cast<uint64_t>(part.tensor_columns()) * element_bytes;
    return ByteRange{static_cast<uint64_t>(part.row_begin) * row_bytes, static_cast<uint64_t>(part.rows) * row_bytes};
  };
  const PlannedTensor whole{index, {0, tensor_bytes}, false, targets};
  if (targets.size() == 1) {
    const ParameterPart& part = part_of(targets[0]);
    if (part.elements() == 0) return {};
    if (part.contiguous()) {
      PlannedTensor read{index, rows_range(part), false, targets};
      read.slice = read.range.length < tensor_bytes;
      return {read};
    }
    const uint64_t row_bytes = static_cast<uint64_t>(part.tensor_columns()) * element_bytes;
    PlannedTensor read{index,
                       {static_cast<uint64_t>(part.row_begin) * row_bytes +
                            static_cast<uint64_t>(part.column_begin) * element_bytes,
                        static_cast<uint64_t>(part.columns) * element_bytes},
                       true, targets};
    if (part.rows > 1) {
      read.runs = static_cast<uint64_t>(part.rows);
      read.stride = row_bytes;
    }
    return {read};
  }
  std::vector<PlannedTensor> sections;
  for (const auto& target : targets) {
    const ParameterPart& part = part_of(target);
    if (!part.contiguous()) return {whole};
    if (part.elements() == 0) continue;
    const ByteRange range = rows_range(part);
    for (const PlannedTensor& other : sections) {
      // Two parts of the same rows (a tensor filling two parameters): read it once, whole.
      if (range.offset < other.range.offset + other.range.length && other.range.offset < range.offset + range.length) {
        return {whole};
      }
    }
    sections.push_back({index, range, range.length < tensor_bytes, {target}});
  }
  // Sections that meet (all of them at tp 1) are one read.
  std::ranges::sort(sections, {}, [](const PlannedTensor& read) { return read.range.offset; });
  std::vector<PlannedTensor> reads;
  for (PlannedTensor& section : sections) {
    if (!reads.empty() && reads.back().range.offset + reads.back().range.length == section.range.offset) {
      PlannedTensor& read = reads.back();
      read.range.length += section.range.length;
      read.slice = read.range.length < tensor_bytes;
      read.targets.push_back(section.targets[0]);
      continue;
    }
    reads.push_back(std::move(section));
  }
  return reads;
}

}  // namespace

LoadPlan plan_layout_load(const ModelLayout& layout, const Checkpoint& checkpoint) {
  LoadPlan plan;
  std::vector<std::string> unmatched, misfits;
  std::vector<bool> present(layout.parameters().size());
  for (size_t index = 0; index < checkpoint.tensors().size(); ++index) {
    const CheckpointTensor& tensor = checkpoint.tensors()[index];
    TensorRoute route = layout.route(tensor.name);
    if (route.kind == TensorRoute::Kind::kUnmatched) {
      unmatched.push_back(tensor.name + " (" + checkpoint.shard_uri(tensor.shard) + ")");
      continue;
    }
    if (route.kind != TensorRoute::Kind::kParameter) {
      plan.unused.push_back({index, route.reason});
      continue;
    }
    TensorShape shape = session_shape(tensor);
    if (!shape.bytes_shape.empty()) shape.shape = shape.bytes_shape;
    bool fits = true;
    for (const auto& [parameter_index, part_index] : route.targets) {
      const Parameter& parameter = layout.parameters()[parameter_index];
      const ParameterPart& part = parameter.parts[part_index];
      if (!std::ranges::equal(shape.shape, part.shape)) {
        fits = false;
        misfits.push_back(tensor.name + " has shape " + shape_text(tensor.shape) + " but parameter " + parameter.name +
                          " (part '" + part.id + "', rule " + part.rule + ") expects " + shape_text(part.shape));
      }
    }
    if (!fits || tensor.bytes == 0) continue;  // a misfit fails below; an empty tensor reads nothing
    std::vector<PlannedTensor> reads =
        plan_tensor_reads(layout, index, tensor.bytes, dtype_bits(shape.dtype) / 8, route.targets);
    if (reads.empty()) plan.unused.push_back({index, "no rows on this rank"});
    for (PlannedTensor& read : reads) {
      plan.bytes_to_read += read.request().run_bytes();
      plan.reads.push_back(std::move(read));
    }
  }
  WS_EXPECT(unmatched.empty(), ErrorCode::kModel,
            std::to_string(unmatched.size()) + " tensors of " + checkpoint.uri() + " match no parameter of " +
                layout.description() + " and no ignore rule: " + detail::join_limited(unmatched, 20));
  // Each misfit names two shapes and a rule: the first two tell what is wrong (a wider or
  // narrower model, another architecture), a count the rest.
  WS_EXPECT(misfits.empty(), ErrorCode::kModel,
            std::to_string(misfits.size()) + (misfits.size() == 1 ? " tensor of " : " tensors of ") + checkpoint.uri() +
                (misfits.size() == 1 ? " does not fit " : " do not fit ") + layout.description() + ": " +
                detail::join_limited(misfits, 2));
  for (const std::string& name : layout.wanted_tensors()) {
    if (!checkpoint.find(name)) plan.missing.push_back(name);
  }
  return plan;
}

StreamStats stream_into_session(const Checkpoint& checkpoint, const LoadPlan& plan, LoadSession& session,
                                const StreamOptions& options, const ProgressCallback& progress) {
  std::vector<TensorRequest> requests = plan.requests();
  SessionSink sink(checkpoint, plan, session);
  return stream_tensors_for_device(session.layout().device(), checkpoint, requests, sink, options, progress);
}

LayoutLoad load_layout(ModelLayout& layout, const Checkpoint& checkpoint, LoadMode mode, const StreamOptions& options,
                       const ProgressCallback& progress, std::optional<LayerCommit> commit) {
  auto start = Clock::now();
  LoadPlan plan = plan_layout_load(layout, checkpoint);
  LoadSession session(layout);
  session.begin(mode, TensorFormat::kCheckpoint, commit);
  LayoutLoad result;
  result.stream = stream_into_session(checkpoint, plan, session, options, progress);
  session.finish();
  result.counters = session.counters();
  result.stream.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

ModelLayout identity_layout(const Checkpoint& checkpoint) { return identity_layout_without(checkpoint, {}, {}); }

LoadedCheckpoint load_checkpoint(const Checkpoint& checkpoint, const Device& device, const StreamOptions& options,
                                 const ProgressCallback& progress) {
  require_device(device);
  // Timed from here: allocating the arena is part of the load; creating the CUDA context
  // (in require_device) is not, as a caller that loads onto a GPU has one already.
  auto start = Clock::now();
  const auto& tensors = checkpoint.tensors();
  InPlaceTensors in_place;
  if (!device.is_cuda() && (options.local_io == LocalIo::kAuto || options.local_io == LocalIo::kMmap)) {
    // Threads beyond the cores only contend for the page tables (a probe on 2 cores:
    // bench/HISTORY.md, "Figures once in source comments").
    unsigned threads = std::min(options.concurrency, std::max(1u, std::thread::hardware_concurrency()));
    in_place = map_in_place(checkpoint, checkpoint.tensor_bytes(), options.chunk_bytes, threads,
                            options.local_io == LocalIo::kAuto, progress);
  }

  // Everything not taken in place goes through the one load path, into an arena.
  LoadedCheckpoint loaded;
  loaded.layout = identity_layout_without(checkpoint, in_place.taken, kInPlaceReason);
  try {
    // Every tensor of the identity layout is written whole, or the load throws and the
    // arena goes with it: zeroing it first would only cost time.
    loaded.layout.allocate(device, loaded.layout.cold_load_contents());
  } catch (const Error& error) {
    WS_FAIL(error.code(), "cannot load " + checkpoint.uri() + " (" + std::to_string(tensors.size()) + " tensors) onto " +
                              device.name() + ": " + error.what());
  }
  ProgressCallback arena_progress = progress;
  if (progress && in_place.bytes > 0) {
    arena_progress = [&progress, done_before = in_place.bytes](uint64_t done, uint64_t arena_total) {
      progress(done_before + done, done_before + arena_total);
    };
  }
  loaded.stats = load_layout(loaded.layout, checkpoint, LoadMode::kCold, options, arena_progress).stream;

  loaded.tensors.resize(tensors.size());
  size_t parameter = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!in_place.taken.empty() && in_place.taken[i]) {
      std::byte* data = in_place.mappings[tensors[i].shard].writable + tensors[i].offset;
      loaded.tensors[i] = {i, data, tensors[i].bytes, true};
    } else {
      loaded.tensors[i] = {i, loaded.layout.parameters()[parameter++].data, tensors[i].bytes, false};
    }
  }
  if (in_place.shards_mapped > 0) {
    loaded.mappings = std::make_shared<const std::vector<Bytes>>(std::move(in_place.mappings));
    // The counters cover the whole load: the mapped tensors were delivered (and read, by
    // the populating mmap of each shard) without staging.
    loaded.stats.tensors += in_place.tensors;
    loaded.stats.bytes += in_place.bytes;
    loaded.stats.bytes_read += in_place.bytes;
    loaded.stats.reads += in_place.shards_mapped;
    std::vector<bool> shard_touched(checkpoint.shards().size(), false);
    for (const CheckpointTensor& tensor : tensors) shard_touched[tensor.shard] = shard_touched[tensor.shard] || tensor.bytes > 0;
    loaded.stats.shards_read = static_cast<uint64_t>(std::count(shard_touched.begin(), shard_touched.end(), true));
  }
  // Every tensor is loaded, empty ones included: the plan reads nothing for those, so the
  // stream does not count them, but inspect, Python and a caller's loop over the result do.
  loaded.stats.tensors = tensors.size();
  loaded.stats.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return loaded;
}

std::vector<std::vector<TensorDigest>> digest_checkpoint(const Checkpoint& checkpoint, const std::vector<HashKind>& kinds,
                                                         const Device& device, const StreamOptions& options,
                                                         StreamStats* stats, const ProgressCallback& progress) {
  require_device(device);
  if (!device.is_cuda()) return digest_streamed(checkpoint, kinds, options, stats, progress);
  WS_EXPECT(!kinds.empty(), ErrorCode::kInvalidArgument, "cannot digest " + checkpoint.uri() + ": no hash kind asked for");
  // The bytes land on the device through the one load path and are hashed from there, so
  // the digest covers what the device holds.
  auto start = Clock::now();
  LoadedCheckpoint loaded = load_checkpoint(checkpoint, device, options, progress);
  const auto& tensors = checkpoint.tensors();
  constexpr uint64_t kReadbackBytes = 64 * kMiB;  // per hashing thread
  // Hashing is the slow part (SHA-256 runs at a few GB/s a core): several threads, each
  // with its own pinned readback buffer and copy stream, within the memory limit.
  unsigned hardware = std::max(1u, std::thread::hardware_concurrency());
  unsigned threads = static_cast<unsigned>(
      std::clamp<size_t>(std::min<size_t>(options.concurrency, hardware), 1, std::max<size_t>(tensors.size(), 1)));
  uint64_t buffer_bytes = std::clamp<uint64_t>(options.memory_limit / threads, 4096, kReadbackBytes);
  DeviceCopier readback(device, threads);

  std::vector<std::vector<TensorDigest>> digests(kinds.size(), std::vector<TensorDigest>(tensors.size()));
  std::vector<std::optional<Buffer>> host(threads);  // one per worker, made on its first tensor
  detail::run_parallel(tensors.size(), threads, [&](size_t worker, size_t i) {
    auto lane = static_cast<unsigned>(worker);
    if (!host[worker]) host[worker].emplace(Device{}, buffer_bytes, HostMemory::kPinned);
    std::vector<Hasher> hashers;
    for (HashKind kind : kinds) hashers.emplace_back(kind);
    for (uint64_t done = 0; done < tensors[i].bytes; done += buffer_bytes) {
      uint64_t length = std::min(buffer_bytes, tensors[i].bytes - done);
      readback.copy_to_host(host[worker]->data(), loaded.tensors[i].data + done, length, lane, tensors[i].name);
      for (Hasher& hasher : hashers) hasher.update(std::span<const std::byte>(host[worker]->data(), length));
    }
    for (size_t k = 0; k < kinds.size(); ++k) digests[k][i] = {tensors[i].name, hashers[k].finish()};
  });
  if (stats) {
    *stats = loaded.stats;
    stats->peak_staging_bytes = std::max(stats->peak_staging_bytes, buffer_bytes * threads);
    stats->seconds = std::chrono::duration<double>(Clock::now() - start).count();
  }
  return digests;
}

std::vector<TensorDigest> digest_checkpoint(const Checkpoint& checkpoint, HashKind kind, const Device& device,
                                            const StreamOptions& options, StreamStats* stats,
                                            const ProgressCallback& progress) {
  return std::move(digest_checkpoint(checkpoint, std::vector<HashKind>{kind}, device, options, stats, progress).front());
}

std::string checkpoint_content_digest(const Checkpoint& checkpoint, const StreamOptions& options, StreamStats* stats,
                                      const ProgressCallback& progress) {
  return content_digest(checkpoint, digest_checkpoint(checkpoint, HashKind::kXxh64, Device{}, options, stats, progress));
}

ModelConfig checkpoint_model_config(const Checkpoint& checkpoint) {
  WS_EXPECT(checkpoint.config_json().has_value(), ErrorCode::kNotFound,
            checkpoint.uri() + " has no config.json beside its shards: it is needed to build the model layout");
  return parse_model_config(checkpoint.uri() + "/config.json", *checkpoint.config_json());
}

}  // namespace weightstream
