#pragma once
// Internal: the read primitives of the local-file backend.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "weightstream/storage.hpp"

namespace weightstream::local_io {

/// Alignment O_DIRECT needs for buffer address, file offset and length on Linux block devices.
inline constexpr uint64_t kDirectAlignment = 4096;

/// An owned file descriptor.
class FileDescriptor {
 public:
  FileDescriptor() = default;
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(FileDescriptor&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  FileDescriptor& operator=(FileDescriptor&& other) noexcept;
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor();
  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

/// The size of a memory page (sysconf(_SC_PAGESIZE)), read once.
uint64_t page_size() noexcept;

/// How a FileMapping maps its file.
enum class MappingKind {
  /// PROT_READ, MAP_SHARED: the page cache itself, read-only.
  kSharedRead,
  /// A copy-on-write view: PROT_READ | PROT_WRITE, MAP_PRIVATE, nothing mapped yet
  /// (populate_range maps the page cache's pages without copying them; MAP_POPULATE on a
  /// writable private mapping would copy every page). A write copies that one page into
  /// memory of this process; the file and other mappings of it never see it. Pages nobody
  /// wrote still show what the file holds, so a file rewritten in place changes them, and
  /// one truncated makes touching them raise SIGBUS.
  kPrivateWritable,
};

/// A whole file mapped into memory, unmapped on destruction. Move-only.
class FileMapping {
 public:
  FileMapping() = default;
  /// Maps the `size` bytes of the open file `fd`; the caller keeps `fd` (the mapping does
  /// not need it afterwards). `path` names the file in errors. Throws Error(kIo) naming the
  /// file, the size and errno when mmap fails, Error(kUnsupported) when its file system
  /// cannot map files (ENODEV).
  FileMapping(int fd, uint64_t size, std::string path, MappingKind kind);
  /// Opens `path` read-only, checks with fstat that it is still `expected_size` bytes (the
  /// size the checkpoint recorded when it was opened), maps it and closes the descriptor
  /// (the mapping keeps the file). Throws Error(kNotFound) or Error(kIo) naming the file,
  /// and Error(kIo) naming both sizes when the file changed size.
  static FileMapping open(const std::string& path, uint64_t expected_size, MappingKind kind);

  FileMapping(FileMapping&& other) noexcept;
  FileMapping& operator=(FileMapping&& other) noexcept;
  FileMapping(const FileMapping&) = delete;
  FileMapping& operator=(const FileMapping&) = delete;
  ~FileMapping();

  /// The first byte of the file; null for an empty file or a default-constructed mapping.
  const std::byte* data() const noexcept { return data_; }
  /// The same address, writable: only a kPrivateWritable mapping may be written through it.
  std::byte* writable_data() const noexcept { return kind_ == MappingKind::kPrivateWritable ? data_ : nullptr; }
  uint64_t size() const noexcept { return size_; }
  const std::string& path() const noexcept { return path_; }

 private:
  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  MappingKind kind_ = MappingKind::kSharedRead;
  std::string path_;
};

/// Reads exactly destination.size() bytes at `offset` with pread(2), retrying on EINTR and
/// short reads. `uri` names the file in errors. `file_size` bounds the read.
void pread_exact(int fd, const std::string& uri, uint64_t offset, std::span<std::byte> destination);

/// Reads through an O_DIRECT descriptor: aligned parts go straight into `destination`
/// when it is aligned, the rest through a thread-local aligned bounce buffer.
void direct_read(int fd, const std::string& uri, uint64_t file_size, uint64_t offset, std::span<std::byte> destination);

/// Copies `destination.size()` bytes at `offset` out of `mapping`, a read-only shared
/// mapping of the whole file behind `fd` (`file_size` bytes when it was mapped). First
/// asks the kernel to read the range ahead (a cold page cache is read in large requests,
/// not a page per fault) and checks that the file still holds the range: touching a page
/// past the end of a file that shrank would raise SIGBUS instead of an error.
/// With `mapped` set, the range's pages are already mapped (map_range, by a prefetcher):
/// only the size check and the copy remain.
void mapped_read(const std::byte* mapping, int fd, const std::string& uri, uint64_t offset,
                 std::span<std::byte> destination, bool mapped = false);

/// Copies the `runs` (ascending, disjoint byte ranges of the file within [offset, offset +
/// destination.size())) out of `mapping`, a read-only shared mapping of the whole file
/// behind `fd`, each to where it lies in `destination` (run r at destination[r.offset -
/// offset]; with RunPlacement::kPacked back to back from destination[0]); the bytes
/// between runs are not copied. One size check for all runs, then one
/// map_range per group of runs whose gaps are at most `merge_gap` (the page cache reads by
/// pages, and reads ahead around them, whatever the gap): no system call a run. With
/// `drop`, each group's pages are dropped from this process after its copy (unmap_range).
/// Returns the runs' bytes. Errors as mapped_read.
uint64_t mapped_read_runs(const std::byte* mapping, int fd, const std::string& uri, uint64_t offset,
                          std::span<std::byte> destination, std::span<const ByteRange> runs, uint64_t merge_gap,
                          bool drop, RunPlacement placement = RunPlacement::kAtOffsets);

/// Maps the pages of `length` bytes at `offset` of a read-only shared `mapping` into this
/// process (readahead first, then MADV_POPULATE_READ). False when the kernel refused
/// (EFAULT: the range is past the end of a file that shrank; EINVAL: a kernel before 5.14).
bool map_range(const std::byte* mapping, uint64_t offset, uint64_t length);

/// Maps the page cache's pages of `length` bytes at `offset` of any mapping of a file into
/// this process, as map_range does, on behalf of a caller that hands the range out (a host
/// load in place): throws Error(kIo) naming `path` when the range is no longer in the file
/// (EFAULT: it shrank). A kernel without MADV_POPULATE_READ (before 5.14) leaves the pages
/// to fault in on first use.
void populate_range(const std::byte* mapping, const std::string& path, uint64_t offset, uint64_t length);

/// Drops the pages of `length` bytes at `offset` of `mapping` from this process
/// (MADV_DONTNEED; the page cache keeps them): a mapping torn down piece by piece as its
/// reads finish costs nothing at its munmap.
void unmap_range(const std::byte* mapping, uint64_t offset, uint64_t length);

/// The fraction of `samples` pages, spread evenly over the `file_size` bytes of `fd`, that
/// the page cache holds: each is probed with a one-byte preadv2(RWF_NOWAIT), which fails
/// rather than wait for the disk. Unlike mincore(2) it needs no mapping and no write
/// permission. nullopt where the file system cannot answer (no RWF_NOWAIT for it).
std::optional<double> cached_fraction(int fd, uint64_t file_size, unsigned samples);

/// True when this build can read with io_uring.
bool uring_available() noexcept;

/// Reads with io_uring: the range is split into submissions kept in flight together on a
/// per-thread ring. Throws Error(kUnsupported) where the build has no liburing.
void uring_read(int fd, const std::string& uri, uint64_t offset, std::span<std::byte> destination);

}  // namespace weightstream::local_io
