#include "format/shared/output_file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <utility>

#include "weightstream/error.hpp"
#include "base/errno_text.hpp"

namespace weightstream::detail {

namespace {

/// A name for the temporary file of `path`, beside it: ".NAME.tmp-PID-N", hidden from
/// listings and from the "*.safetensors" a checkpoint folder is read as.
std::filesystem::path temporary_name(const std::filesystem::path& path) {
  static std::atomic<uint64_t> counter{0};
  uint64_t unique = counter.fetch_add(1) ^
                    static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  char suffix[48];
  std::snprintf(suffix, sizeof(suffix), ".tmp-%d-%llx", static_cast<int>(::getpid()),
                static_cast<unsigned long long>(unique));
  return path.parent_path() / ("." + path.filename().string() + suffix);
}

}  // namespace

OutputFile::OutputFile(const std::filesystem::path& path) : path_(path) {
  // O_EXCL: a name another writer holds is never shared; try another one.
  for (int attempt = 0; attempt < 100 && fd_ < 0; ++attempt) {
    temporary_ = temporary_name(path);
    fd_ = ::open(temporary_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ < 0 && errno != EEXIST) fail_at_temporary("cannot create", errno);
  }
  if (fd_ < 0) fail_at_temporary("cannot create", EEXIST);
}

OutputFile::OutputFile(OutputFile&& other) noexcept
    : path_(std::move(other.path_)),
      temporary_(std::move(other.temporary_)),
      fd_(std::exchange(other.fd_, -1)),
      offset_(other.offset_) {
  other.temporary_.clear();
}

OutputFile::~OutputFile() {
  if (fd_ < 0) return;
  ::close(fd_);
  ::unlink(temporary_.c_str());  // never completed: the path keeps what it held
}

void OutputFile::write(const void* data, size_t size) {
  const auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t written = ::write(fd_, bytes, size);
    if (written < 0) {
      if (errno == EINTR) continue;
      fail("cannot write " + std::to_string(size) + " bytes at offset " + std::to_string(offset_) + " of", errno);
    }
    bytes += written;
    size -= static_cast<size_t>(written);
    offset_ += static_cast<uint64_t>(written);
  }
}

void OutputFile::write_at(uint64_t offset, const void* data, size_t size) const {
  const auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t written = ::pwrite(fd_, bytes, size, static_cast<off_t>(offset));
    if (written < 0) {
      if (errno == EINTR) continue;
      fail("cannot write " + std::to_string(size) + " bytes at offset " + std::to_string(offset) + " of", errno);
    }
    bytes += written;
    size -= static_cast<size_t>(written);
    offset += static_cast<uint64_t>(written);
  }
}

void OutputFile::close() {
  int fd = std::exchange(fd_, -1);
  auto discard = [&](const std::string& operation, int error_number) {
    ::unlink(temporary_.c_str());
    fail_at_temporary(operation, error_number);
  };
  // The bytes reach the disk before the name does: after a crash the path holds the old
  // file or the whole new one, never a torn one.
  if (::fsync(fd) != 0) {
    int error_number = errno;
    ::close(fd);
    discard("cannot flush", error_number);
  }
  if (::close(fd) != 0) discard("cannot close", errno);
  if (::rename(temporary_.c_str(), path_.c_str()) != 0) discard("cannot rename", errno);
  // The rename itself is durable once the folder is flushed; a folder that cannot be
  // opened or flushed (some network file systems) leaves it to the file system.
  std::filesystem::path folder = path_.parent_path().empty() ? std::filesystem::path(".") : path_.parent_path();
  int directory = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (directory >= 0) {
    (void)::fsync(directory);
    ::close(directory);
  }
}

void OutputFile::fail(const std::string& operation, int error_number) const {
  WS_FAIL(ErrorCode::kIo, operation + " " + path_.string() + ": " + errno_text(error_number));
}

void OutputFile::fail_at_temporary(const std::string& operation, int error_number) const {
  WS_FAIL(ErrorCode::kIo, operation + " " + path_.string() + " (written as " + temporary_.filename().string() +
                              " and renamed over it): " + errno_text(error_number));
}

void write_text_file(const std::filesystem::path& path, const std::string& text) {
  OutputFile file(path);
  file.write(text.data(), text.size());
  file.close();
}

}  // namespace weightstream::detail
