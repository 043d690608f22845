#pragma once
// Internal: the read primitives of the local-file backend.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

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
void mapped_read(const std::byte* mapping, int fd, const std::string& uri, uint64_t offset,
                 std::span<std::byte> destination);

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
