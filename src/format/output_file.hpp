#pragma once
// A local file opened for writing, for the writers of the format layer.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

namespace weightstream::detail {

/// A file created (or truncated) for writing; closed on destruction. Every failure
/// throws Error(kIo) naming the path, the offset and the errno.
class OutputFile {
 public:
  explicit OutputFile(const std::filesystem::path& path);
  ~OutputFile();
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  OutputFile(OutputFile&& other) noexcept;
  OutputFile& operator=(OutputFile&&) = delete;

  /// Writes all `size` bytes at the current position, retrying short writes.
  void write(const void* data, size_t size);
  /// Writes all `size` bytes at `offset` without moving the position (pwrite(2)); safe to
  /// call from several threads at once for disjoint ranges.
  void write_at(uint64_t offset, const void* data, size_t size) const;
  /// Closes the file and reports the errors close(2) defers (NFS, quotas).
  void close();

 private:
  [[noreturn]] void fail(const std::string& operation, int error_number) const;

  std::filesystem::path path_;
  int fd_ = -1;
  uint64_t offset_ = 0;
};

/// Writes `text` to `path` through an OutputFile.
void write_text_file(const std::filesystem::path& path, const std::string& text);

}  // namespace weightstream::detail
