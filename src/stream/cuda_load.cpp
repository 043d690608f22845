// Loading and digesting a checkpoint into CUDA memory. Two paths, chosen by
// StreamOptions::gpu_path:
//  - staged: the streamer reads into pinned staging buffers; each piece is copied
//    asynchronously to its final offset on the device, and its buffer returns to the pool
//    when the copy is done. Works for every storage.
//  - mapped: local shard files are mmap'd read-only; windows of them are registered with
//    CUDA (cudaHostRegisterReadOnly) and the copy engine reads the page cache directly: no
//    read(2) and no memcpy into staging, which is what a CPU-bound reader pool cannot
//    avoid. Registering a window faults its pages in, which reads the file when the cache
//    is cold; several workers register windows in parallel, so those reads overlap.
#include "stream/cuda_load.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

#include "weightstream/error.hpp"
#include "base/errno_text.hpp"

namespace weightstream {
namespace {

// Tensors start on 256-byte boundaries in the arena, as in the host load: what CUDA
// allocations guarantee and what vectorized kernels and DLPack consumers expect.
constexpr uint64_t kTensorAlignment = 256;
// Copy streams per load. One H2D stream already saturates PCIe from pinned memory; a few
// let copies from different workers queue independently.
constexpr unsigned kCopyLanes = 4;
// Registered windows of a mapped file: large enough that the per-call cost of
// cudaHostRegister (pinning, driver bookkeeping) is small next to the copy.
constexpr uint64_t kMappedWindowBytes = 64 * kMiB;
// Readback buffers of a digest, per hashing thread.
constexpr uint64_t kReadbackBytes = 64 * kMiB;

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

uint64_t page_size() {
  static const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return page;
}

/// Offsets of every tensor in one arena, and the arena's size.
std::vector<uint64_t> arena_offsets(const Checkpoint& checkpoint, uint64_t* total) {
  const auto& tensors = checkpoint.tensors();
  std::vector<uint64_t> offsets(tensors.size());
  uint64_t size = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    offsets[i] = size;
    size = (size + tensors[i].bytes + kTensorAlignment - 1) / kTensorAlignment * kTensorAlignment;
  }
  *total = size;
  return offsets;
}

/// Rethrows `error` with `context` in front of its message, keeping its code.
[[noreturn]] void rethrow_with_context(const Error& error, const std::string& context) {
  WS_FAIL(error.code(), context + ": " + error.what());
}

/// Streamed pieces copied asynchronously from pinned staging to their arena offsets.
class DeviceArenaCopySink final : public TensorSink {
 public:
  DeviceArenaCopySink(DeviceCopier& copier, std::byte* arena, const std::vector<uint64_t>& offsets)
      : copier_(copier), arena_(arena), offsets_(offsets) {}

  void consume(TensorPiece&& piece) override {
    // Round-robin over the lanes: readers run concurrently, and no lane should hold them up.
    unsigned lane = next_lane_.fetch_add(1, std::memory_order_relaxed);
    copier_.copy_to_device(arena_ + offsets_[piece.request] + piece.offset, piece.bytes.data(), piece.bytes.size(),
                           std::move(piece.keepalive), lane, piece.tensor->name);
  }
  void finish() override { copier_.synchronize(); }

 private:
  DeviceCopier& copier_;
  std::byte* arena_;
  const std::vector<uint64_t>& offsets_;
  std::atomic<unsigned> next_lane_{0};
};

StreamStats load_staged(const Checkpoint& checkpoint, const Device& device, std::byte* arena,
                        const std::vector<uint64_t>& offsets, const StreamOptions& options,
                        const ProgressCallback& progress) {
  DeviceCopier copier(device, kCopyLanes);
  DeviceArenaCopySink sink(copier, arena, offsets);
  auto requests = all_tensors(checkpoint);
  return stream_tensors(checkpoint, requests, sink, options, progress, HostMemory::kPinned);
}

/// A whole file mapped read-only. Unmapped on destruction.
class MappedFile {
 public:
  MappedFile(const std::string& path, uint64_t expected_size) : path_(path) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    WS_EXPECT(fd >= 0, errno == ENOENT ? ErrorCode::kNotFound : ErrorCode::kIo,
              "cannot open " + path + " to map it: " + detail::errno_text(errno));
    struct stat status {};
    if (::fstat(fd, &status) != 0) {
      int error = errno;
      ::close(fd);
      WS_FAIL(ErrorCode::kIo, "cannot stat " + path + ": " + detail::errno_text(error));
    }
    size_ = static_cast<uint64_t>(status.st_size);
    if (size_ != expected_size) {
      ::close(fd);
      WS_FAIL(ErrorCode::kIo, path + " is " + std::to_string(size_) + " bytes, not the " +
                                  std::to_string(expected_size) + " it had when the checkpoint was opened (changed while loading?)");
    }
    if (size_ > 0) {
      void* data = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
      int error = errno;
      ::close(fd);  // the mapping keeps the file
      WS_EXPECT(data != MAP_FAILED, ErrorCode::kIo,
                "cannot map " + std::to_string(size_) + " bytes of " + path + ": " + detail::errno_text(error));
      data_ = static_cast<const std::byte*>(data);
    } else {
      ::close(fd);
    }
  }
  ~MappedFile() {
    if (data_) ::munmap(const_cast<std::byte*>(data_), size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::byte* data() const noexcept { return data_; }
  const std::string& path() const noexcept { return path_; }

 private:
  std::string path_;
  const std::byte* data_ = nullptr;
  uint64_t size_ = 0;
};

/// Part of one tensor inside one window.
struct WindowPiece {
  size_t tensor;
  uint64_t file_offset;
  uint64_t length;
};

/// A page-aligned range of one shard file, registered and copied as a unit.
struct Window {
  uint32_t shard;
  uint64_t begin;
  uint64_t end;
  std::vector<WindowPiece> pieces;
};

std::vector<Window> plan_windows(const Checkpoint& checkpoint, uint64_t window_bytes) {
  std::vector<Window> windows;
  const auto& tensors = checkpoint.tensors();  // file order: shard by shard, offset by offset
  size_t first = 0;
  while (first < tensors.size()) {
    uint32_t shard = tensors[first].shard;
    size_t last = first;
    while (last < tensors.size() && tensors[last].shard == shard) ++last;
    uint64_t region_begin = UINT64_MAX;
    uint64_t region_end = 0;
    for (size_t t = first; t < last; ++t) {
      region_begin = std::min(region_begin, tensors[t].offset);
      region_end = std::max(region_end, tensors[t].offset + tensors[t].bytes);
    }
    region_begin = region_begin / page_size() * page_size();
    size_t shard_first_window = windows.size();
    for (uint64_t begin = region_begin; begin < region_end; begin += window_bytes) {
      windows.push_back({shard, begin, std::min(begin + window_bytes, region_end), {}});
    }
    for (size_t t = first; t < last; ++t) {
      uint64_t begin = tensors[t].offset;
      uint64_t end = begin + tensors[t].bytes;
      for (uint64_t at = begin; at < end;) {
        auto& window = windows[shard_first_window + (at - region_begin) / window_bytes];
        uint64_t piece_end = std::min(end, window.end);
        window.pieces.push_back({t, at, piece_end - at});
        at = piece_end;
      }
    }
    first = last;
  }
  // A shard of empty tensors leaves a window with nothing to copy.
  std::erase_if(windows, [](const Window& window) { return window.pieces.empty(); });
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

  /// Waits until `bytes` more fit (or nothing is held), unregistering retired windows
  /// meanwhile. False once cancelled.
  bool acquire(uint64_t bytes) {
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
        continue;
      }
      if (held_ == 0 || held_ + bytes <= limit_) break;
      changed_.wait(lock);
    }
    held_ += bytes;
    peak_ = std::max(peak_, held_);
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
  bool cancelled_ = false;
  std::vector<Retired> retired_;
};

StreamStats load_mapped(const Checkpoint& checkpoint, const Device& device, std::byte* arena,
                        const std::vector<uint64_t>& offsets, const StreamOptions& options,
                        const ProgressCallback& progress) {
  auto start = Clock::now();
  const auto& tensors = checkpoint.tensors();
  const auto& shards = checkpoint.shards();
  uint64_t limit = std::max(options.memory_limit, page_size());
  uint64_t window_bytes = std::min(std::max(options.chunk_bytes, kMappedWindowBytes), std::max(limit / 2, page_size()));
  window_bytes = std::max(window_bytes / page_size() * page_size(), page_size());
  auto windows = plan_windows(checkpoint, window_bytes);

  StreamStats stats;
  std::vector<bool> shard_used(shards.size(), false);
  uint64_t total = 0;
  for (const auto& window : windows) {
    stats.bytes_read += window.end - window.begin;
    shard_used[window.shard] = true;
    for (const auto& piece : window.pieces) total += piece.length;
  }
  stats.reads = windows.size();
  stats.shards_read = static_cast<uint64_t>(std::count(shard_used.begin(), shard_used.end(), true));

  std::vector<std::unique_ptr<MappedFile>> files(shards.size());
  for (uint32_t s = 0; s < shards.size(); ++s) {
    if (shard_used[s]) files[s] = std::make_unique<MappedFile>(checkpoint.storage().local_path(shards[s].name), shards[s].size);
  }

  auto budget = std::make_shared<WindowBudget>(limit, windows.size());
  DeviceCopier copier(device, kCopyLanes);
  std::atomic<size_t> next_window{0};
  std::atomic<uint64_t> enqueued{0};
  std::mutex mutex;
  std::condition_variable workers_done;
  unsigned running = 0;
  std::exception_ptr first_error;

  auto work = [&](unsigned lane) {
    try {
      for (size_t index; (index = next_window.fetch_add(1)) < windows.size();) {
        const auto& window = windows[index];
        const auto& file = *files[window.shard];
        uint64_t bytes = window.end - window.begin;
        if (!budget->acquire(bytes)) return;
        const std::byte* base = file.data() + window.begin;
        std::shared_ptr<const void> registration;
        try {
          // Start the kernel's readahead of the whole window before registration faults
          // it in page by page (helps only a cold cache; free on a warm one).
          ::madvise(const_cast<std::byte*>(base), bytes, MADV_WILLNEED);
          auto* raw = new HostRegistration(device, base, bytes);
          // The copier drops this when the window's last copy is done: the budget takes the
          // registration back and a worker unregisters it.
          registration = std::shared_ptr<const void>(raw, [budget, base, bytes](const void* pointer) {
            budget->retire(std::unique_ptr<HostRegistration>(static_cast<HostRegistration*>(const_cast<void*>(pointer))),
                           base, bytes);
          });
        } catch (const Error& error) {
          budget->release(bytes);
          rethrow_with_context(error, "cannot register bytes " + std::to_string(window.begin) + "+" +
                                          std::to_string(bytes) + " of " + file.path());
        }
        for (const auto& piece : window.pieces) {
          const auto& tensor = tensors[piece.tensor];
          copier.copy_to_device(arena + offsets[piece.tensor] + (piece.file_offset - tensor.offset),
                                file.data() + piece.file_offset, piece.length, registration, lane, tensor.name);
          enqueued.fetch_add(piece.length, std::memory_order_relaxed);
        }
      }
    } catch (...) {
      std::lock_guard lock(mutex);
      if (!first_error) first_error = std::current_exception();
      next_window.store(windows.size());  // the others stop after their current window
      budget->cancel();
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
      threads.emplace_back([&, i] {
        work(i);
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
          if (!first_error) first_error = std::current_exception();
          next_window.store(windows.size());
          budget->cancel();
        }
      }
    }
  }
  if (first_error) {
    try {
      copier.synchronize();
    } catch (...) {
      // The first error is the one the caller sees.
    }
    std::rethrow_exception(first_error);
  }
  copier.synchronize();
  budget->drain();
  if (progress) progress(total, total);
  stats.bytes = total;
  stats.tensors = tensors.size();
  stats.peak_staging_bytes = budget->peak();
  stats.seconds = seconds_since(start);
  return stats;
}

GpuPath choose_path(const Checkpoint& checkpoint, const StreamOptions& options) {
  bool local = !checkpoint.shards().empty();
  for (const auto& shard : checkpoint.shards()) local = local && !checkpoint.storage().local_path(shard.name).empty();
  switch (options.gpu_path) {
    case GpuPath::kStaged: return GpuPath::kStaged;
    case GpuPath::kMapped:
      WS_EXPECT(local, ErrorCode::kUnsupported,
                "the mapped GPU path reads local files, and " + checkpoint.uri() + " is not on the local file system " +
                    "(use --gpu-path staged or auto)");
      return GpuPath::kMapped;
    case GpuPath::kAuto:
      // Staged: measured on an H200 at 27-30 GB/s warm against 15-16 for mapped, and on a
      // par cold (bench/RESULTS.md); it also serves every storage and O_DIRECT.
      return GpuPath::kStaged;
  }
  return GpuPath::kStaged;
}

}  // namespace

LoadedCheckpoint load_checkpoint_cuda(const Checkpoint& checkpoint, const Device& device, const StreamOptions& options,
                                      const ProgressCallback& progress) {
  WS_EXPECT(device.is_cuda(), ErrorCode::kInvalidArgument, "load_checkpoint_cuda needs a CUDA device, not " + device.name());
  require_device(device);
  // Timed from here: allocating the arena is part of the load; creating the CUDA context
  // (in require_device) is not, as a caller that loads onto a GPU has one already.
  auto start = Clock::now();
  uint64_t total = 0;
  auto offsets = arena_offsets(checkpoint, &total);
  LoadedCheckpoint loaded;
  try {
    loaded.arena = Buffer(device, std::max<uint64_t>(total, 1));
  } catch (const Error& error) {
    rethrow_with_context(error, "cannot load " + checkpoint.uri() + " (" + std::to_string(checkpoint.tensors().size()) +
                                    " tensors) onto " + device.name());
  }
  auto path = choose_path(checkpoint, options);
  loaded.stats = path == GpuPath::kMapped ? load_mapped(checkpoint, device, loaded.arena.data(), offsets, options, progress)
                                          : load_staged(checkpoint, device, loaded.arena.data(), offsets, options, progress);
  const auto& tensors = checkpoint.tensors();
  loaded.tensors.resize(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) loaded.tensors[i] = {i, loaded.arena.data() + offsets[i], tensors[i].bytes};
  loaded.stats.seconds = seconds_since(start);
  return loaded;
}

std::vector<TensorDigest> digest_checkpoint_cuda(const Checkpoint& checkpoint, HashKind kind, const Device& device,
                                                 const StreamOptions& options, StreamStats* stats,
                                                 const ProgressCallback& progress) {
  auto start = Clock::now();
  auto loaded = load_checkpoint_cuda(checkpoint, device, options, progress);
  const auto& tensors = checkpoint.tensors();

  // Hashing is the slow part (SHA-256 runs at a few GB/s a core): several threads, each
  // with its own pinned readback buffer and copy stream, within the memory limit.
  unsigned hardware = std::max(1u, std::thread::hardware_concurrency());
  unsigned threads = static_cast<unsigned>(
      std::clamp<size_t>(std::min<size_t>(options.concurrency, hardware), 1, std::max<size_t>(tensors.size(), 1)));
  uint64_t buffer_bytes = std::clamp<uint64_t>(options.memory_limit / threads, page_size(), kReadbackBytes);
  DeviceCopier readback(device, threads);

  std::vector<TensorDigest> digests(tensors.size());
  std::atomic<size_t> next{0};
  std::mutex mutex;
  std::exception_ptr first_error;
  {
    std::vector<std::jthread> workers;
    for (unsigned lane = 0; lane < threads; ++lane) {
      workers.emplace_back([&, lane] {
        try {
          Buffer host(Device{}, buffer_bytes, HostMemory::kPinned);
          for (size_t i; (i = next.fetch_add(1)) < tensors.size();) {
            Hasher hasher(kind);
            for (uint64_t done = 0; done < tensors[i].bytes; done += buffer_bytes) {
              uint64_t length = std::min(buffer_bytes, tensors[i].bytes - done);
              readback.copy_to_host(host.data(), loaded.tensors[i].data + done, length, lane, tensors[i].name);
              hasher.update(std::span<const std::byte>(host.data(), length));
            }
            digests[i] = {tensors[i].name, hasher.finish()};
          }
        } catch (...) {
          std::lock_guard lock(mutex);
          if (!first_error) first_error = std::current_exception();
          next.store(tensors.size());
        }
      });
    }
  }
  if (first_error) std::rethrow_exception(first_error);
  if (stats) {
    *stats = loaded.stats;
    stats->peak_staging_bytes = std::max(stats->peak_staging_bytes, buffer_bytes * threads);
    stats->seconds = seconds_since(start);
  }
  return digests;
}

}  // namespace weightstream
