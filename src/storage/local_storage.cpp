// The local-file backend of Storage: pread, O_DIRECT, io_uring or copies out of a mapping
// (and, at --io auto, the runs of a strided read copied out of one).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "storage/local_io.hpp"
#include "storage/shared/read_destination.hpp"
#include "storage/run_groups.hpp"
#include "weightstream/error.hpp"
#include "weightstream/storage.hpp"
#include "base/errno_text.hpp"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14; older headers lack it, and older kernels answer EINVAL
#endif

namespace weightstream {
namespace local_io {

FileDescriptor& FileDescriptor::operator=(FileDescriptor&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

FileDescriptor::~FileDescriptor() {
  if (fd_ >= 0) ::close(fd_);
}

namespace {
std::string range_text(uint64_t offset, uint64_t length) {
  return std::to_string(offset) + "+" + std::to_string(length);
}
}  // namespace

void pread_exact(int fd, const std::string& uri, uint64_t offset, std::span<std::byte> destination) {
  size_t done = 0;
  while (done < destination.size()) {
    ssize_t got = ::pread(fd, destination.data() + done, destination.size() - done, static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      WS_FAIL(ErrorCode::kIo, "cannot read " + range_text(offset, destination.size()) + " bytes of " + uri + ": pread: " +
                                  detail::errno_text(errno));
    }
    WS_EXPECT(got > 0, ErrorCode::kIo,
              "cannot read " + range_text(offset, destination.size()) + " bytes of " + uri +
                  ": unexpected end of file after " + std::to_string(offset + done) + " bytes (truncated file?)");
    done += static_cast<size_t>(got);
  }
}

namespace {

/// A page-aligned scratch buffer owned by one thread, grown on demand.
struct BounceBuffer {
  std::byte* data = nullptr;
  size_t size = 0;
  ~BounceBuffer() { std::free(data); }
  std::byte* reserve(size_t bytes) {
    if (bytes > size) {
      std::free(data);
      data = static_cast<std::byte*>(std::aligned_alloc(kDirectAlignment, bytes));
      WS_EXPECT(data != nullptr, ErrorCode::kIo, "cannot allocate a " + std::to_string(bytes) + "-byte O_DIRECT buffer");
      size = bytes;
    }
    return data;
  }
};

constexpr size_t kBounceBytes = 8 * 1024 * 1024;

bool aligned(uint64_t value) { return value % kDirectAlignment == 0; }

}  // namespace

void direct_read(int fd, const std::string& uri, uint64_t file_size, uint64_t offset, std::span<std::byte> destination) {
  thread_local BounceBuffer bounce;
  uint64_t end = offset + destination.size();
  uint64_t position = offset;
  while (position < end) {
    auto* target = destination.data() + (position - offset);
    uint64_t remaining = end - position;
    // Fast path: everything aligned, read straight into the caller's memory.
    if (aligned(position) && aligned(reinterpret_cast<uintptr_t>(target)) && remaining >= kDirectAlignment) {
      uint64_t length = remaining - remaining % kDirectAlignment;
      ssize_t got = ::pread(fd, target, length, static_cast<off_t>(position));
      if (got < 0 && errno == EINTR) continue;
      WS_EXPECT(got >= 0, ErrorCode::kIo,
                "cannot read " + range_text(position, length) + " bytes of " + uri + ": pread(O_DIRECT): " +
                    detail::errno_text(errno));
      WS_EXPECT(got > 0, ErrorCode::kIo, "cannot read " + range_text(position, length) + " bytes of " + uri + ": unexpected end of file");
      position += static_cast<uint64_t>(got);
      continue;
    }
    // Slow path: read the aligned window around the bytes into the bounce buffer.
    uint64_t window_start = position - position % kDirectAlignment;
    uint64_t window_end = std::min<uint64_t>(window_start + kBounceBytes, (end + kDirectAlignment - 1) / kDirectAlignment * kDirectAlignment);
    auto* scratch = bounce.reserve(kBounceBytes);
    ssize_t got = ::pread(fd, scratch, window_end - window_start, static_cast<off_t>(window_start));
    if (got < 0 && errno == EINTR) continue;
    WS_EXPECT(got >= 0, ErrorCode::kIo,
              "cannot read " + range_text(window_start, window_end - window_start) + " bytes of " + uri +
                  ": pread(O_DIRECT): " + detail::errno_text(errno));
    // At the end of the file O_DIRECT returns fewer bytes than the aligned window.
    uint64_t available = window_start + static_cast<uint64_t>(got);
    WS_EXPECT(available > position, ErrorCode::kIo,
              "cannot read " + range_text(position, remaining) + " bytes of " + uri + ": unexpected end of file at " +
                  std::to_string(available) + " (file size " + std::to_string(file_size) + ")");
    uint64_t take = std::min(end, available) - position;
    std::memcpy(target, scratch + (position - window_start), take);
    position += take;
  }
}

namespace {

/// The whole pages around `length` bytes at `offset` of `mapping`.
std::span<std::byte> page_range(const std::byte* mapping, uint64_t offset, uint64_t length) {
  const uint64_t page = page_size();
  uint64_t begin = offset / page * page;
  return {const_cast<std::byte*>(mapping + begin), static_cast<size_t>(offset + length - begin)};
}

}  // namespace

bool map_range(const std::byte* mapping, uint64_t offset, uint64_t length) {
  if (length == 0) return true;
  auto range = page_range(mapping, offset, length);
  // Readahead of the whole range first (advice only: a cold page cache is then read in large
  // requests, not a page per fault), then its pages mapped in one call (MADV_POPULATE_READ,
  // Linux 5.14) rather than a fault per 64 KiB in the copy, which is slower warm
  // (bench/HISTORY.md, "Figures once in source comments").
  ::madvise(range.data(), range.size(), MADV_WILLNEED);
  return ::madvise(range.data(), range.size(), MADV_POPULATE_READ) == 0;
}

void populate_range(const std::byte* mapping, const std::string& path, uint64_t offset, uint64_t length) {
  if (map_range(mapping, offset, length)) return;
  int error = errno;
  WS_EXPECT(error != EFAULT, ErrorCode::kIo,
            "cannot map " + range_text(offset, length) + " bytes of " + path + ": " + detail::errno_text(error) +
                " (the file shrank since it was opened?)");
}

void unmap_range(const std::byte* mapping, uint64_t offset, uint64_t length) {
  if (length == 0) return;
  auto range = page_range(mapping, offset, length);
  ::madvise(range.data(), range.size(), MADV_DONTNEED);
}

void mapped_read(const std::byte* mapping, int fd, const std::string& uri, uint64_t offset,
                 std::span<std::byte> destination, bool mapped) {
  struct stat info {};
  WS_EXPECT(::fstat(fd, &info) == 0, ErrorCode::kIo, "cannot stat " + uri + ": " + detail::errno_text(errno));
  WS_EXPECT(offset + destination.size() <= static_cast<uint64_t>(info.st_size), ErrorCode::kIo,
            "cannot read " + range_text(offset, destination.size()) + " bytes of " + uri + ": the file is now " +
                std::to_string(info.st_size) + " bytes (truncated while loading?)");
  // EFAULT: the pages are gone (the file shrank after the check above). Any other refusal
  // (EINVAL where the kernel lacks it, EINTR) leaves it to the faults in the copy.
  if (!mapped && !map_range(mapping, offset, destination.size())) {
    int error = errno;
    WS_EXPECT(error != EFAULT, ErrorCode::kIo,
              "cannot read " + range_text(offset, destination.size()) + " bytes of " + uri +
                  " through its mapping: " + detail::errno_text(error) + " (truncated while loading?)");
  }
  std::memcpy(destination.data(), mapping + offset, destination.size());
}

uint64_t mapped_read_runs(const std::byte* mapping, int fd, const std::string& uri, uint64_t offset,
                          std::span<std::byte> destination, std::span<const ByteRange> runs, uint64_t merge_gap,
                          bool drop, RunPlacement placement) {
  if (runs.empty()) return 0;
  const uint64_t end = runs.back().offset + runs.back().length;
  struct stat info {};
  WS_EXPECT(::fstat(fd, &info) == 0, ErrorCode::kIo, "cannot stat " + uri + ": " + detail::errno_text(errno));
  WS_EXPECT(end <= static_cast<uint64_t>(info.st_size), ErrorCode::kIo,
            "cannot read " + range_text(runs.front().offset, end - runs.front().offset) + " bytes of " + uri +
                ": the file is now " + std::to_string(info.st_size) + " bytes (truncated while loading?)");
  uint64_t copied = 0;
  storage::for_each_run_group(runs, merge_gap, [&](size_t first, size_t last) {
    const uint64_t group_begin = runs[first].offset;
    const uint64_t group_length = runs[last].offset + runs[last].length - group_begin;
    if (!map_range(mapping, group_begin, group_length)) {
      int error = errno;
      WS_EXPECT(error != EFAULT, ErrorCode::kIo,
                "cannot read " + range_text(group_begin, group_length) + " bytes of " + uri +
                    " through its mapping: " + detail::errno_text(error) + " (truncated while loading?)");
    }
    for (size_t r = first; r <= last; ++r) {
      std::byte* at = placement == RunPlacement::kPacked ? destination.data() + copied
                                                         : destination.data() + (runs[r].offset - offset);
      std::memcpy(at, mapping + runs[r].offset, runs[r].length);
      copied += runs[r].length;
    }
    if (drop) unmap_range(mapping, group_begin, group_length);
  });
  return copied;
}

std::optional<double> cached_fraction(int fd, uint64_t file_size, unsigned samples) {
  if (file_size == 0 || samples == 0) return 1.0;
  unsigned cached = 0;
  // From the end backwards: a probe that misses may start readahead after its page, which
  // must not make the next probe look cached.
  for (unsigned i = samples; i-- > 0;) {
    uint64_t offset = samples == 1 ? 0 : (file_size - 1) / (samples - 1) * i;
    std::byte probe{};
    iovec vector{&probe, 1};
    ssize_t got = ::preadv2(fd, &vector, 1, static_cast<off_t>(offset), RWF_NOWAIT);
    if (got == 1) {
      ++cached;
    } else if (got < 0 && errno != EAGAIN) {
      return std::nullopt;  // EOPNOTSUPP and the like: this file system cannot tell
    }
  }
  return static_cast<double>(cached) / samples;
}

}  // namespace local_io

namespace {

using local_io::FileDescriptor;

class LocalStorage final : public Storage {
 public:
  // kAuto reads as kPread does: what it changes is a host load's choice to take its tensors
  // in place (load_checkpoint), which is not a way of reading.
  LocalStorage(std::string directory, LocalIo io)
      : directory_(std::move(directory)),
        io_(io == LocalIo::kAuto ? LocalIo::kPread : io),
        runs_through_mapping_(io == LocalIo::kAuto || io == LocalIo::kMmap) {
    WS_EXPECT(io_ != LocalIo::kUring || local_io::uring_available(), ErrorCode::kUnsupported,
              "io_uring reads were asked for, but this build has no liburing support (use --io pread or direct)");
    while (directory_.size() > 1 && directory_.back() == '/') directory_.pop_back();
  }

  std::string root_uri() const override { return directory_; }
  std::string object_uri(std::string_view name) const override { return directory_ + "/" + std::string(name); }

  std::vector<ObjectInfo> list() override {
    std::vector<ObjectInfo> objects;
    std::error_code error;
    std::filesystem::directory_iterator it(directory_, error);
    WS_EXPECT(!error, error.value() == ENOENT ? ErrorCode::kNotFound : ErrorCode::kIo,
              "cannot list " + directory_ + ": " + error.message());
    for (const auto& entry : it) {
      std::error_code entry_error;
      // is_regular_file follows symlinks, as Hugging Face cache snapshots are symlinks to blobs.
      if (!entry.is_regular_file(entry_error)) continue;
      auto size = entry.file_size(entry_error);
      if (entry_error) continue;
      objects.push_back({entry.path().filename().string(), size});
    }
    return objects;
  }

  ObjectInfo stat(std::string_view name) override {
    check_name(name);
    struct stat info {};
    auto path = object_uri(name);
    if (::stat(path.c_str(), &info) != 0) {
      int error = errno;
      WS_FAIL(error == ENOENT ? ErrorCode::kNotFound : ErrorCode::kIo, "cannot stat " + path + ": " + detail::errno_text(error));
    }
    check_regular(path, info);
    return {std::string(name), static_cast<uint64_t>(info.st_size)};
  }

  void read(std::string_view name, uint64_t offset, std::span<std::byte> destination) override {
    if (destination.empty()) return;
    const auto& file = open_file(name);
    auto uri = object_uri(name);
    WS_EXPECT(offset <= file.size && destination.size() <= file.size - offset, ErrorCode::kIo,
              "cannot read " + std::to_string(offset) + "+" + std::to_string(destination.size()) + " bytes of " + uri +
                  ": past the end of the " + std::to_string(file.size) + "-byte file");
    storage::populate_destination(destination);
    switch (io_) {
      case LocalIo::kAuto:  // never held: the constructor makes it kPread
      case LocalIo::kPread: local_io::pread_exact(file.buffered.get(), uri, offset, destination); break;
      case LocalIo::kDirect: local_io::direct_read(file.direct.get(), uri, file.size, offset, destination); break;
      case LocalIo::kUring: local_io::uring_read(file.buffered.get(), uri, offset, destination); break;
      case LocalIo::kMmap:
        local_io::mapped_read(file.mapping->data(), file.buffered.get(), uri, offset, destination,
                              take_populated(file.mapping.get(), offset, destination.size()));
        break;
    }
  }

  /// At --io auto and mmap, the runs are copied out of the file's mapping (no system call a
  /// run, and no byte of a gap copied); otherwise read as every backend reads them.
  uint64_t read_runs(std::string_view name, uint64_t offset, std::span<std::byte> destination,
                     std::span<const ByteRange> runs, RunPlacement placement) override {
    if (!runs_through_mapping_ || runs.size() <= 1) return Storage::read_runs(name, offset, destination, runs, placement);
    const auto& file = open_file(name);
    auto uri = object_uri(name);
    const uint64_t end = runs.back().offset + runs.back().length;
    WS_EXPECT(end <= file.size, ErrorCode::kIo,
              "cannot read " + std::to_string(runs.front().offset) + "+" + std::to_string(end - runs.front().offset) +
                  " bytes of " + uri + ": past the end of the " + std::to_string(file.size) + "-byte file");
    std::shared_ptr<const local_io::FileMapping> mapping;
    try {
      mapping = shared_mapping(file, uri);
    } catch (const Error& error) {
      // A file system that cannot map files (ENODEV) is read as --io pread reads it.
      if (error.code() != ErrorCode::kUnsupported) throw;
      return Storage::read_runs(name, offset, destination, runs, placement);
    }
    // --io mmap readers hold a view of the range that drops its pages when they are done.
    return local_io::mapped_read_runs(mapping->data(), file.buffered.get(), uri, offset, destination, runs,
                                      run_merge_gap(), io_ != LocalIo::kMmap, placement);
  }

  bool lends_views() const override { return true; }
  bool reads_through_views() const override { return io_ == LocalIo::kMmap; }
  bool views_serve_reads() const override { return runs_through_mapping_; }

  Bytes borrow(std::string_view name, uint64_t offset, uint64_t length, const BorrowOptions& options) override {
    const auto& file = open_file(name);
    auto uri = object_uri(name);
    WS_EXPECT(offset <= file.size && length <= file.size - offset, ErrorCode::kIo,
              "cannot read " + std::to_string(offset) + "+" + std::to_string(length) + " bytes of " + uri +
                  ": past the end of the " + std::to_string(file.size) + "-byte file");
    if (options.sharing == BorrowOptions::Sharing::kPrivate) {
      // A mapping of its own, checked against the size the file had when it was opened: a
      // private view's writes must show in no other view.
      auto mapping = std::make_shared<local_io::FileMapping>(
          local_io::FileMapping::open(uri, file.size, local_io::MappingKind::kPrivateWritable));
      std::byte* data = mapping->writable_data() + offset;
      return {std::span<const std::byte>(data, length), std::move(mapping), data, true};
    }
    std::shared_ptr<const local_io::FileMapping> mapping = shared_mapping(file, uri);
    if (offset == 0 && length == file.size && !options.populate && !options.drop_when_returned) {
      // A whole object lent for a while (the mapped GPU path registers windows of it): a
      // file that changed size since it was opened is refused here, by name, rather than
      // failing later in a registration or a copy.
      const uint64_t now = current_size(file, uri);
      WS_EXPECT(now == file.size, ErrorCode::kIo,
                uri + " is " + std::to_string(now) + " bytes, not the " + std::to_string(file.size) +
                    " it had when the checkpoint was opened: it changed since it was opened");
    }
    if (options.checked) {
      const uint64_t now = current_size(file, uri);
      WS_EXPECT(offset + length <= now, ErrorCode::kIo,
                "cannot read " + std::to_string(offset) + "+" + std::to_string(length) + " bytes of " + uri + ": the file is now " +
                    std::to_string(now) + " bytes (truncated while loading?)");
    }
    if (options.populate && length > 0) {
      if (local_io::map_range(mapping->data(), offset, length)) {
        std::lock_guard lock(views_->mutex);
        views_->populated.insert({mapping.get(), offset, length});
      } else {
        const int error = errno;
        WS_EXPECT(!options.checked || error != EFAULT, ErrorCode::kIo,
                  "cannot read " + std::to_string(offset) + "+" + std::to_string(length) + " bytes of " + uri + " through its mapping: " +
                      detail::errno_text(error) + " (truncated while loading?)");
      }
    }
    std::shared_ptr<const void> keepalive = mapping;
    if (options.drop_when_returned && length > 0) {
      keepalive = std::shared_ptr<const void>(mapping.get(), [mapping, views = views_, offset, length](const void*) {
        {
          std::lock_guard lock(views->mutex);
          views->populated.erase({mapping.get(), offset, length});  // populated after its read began: never taken
        }
        local_io::unmap_range(mapping->data(), offset, length);
      });
    }
    return {std::span<const std::byte>(mapping->data() + offset, length), std::move(keepalive), nullptr, true};
  }

  std::optional<double> cached_share(std::string_view name) override {
    // A few one-byte RWF_NOWAIT reads, spread over the file: enough to tell a dropped cache
    // from a warm one without reading anything from disk.
    constexpr unsigned kCacheProbes = 32;
    try {
      const auto& file = open_file(name);
      return local_io::cached_fraction(file.buffered.get(), file.size, kCacheProbes);
    } catch (const Error&) {
      return std::nullopt;  // the read that follows says what is wrong with the file
    }
  }

 private:
  struct OpenFile {
    FileDescriptor buffered;
    FileDescriptor direct;
    /// The shared read-only mapping that views and --io mmap reads use: made at open for
    /// --io mmap, else on the first borrow (guarded by LocalStorage::mapping_mutex_).
    mutable std::shared_ptr<const local_io::FileMapping> mapping;
    uint64_t size = 0;
  };

  static void check_regular(const std::string& path, const struct stat& info) {
    if (S_ISREG(info.st_mode)) return;
    const char* what = S_ISDIR(info.st_mode)    ? "a directory"
                       : S_ISFIFO(info.st_mode) ? "a FIFO (named pipe)"
                       : S_ISSOCK(info.st_mode) ? "a socket"
                       : S_ISCHR(info.st_mode)  ? "a character device"
                       : S_ISBLK(info.st_mode)  ? "a block device"
                                                : "not a regular file";
    WS_FAIL(ErrorCode::kFormat, path + " is " + what + ", not a regular file (a shard must be a safetensors file)");
  }

  void check_name(std::string_view name) const {
    WS_EXPECT(!name.empty() && name.find('/') == std::string_view::npos && name != "." && name != "..",
              ErrorCode::kInvalidArgument, "'" + std::string(name) + "' is not a plain file name in " + directory_);
  }

  // Descriptors are opened once per file and shared by all reader threads (pread is
  // position-free, so one descriptor serves concurrent reads).
  /// The size `file` has now (it may have changed since it was opened).
  static uint64_t current_size(const OpenFile& file, const std::string& uri) {
    struct stat now {};
    WS_EXPECT(::fstat(file.buffered.get(), &now) == 0, ErrorCode::kIo, "cannot stat " + uri + ": " + detail::errno_text(errno));
    return static_cast<uint64_t>(now.st_size);
  }

  const OpenFile& open_file(std::string_view name) {
    {
      std::shared_lock lock(mutex_);
      if (auto it = files_.find(std::string(name)); it != files_.end()) return it->second;
    }
    check_name(name);
    auto path = object_uri(name);
    OpenFile file;
    // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer; it changes
    // nothing for a regular file, and anything else is refused after the fstat below.
    file.buffered = FileDescriptor(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
    if (!file.buffered) {
      int error = errno;
      WS_FAIL(error == ENOENT ? ErrorCode::kNotFound : (error == EACCES ? ErrorCode::kPermission : ErrorCode::kIo),
              "cannot open " + path + ": " + detail::errno_text(error));
    }
    struct stat info {};
    WS_EXPECT(::fstat(file.buffered.get(), &info) == 0, ErrorCode::kIo, "cannot stat " + path + ": " + detail::errno_text(errno));
    check_regular(path, info);
    file.size = static_cast<uint64_t>(info.st_size);
    if (io_ == LocalIo::kDirect) {
      file.direct = FileDescriptor(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT));
      WS_EXPECT(static_cast<bool>(file.direct), ErrorCode::kUnsupported,
                "cannot open " + path + " with O_DIRECT: " + detail::errno_text(errno) +
                    " (the file system may not support it; use --io pread)");
    }
    if (io_ == LocalIo::kMmap) {
      try {
        file.mapping = std::make_shared<const local_io::FileMapping>(file.buffered.get(), file.size, path,
                                                                    local_io::MappingKind::kSharedRead);
      } catch (const Error& error) {
        WS_FAIL(error.code(), std::string(error.what()) + " (use --io pread)");
      }
    }
    std::unique_lock lock(mutex_);
    return files_.try_emplace(std::string(name), std::move(file)).first->second;
  }

  std::string directory_;
  LocalIo io_;
  bool runs_through_mapping_;  ///< read_runs copies out of the file's mapping (--io auto, mmap)
  /// The file's shared mapping, made on first use.
  std::shared_ptr<const local_io::FileMapping> shared_mapping(const OpenFile& file, const std::string& uri) {
    std::lock_guard lock(mapping_mutex_);
    if (!file.mapping) {
      try {
        file.mapping = std::make_shared<const local_io::FileMapping>(file.buffered.get(), file.size, uri,
                                                                      local_io::MappingKind::kSharedRead);
      } catch (const Error& error) {
        WS_FAIL(error.code(), std::string(error.what()) + " (use --io pread)");
      }
    }
    return file.mapping;
  }

  /// Whether a borrow with populate mapped exactly this range (then the read only copies it).
  bool take_populated(const local_io::FileMapping* mapping, uint64_t offset, uint64_t length) {
    std::lock_guard lock(views_->mutex);
    return views_->populated.erase({mapping, offset, length}) > 0;
  }

  /// Ranges that borrows with populate mapped, shared with the keepalives that drop them.
  struct Views {
    std::mutex mutex;
    std::set<std::tuple<const local_io::FileMapping*, uint64_t, uint64_t>> populated;
  };

  std::shared_mutex mutex_;
  std::unordered_map<std::string, OpenFile> files_;  // node-based: an OpenFile never moves
  std::mutex mapping_mutex_;
  std::shared_ptr<Views> views_ = std::make_shared<Views>();
};

}  // namespace

std::unique_ptr<Storage> open_local_storage(const std::string& directory, LocalIo io) {
  return std::make_unique<LocalStorage>(directory, io);
}

void populate_view(const Bytes& view, uint64_t offset, uint64_t length, std::string_view what) {
  if (!view.view || length == 0) return;
  local_io::populate_range(view.span.data(), std::string(what), offset, length);
}

}  // namespace weightstream
