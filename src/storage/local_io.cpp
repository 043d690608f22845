// Whole-file mappings (local_io.hpp): the shared read-only one behind --io mmap reads and the
// mapped GPU path, and the private copy-on-write one that host loads with --io mmap hand out.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "base/errno_text.hpp"
#include "storage/local_io.hpp"
#include "weightstream/error.hpp"

namespace weightstream::local_io {

uint64_t page_size() noexcept {
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

FileMapping::FileMapping(int fd, uint64_t size, std::string path, MappingKind kind)
    : size_(size), kind_(kind), path_(std::move(path)) {
  if (size_ == 0) return;  // mmap refuses a zero length; there is nothing to map
  // Neither kind is populated here: a shared one is read piece by piece (map_range), a
  // private one is populated by its owner (populate_range), on several threads.
  bool shared = kind_ == MappingKind::kSharedRead;
  void* data = ::mmap(nullptr, size_, shared ? PROT_READ : PROT_READ | PROT_WRITE, shared ? MAP_SHARED : MAP_PRIVATE,
                      fd, 0);
  // ENOMEM for a private one can be the commit charge of a writable private mapping
  // (vm.overcommit_memory 2); ENODEV, a file system that cannot map files.
  if (data == MAP_FAILED) {
    int error = errno;
    WS_FAIL(error == ENODEV ? ErrorCode::kUnsupported : ErrorCode::kIo,
            "cannot map " + std::to_string(size_) + " bytes of " + path_ + (shared ? "" : " copy-on-write") + ": " +
                detail::errno_text(error) + (error == ENODEV ? " (its file system cannot map files: use --io pread)" : ""));
  }
  data_ = static_cast<std::byte*>(data);
}

FileMapping FileMapping::open(const std::string& path, uint64_t expected_size, MappingKind kind) {
  FileDescriptor file(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!file) {
    int error = errno;
    WS_FAIL(error == ENOENT ? ErrorCode::kNotFound : ErrorCode::kIo,
            "cannot open " + path + " to map it: " + detail::errno_text(error));
  }
  struct stat status {};
  WS_EXPECT(::fstat(file.get(), &status) == 0, ErrorCode::kIo, "cannot stat " + path + ": " + detail::errno_text(errno));
  uint64_t size = static_cast<uint64_t>(status.st_size);
  WS_EXPECT(size == expected_size, ErrorCode::kIo,
            path + " is " + std::to_string(size) + " bytes, not the " + std::to_string(expected_size) +
                " it had when the checkpoint was opened: it changed since it was opened");
  return FileMapping(file.get(), size, path, kind);  // the mapping keeps the file; the descriptor closes here
}

FileMapping::FileMapping(FileMapping&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      kind_(other.kind_),
      path_(std::move(other.path_)) {}

FileMapping& FileMapping::operator=(FileMapping&& other) noexcept {
  std::swap(data_, other.data_);
  std::swap(size_, other.size_);
  std::swap(kind_, other.kind_);
  std::swap(path_, other.path_);
  return *this;
}

FileMapping::~FileMapping() {
  if (data_) ::munmap(data_, size_);
}

}  // namespace weightstream::local_io
