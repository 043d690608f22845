#pragma once
// Shared fixtures for the tests: temporary directories, scoped environment variables,
// running the command-line tool.

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace weightstream::testing {

/// A fresh directory removed with its contents on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

/// Sets (or unsets) one environment variable for the guard's lifetime.
class ScopedEnv {
 public:
  ScopedEnv(std::string name, std::optional<std::string> value);
  ~ScopedEnv();
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> previous_;
};

/// The result of running the command-line tool.
struct CommandResult {
  int exit_code = 0;
  std::string out;
  std::string err;
  long max_rss_kib = 0;  ///< peak resident memory of the command
};

/// Resource limits applied to the command's process only (setrlimit in the child).
struct RunLimits {
  /// RLIMIT_AS in bytes: allocations past it fail inside the command; 0 leaves it unlimited.
  uint64_t address_space_bytes = 0;
};

/// True when the tests (and the CLI built with them) run under AddressSanitizer or
/// ThreadSanitizer. Those reserve terabytes of address space up front, so an RLIMIT_AS
/// cannot apply, and ASan's quarantine keeps freed memory resident, so RSS is no measure.
bool sanitized_build();

/// Runs the `weightstream` command with `arguments` (no shell), capturing its output,
/// under `limits` (none by default).
CommandResult run_cli(const std::vector<std::string>& arguments, const RunLimits& limits = {});

/// Writes `bytes` to `path`.
void write_file(const std::filesystem::path& path, const std::string& bytes);
/// Reads all of `path`.
std::string read_file(const std::filesystem::path& path);

/// The lines of `text` (stderr of a command, say), without their newlines.
std::vector<std::string> lines_of(const std::string& text);

}  // namespace weightstream::testing
