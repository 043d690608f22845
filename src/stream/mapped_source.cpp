// The sources of stream_tensors_for_device(). For the host and for the staged GPU path
// the streamer reads into staging (pinned for a GPU, so the copy engine reads it directly).
// The mapped GPU path is a source of its own: local shard files are mmap'd read-only;
// windows of them are registered with CUDA (cudaHostRegisterReadOnly) and handed to the
// sink in place, so the copy engine reads the page cache directly: no read(2) and no
// memcpy into staging, which is what a CPU-bound reader pool cannot avoid. Registering a
// window faults its pages in, which reads the file when the cache is cold; several workers
// register windows in parallel, so those reads overlap.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <numeric>
#include <thread>

#include "base/text.hpp"
#include "device/shared/host_registration.hpp"
#include "weightstream/error.hpp"
#include "stream/split_stream.hpp"
#include "stream/streamer.hpp"
#include "weightstream/stream.hpp"

namespace weightstream {
namespace {

// Registered windows of a mapped file: large enough that the per-call cost of
// cudaHostRegister (pinning, driver bookkeeping) is small next to the copy.
constexpr uint64_t kMappedWindowBytes = 64 * kMiB;

using Clock = std::chrono::steady_clock;

using detail::seconds_since;

uint64_t page_size() noexcept {
  static const uint64_t size = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return size;
}

/// Rethrows `error` with `context` in front of its message, keeping its code.
[[noreturn]] void rethrow_with_context(const Error& error, const std::string& context) {
  WS_FAIL(error.code(), context + ": " + error.what());
}

/// Part of one request inside one window.
struct WindowPiece {
  size_t request;
  uint64_t file_offset;
  uint64_t length;
};

/// A page-aligned range of one shard file, registered and handed out as a unit.
struct Window {
  uint32_t shard;
  uint64_t begin;
  uint64_t end;
  std::vector<WindowPiece> pieces;
};

/// Windows of at most `window_bytes` over the file ranges of `requests`, in file order:
/// ranges close together share a window, and a gap of a window or more starts a new one,
/// so a rank that reads a few slices registers only what it reads.
std::vector<Window> plan_windows(const Checkpoint& checkpoint, std::span<const TensorRequest> requests,
                                 uint64_t window_bytes) {
  const auto& tensors = checkpoint.tensors();
  // A request of several runs is mapped as its extent: the mapping holds the gaps' real
  // bytes, which the sink skips, and registering a window costs the same either way.
  auto file_begin = [&](size_t r) { return tensors[requests[r].tensor].offset + requests[r].extent().offset; };
  std::vector<size_t> order(requests.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    uint32_t shard_a = tensors[requests[a].tensor].shard, shard_b = tensors[requests[b].tensor].shard;
    return shard_a != shard_b ? shard_a < shard_b : file_begin(a) < file_begin(b);
  });
  std::vector<Window> windows;
  for (size_t r : order) {
    const CheckpointTensor& tensor = tensors[requests[r].tensor];
    uint64_t at = file_begin(r);
    const ByteRange extent = requests[r].extent();
    WS_EXPECT(extent.offset <= tensor.bytes && extent.length <= tensor.bytes - extent.offset,
              ErrorCode::kInvalidArgument,
              "request for bytes " + std::to_string(extent.offset) + "+" + std::to_string(extent.length) +
                  " of tensor " + tensor.name + " lies outside its " + std::to_string(tensor.bytes) + " bytes");
    const uint64_t length = extent.length ? extent.length : tensor.bytes - extent.offset;
    const uint64_t end = at + length;
    while (at < end) {
      Window* window = windows.empty() ? nullptr : &windows.back();
      if (window == nullptr || window->shard != tensor.shard || at < window->begin || at >= window->begin + window_bytes) {
        uint64_t begin = at / page_size() * page_size();
        windows.push_back({tensor.shard, begin, begin, {}});
        window = &windows.back();
      }
      uint64_t piece_end = std::min(end, window->begin + window_bytes);
      window->pieces.push_back({r, at, piece_end - at});
      window->end = std::max(window->end, piece_end);
      at = piece_end;
    }
  }
  return windows;
}

/// Bounds the bytes of registered windows held at once (the mapped path's staging memory)
/// and retires finished ones. The copier's reaper thread only hands a finished window back
/// here; the workers unregister it, in parallel, before they register their next window.
/// Unregistering (unpinning every page) costs about as much as registering, and done on
/// the reaper's one thread it serialized the whole mapped load.
class WindowBudget {
 public:
  WindowBudget(uint64_t limit, size_t windows) : limit_(limit) { retired_.reserve(windows); }
  ~WindowBudget() { drain(); }

  /// Waits until window `index` is the next in plan order and `bytes` more fit (or nothing
  /// is held), unregistering retired windows meanwhile. False once cancelled. Granting
  /// windows in plan order means every earlier window holds its room before a later one
  /// does, so a sink that makes a piece wait for the consumer to take earlier tensors (the
  /// Python stream's admission) never holds the room those tensors need.
  bool acquire(size_t index, uint64_t bytes) {
    std::unique_lock lock(mutex_);
    for (;;) {
      if (cancelled_) return false;
      if (!retired_.empty()) {
        Retired window = std::move(retired_.back());
        retired_.pop_back();
        lock.unlock();
        window.unregister();
        lock.lock();
        held_ -= window.bytes;
        changed_.notify_all();
        continue;
      }
      if (index == next_grant_ && (held_ == 0 || held_ + bytes <= limit_)) break;
      changed_.wait(lock);
    }
    ++next_grant_;
    held_ += bytes;
    peak_ = std::max(peak_, held_);
    changed_.notify_all();
    return true;
  }
  /// Gives back a window's bytes at once (its registration failed).
  void release(uint64_t bytes) {
    {
      std::lock_guard lock(mutex_);
      held_ -= bytes;
    }
    changed_.notify_all();
  }
  /// Takes a window whose copies are done; never throws (it runs in a keepalive's deleter,
  /// and room for every window was reserved up front).
  void retire(std::unique_ptr<HostRegistration> registration, const std::byte* base, uint64_t bytes) noexcept {
    {
      std::lock_guard lock(mutex_);
      retired_.push_back({std::move(registration), base, bytes});
    }
    changed_.notify_all();
  }
  /// Unregisters every retired window (after the last copy, or on the way out of an error).
  void drain() noexcept {
    std::lock_guard lock(mutex_);
    for (auto& window : retired_) {
      window.unregister();
      held_ -= window.bytes;
    }
    retired_.clear();
  }
  void cancel() {
    {
      std::lock_guard lock(mutex_);
      cancelled_ = true;
    }
    changed_.notify_all();
  }
  uint64_t peak() const {
    std::lock_guard lock(mutex_);
    return peak_;
  }

 private:
  struct Retired {
    std::unique_ptr<HostRegistration> registration;
    const std::byte* base = nullptr;
    uint64_t bytes = 0;
    void unregister() noexcept {
      registration.reset();
      // Drop the window's pages from this process (they stay in the page cache), so the
      // resident set stays within the budget like staging memory would.
      ::madvise(const_cast<std::byte*>(base), bytes, MADV_DONTNEED);
    }
  };

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  uint64_t limit_;
  uint64_t held_ = 0;
  uint64_t peak_ = 0;
  size_t next_grant_ = 0;  // index of the window granted next
  bool cancelled_ = false;
  std::vector<Retired> retired_;
};

/// Bytes of a registered window: the chunk size, at least kMappedWindowBytes, at most half of
/// the memory `limit`, in whole pages.
uint64_t window_size(uint64_t chunk_bytes, uint64_t limit) {
  uint64_t window_bytes = std::min(std::max(chunk_bytes, kMappedWindowBytes), std::max(limit / 2, page_size()));
  return std::max(window_bytes / page_size() * page_size(), page_size());
}

/// Views of the shards `shard_used` names, each borrowed whole; empty for the others.
std::vector<Bytes> borrow_shards(const Checkpoint& checkpoint, const std::vector<bool>& shard_used) {
  const auto& shards = checkpoint.shards();
  std::vector<Bytes> files(shards.size());
  for (uint32_t s = 0; s < shards.size(); ++s) {
    if (shard_used[s]) files[s] = checkpoint.storage().borrow(shards[s].name, 0, shards[s].size);
  }
  return files;
}

/// Counts `windows` into `stats` (bytes read, reads, shards read); returns which of the
/// `shard_count` shards they read.
std::vector<bool> count_windows(std::span<const Window> windows, size_t shard_count, StreamStats& stats) {
  std::vector<bool> shard_used(shard_count, false);
  for (const auto& window : windows) {
    stats.bytes_read += window.end - window.begin;
    shard_used[window.shard] = true;
  }
  stats.reads = windows.size();
  stats.shards_read = static_cast<uint64_t>(std::count(shard_used.begin(), shard_used.end(), true));
  return shard_used;
}

/// Adds the bytes of each request in `windows` to `remaining`; returns their sum.
uint64_t count_request_bytes(std::span<const Window> windows, std::vector<std::atomic<uint64_t>>& remaining) {
  uint64_t total = 0;
  for (const auto& window : windows) {
    for (const auto& piece : window.pieces) {
      remaining[piece.request].fetch_add(piece.length, std::memory_order_relaxed);
      total += piece.length;
    }
  }
  return total;
}

/// Registers `window` of the shard whose view begins at `file`, its bytes already granted by
/// `budget`: the handle the window's pieces keep alive, whose last copy hands the
/// registration back to the budget. On failure the bytes go back to the budget and the error
/// names the window.
std::shared_ptr<const void> register_window(const Device& device, const Checkpoint& checkpoint,
                                            const std::shared_ptr<WindowBudget>& budget, const Window& window,
                                            const std::byte* file) {
  const uint64_t bytes = window.end - window.begin;
  const std::byte* base = file + window.begin;
  try {
    // Start the kernel's readahead of the whole window before registration faults
    // it in page by page (helps only a cold cache; free on a warm one).
    ::madvise(const_cast<std::byte*>(base), bytes, MADV_WILLNEED);
    auto* raw = new HostRegistration(device, base, bytes);
    // The sink drops the last copy of this when its copies out of the window are done:
    // the budget takes the registration back and a worker unregisters it.
    return std::shared_ptr<const void>(raw, [budget, base, bytes](const void* pointer) {
      budget->retire(std::unique_ptr<HostRegistration>(static_cast<HostRegistration*>(const_cast<void*>(pointer))),
                     base, bytes);
    });
  } catch (const Error& error) {
    budget->release(bytes);
    rethrow_with_context(error, "cannot register bytes " + std::to_string(window.begin) + "+" +
                                    std::to_string(bytes) + " of " +
                                    checkpoint.storage().object_uri(checkpoint.shards()[window.shard].name));
  }
}

/// The pieces of `window`, pointing into the shard's view at `file`, each keeping `registration`.
std::vector<TensorPiece> window_pieces(const Window& window, const std::byte* file,
                                       const std::shared_ptr<const void>& registration, const Checkpoint& checkpoint,
                                       std::span<const TensorRequest> requests) {
  std::vector<TensorPiece> pieces;
  pieces.reserve(window.pieces.size());
  for (const auto& piece : window.pieces) {
    const TensorRequest& request = requests[piece.request];
    const CheckpointTensor& tensor = checkpoint.tensors()[request.tensor];
    pieces.push_back({piece.request, &tensor, piece.file_offset - tensor.offset - request.range.offset,
                      std::span<const std::byte>(file + piece.file_offset, piece.length), registration});
  }
  return pieces;
}

StreamStats stream_mapped(const Device& device, const Checkpoint& checkpoint, std::span<const TensorRequest> requests,
                          TensorSink& sink, const StreamOptions& options, const ProgressCallback& progress) {
  auto start = Clock::now();
  uint64_t limit = std::max(options.memory_limit, page_size());
  auto windows = plan_windows(checkpoint, requests, window_size(options.chunk_bytes, limit));

  StreamStats stats;
  const std::vector<bool> shard_used = count_windows(windows, checkpoint.shards().size(), stats);

  // Each shard read is borrowed whole, as a shared view of its mapping: windows of it are
  // registered and handed to the sink, and the view lives until the stream returns.
  const std::vector<Bytes> files = borrow_shards(checkpoint, shard_used);

  auto budget = std::make_shared<WindowBudget>(limit, windows.size());
  std::vector<std::atomic<uint64_t>> remaining(requests.size());  // bytes of each request not yet consumed
  const uint64_t total = count_request_bytes(windows, remaining);
  std::atomic<size_t> next_window{0};
  std::atomic<uint64_t> enqueued{0};
  std::mutex mutex;
  std::condition_variable workers_done;
  unsigned running = 0;
  std::exception_ptr first_error;
  // Keeps the first error and stops the workers after their current window; the caller holds `mutex`.
  auto cancel = [&](std::exception_ptr error) {
    if (!first_error) first_error = error;
    next_window.store(windows.size());
    budget->cancel();
  };

  auto work = [&] {
    try {
      for (size_t index; (index = next_window.fetch_add(1)) < windows.size();) {
        const auto& window = windows[index];
        const std::byte* file = files[window.shard].span.data();
        if (!budget->acquire(index, window.end - window.begin)) return;
        std::shared_ptr<const void> registration = register_window(device, checkpoint, budget, window, file);
        // The window's pieces go to the sink together (one landing copy for its small tensors).
        std::vector<TensorPiece> delivered = window_pieces(window, file, registration, checkpoint, requests);
        sink.consume_batch(delivered);
        for (const auto& piece : window.pieces) {
          enqueued.fetch_add(piece.length, std::memory_order_relaxed);
          if (remaining[piece.request].fetch_sub(piece.length) == piece.length) sink.request_complete(piece.request);
        }
      }
    } catch (...) {
      std::lock_guard lock(mutex);
      cancel(std::current_exception());
    }
  };

  unsigned workers = static_cast<unsigned>(std::clamp<size_t>(options.concurrency, 1, std::max<size_t>(windows.size(), 1)));
  {
    std::vector<std::jthread> threads;
    for (unsigned i = 0; i < workers; ++i) {
      {
        std::lock_guard lock(mutex);
        ++running;
      }
      threads.emplace_back([&] {
        work();
        std::lock_guard lock(mutex);
        --running;
        workers_done.notify_all();
      });
    }
    std::unique_lock lock(mutex);
    while (!workers_done.wait_for(lock, std::chrono::milliseconds(100), [&] { return running == 0; })) {
      if (progress && !first_error) {
        lock.unlock();
        try {
          progress(enqueued.load(std::memory_order_relaxed), total);
          lock.lock();
        } catch (...) {
          lock.lock();
          // A throwing progress callback cancels the load, as in stream_tensors.
          cancel(std::current_exception());
        }
      }
    }
  }
  // The sink's finish() waits for its copies, which releases every window's registration.
  try {
    sink.finish();
  } catch (...) {
    if (!first_error) first_error = std::current_exception();
  }
  budget->drain();
  if (first_error) std::rethrow_exception(first_error);
  if (progress) progress(total, total);
  stats.bytes = total;
  stats.tensors = requests.size();
  stats.peak_staging_bytes = budget->peak();
  stats.seconds = seconds_since(start);
  return stats;
}

// The staged path's shape for a checkpoint the page cache holds (GpuPath::kAuto): few
// readers, small reads and little staging, so the pinned buffers the copy engine reads are
// still in the CPU's last-level cache when it reads them, and the host's memory bandwidth
// serves the page-cache copy and the DMA instead of spilling staging to DRAM and back. A
// cold disk needs the opposite (many large reads in flight). The sizes are the best of a
// sweep on an H200 (bench/RESULTS.md, "GPU load"; bench/staging_sweep.sh reruns it).
constexpr unsigned kWarmReaders = 10;
constexpr uint64_t kWarmChunkBytes = 4 * kMiB;
constexpr uint64_t kWarmStagingBytes = 160 * kMiB;
// Pages probed per shard to tell a warm checkpoint from a cold one, and the share of them
// the page cache must hold.
constexpr double kWarmShare = 0.9;

/// Whether the page cache holds (nearly) every local shard of `checkpoint`: false for
/// object storage, for a file system that cannot tell, and for a cache that was dropped.
bool page_cache_holds(const Checkpoint& checkpoint) {
  if (checkpoint.shards().empty()) return false;
  for (const auto& shard : checkpoint.shards()) {
    auto share = checkpoint.storage().cached_share(shard.name);
    if (!share || *share < kWarmShare) return false;
  }
  return true;
}

/// `options` with the warm staged shape, within the caller's own limits.
StreamOptions warm_staging(StreamOptions options) {
  options.concurrency = std::min(options.concurrency, kWarmReaders);
  options.chunk_bytes = std::min(options.chunk_bytes, kWarmChunkBytes);
  options.memory_limit = std::min(options.memory_limit, kWarmStagingBytes);
  return options;
}

GpuPath choose_path(const Checkpoint& checkpoint, const StreamOptions& options) {
  bool local = !checkpoint.shards().empty() && checkpoint.storage().lends_views();
  switch (options.gpu_path) {
    case GpuPath::kStaged: return GpuPath::kStaged;
    case GpuPath::kMapped:
    case GpuPath::kBoth:
      WS_EXPECT(local, ErrorCode::kUnsupported,
                "the " + std::string(gpu_path_name(options.gpu_path)) + " GPU path maps local files, and " +
                    checkpoint.uri() + " is not on the local file system (use --gpu-path staged or auto)");
      return options.gpu_path;
    case GpuPath::kAuto:
      // Staged: faster than mapped warm and on a par cold (bench/RESULTS.md, "GPU load"),
      // and it serves every storage.
      return GpuPath::kStaged;
  }
  return GpuPath::kStaged;
}

}  // namespace

StreamStats stream_tensors_for_device(const Device& device, const Checkpoint& checkpoint,
                                      std::span<const TensorRequest> requests, TensorSink& sink,
                                      const StreamOptions& options, const ProgressCallback& progress) {
  require_device(device);
  if (!device.is_cuda()) return stream_tensors(checkpoint, requests, sink, options, progress);
  auto staged = [&](std::span<const TensorRequest> subset, TensorSink& subset_sink, const StreamOptions& subset_options,
                    const ProgressCallback& subset_progress) {
    return stream_tensors(checkpoint, subset, subset_sink, subset_options, subset_progress, HostMemory::kPinned);
  };
  auto mapped = [&](std::span<const TensorRequest> subset, TensorSink& subset_sink, const StreamOptions& subset_options,
                    const ProgressCallback& subset_progress) {
    return stream_mapped(device, checkpoint, subset, subset_sink, subset_options, subset_progress);
  };
  // Ordered pieces (hashing, senders) need the streamer: windows are handed out by several workers.
  GpuPath path = sink.wants_ordered_pieces() || sink.wants_file_order() ? GpuPath::kStaged : choose_path(checkpoint, options);
  switch (path) {
    case GpuPath::kMapped: return mapped(requests, sink, options, progress);
    case GpuPath::kBoth: {
      // A quarter of the workers register windows; the rest read into staging.
      SplitPlan plan{options.mapped_share, std::max(2u, options.concurrency / 4)};
      return split_stream(checkpoint, requests, sink, options, progress, plan, staged, mapped);
    }
    default:
      // O_DIRECT was asked for to read the disk, whatever the cache holds.
      if (options.gpu_path == GpuPath::kAuto && options.local_io != LocalIo::kDirect && page_cache_holds(checkpoint)) {
        // In the warm shape, copies out of a mapping beat pread (bench/RESULTS.md, "GPU
        // load"): read through one, whatever the buffered read method was.
        // The shards are local files (the page cache holds them), and the local backend's
        // root is their directory.
        auto mapped_reads = open_local_storage(checkpoint.storage().root_uri(), LocalIo::kMmap);
        Storage& storage = *mapped_reads;
        return stream_tensors_through(storage, checkpoint, requests, sink, warm_staging(options), progress,
                                      HostMemory::kPinned);
      }
      return staged(requests, sink, options, progress);
  }
}

}  // namespace weightstream
