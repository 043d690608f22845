#include "format/output_file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "weightstream/error.hpp"
#include "base/errno_text.hpp"

namespace weightstream::detail {

OutputFile::OutputFile(const std::filesystem::path& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("cannot create", errno);
}

OutputFile::OutputFile(OutputFile&& other) noexcept
    : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)), offset_(other.offset_) {}

OutputFile::~OutputFile() {
  if (fd_ >= 0) ::close(fd_);
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
  int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail("cannot close", errno);
}

void OutputFile::fail(const std::string& operation, int error_number) const {
  WS_FAIL(ErrorCode::kIo, operation + " " + path_.string() + ": " + errno_text(error_number));
}

void write_text_file(const std::filesystem::path& path, const std::string& text) {
  OutputFile file(path);
  file.write(text.data(), text.size());
  file.close();
}

}  // namespace weightstream::detail
