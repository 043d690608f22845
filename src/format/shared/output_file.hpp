#pragma once
// A local file written whole and then put in place, for the writers of the format layer.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

namespace weightstream::detail {

/// A file written under a temporary name in the folder of `path` and renamed over `path`
/// by close(), after an fsync: a reader never sees it half written, and a process that has
/// the old file open or mapped (weightstream's in-place tensors) keeps the old bytes, where
/// writing into the old file would change them under it, or end it with SIGBUS when the
/// file shrank. Destroyed without close() (an error midway), the temporary file is removed
/// and `path` is left as it was. Every failure throws Error(kIo) naming the path, the
/// offset and the errno.
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
  /// Flushes the file to the disk (fsync), closes it, reporting the errors close(2) defers
  /// (NFS, quotas), and renames it over the path it was opened for.
  void close();

  /// The temporary name the bytes are written under until close().
  const std::filesystem::path& temporary_path() const noexcept { return temporary_; }

 private:
  [[noreturn]] void fail(const std::string& operation, int error_number) const;
  [[noreturn]] void fail_at_temporary(const std::string& operation, int error_number) const;

  std::filesystem::path path_;
  std::filesystem::path temporary_;
  int fd_ = -1;
  uint64_t offset_ = 0;
};

/// Writes `text` to `path` through an OutputFile.
void write_text_file(const std::filesystem::path& path, const std::string& text);

}  // namespace weightstream::detail
