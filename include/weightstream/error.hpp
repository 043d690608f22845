#pragma once
/// @file error.hpp
/// The one error model of weightstream: every failure is a weightstream::Error carrying a
/// code and a message that names the object, the range, the operation and the cause.

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <version>

#if defined(__cpp_lib_source_location)
#include <source_location>
#endif

namespace weightstream {

#if defined(__cpp_lib_source_location)
/// Where an error was raised: std::source_location where the standard library has it.
using SourceLocation = std::source_location;
#else
/// Where an error was raised, for compilers whose standard library lacks std::source_location
/// (clang 14 with libstdc++, which the fuzz build uses): file and line from the builtins
/// that std::source_location::current() is made of.
class SourceLocation {
 public:
  static constexpr SourceLocation current(const char* file = __builtin_FILE(),
                                          std::uint_least32_t line = __builtin_LINE()) noexcept {
    SourceLocation location;
    location.file_ = file;
    location.line_ = line;
    return location;
  }
  constexpr const char* file_name() const noexcept { return file_; }
  constexpr std::uint_least32_t line() const noexcept { return line_; }

 private:
  const char* file_ = "";
  std::uint_least32_t line_ = 0;
};
#endif

/// What kind of failure an Error reports. Stable: callers may switch on it.
enum class ErrorCode {
  kInvalidArgument,  ///< a caller-supplied argument, flag or option value is malformed
  kConfig,           ///< an environment variable or configuration value is malformed
  kFormat,           ///< a checkpoint header, index or config file breaks a format rule
  kNotFound,         ///< an object, file, tensor or parameter does not exist
  kPermission,       ///< access denied (errno EACCES/EPERM, HTTP 403)
  kIo,               ///< a local read or write failed
  kNetwork,          ///< an HTTP/S3 request failed after its retries
  kDevice,           ///< a CUDA call failed, or a device was asked for where none is
  kModel,            ///< a tensor does not fit the model layout, or a load is incomplete
  kProtocol,         ///< a peer broke the update protocol
  kTimeout,          ///< a deadline passed
  kCancelled,        ///< the operation was stopped because another part failed first
  kUnsupported,      ///< the build or the platform lacks a requested feature
  kInternal,         ///< a broken invariant inside weightstream (a bug)
};

/// Short lowercase name of a code, e.g. "format".
std::string_view error_code_name(ErrorCode code) noexcept;

/// Base of every exception weightstream throws.
class Error : public std::runtime_error {
 public:
  /// `location` is where the error was raised (WS_EXPECT and WS_FAIL pass their call site);
  /// it is kept beside the message, not in it, so messages stay meant for users.
  Error(ErrorCode code, const std::string& message, SourceLocation location = SourceLocation::current())
      : std::runtime_error(message), code_(code), location_(location) {}
  /// The kind of failure.
  ErrorCode code() const noexcept { return code_; }
  /// The source file and line that raised it, for bug reports and debugging.
  const SourceLocation& location() const noexcept { return location_; }

 private:
  ErrorCode code_;
  SourceLocation location_;
};

/// Throws Error(code, message) raised at `location`. WS_EXPECT and WS_FAIL call it; it is
/// out of line so that the checks stay small where they are inlined.
[[noreturn]] void throw_error(ErrorCode code, std::string message,
                              SourceLocation location = SourceLocation::current());

}  // namespace weightstream

/// Throws weightstream::Error(code, message) when `condition` is false, recording the file
/// and line of the check (Error::location). The message expression is evaluated only on
/// failure, so it may build strings freely.
#define WS_EXPECT(condition, code, message)                          \
  do {                                                               \
    if (!(condition)) [[unlikely]] {                                 \
      ::weightstream::throw_error((code), (message));                \
    }                                                                \
  } while (0)

/// Throws weightstream::Error(code, message) unconditionally, recording its file and line.
#define WS_FAIL(code, message) ::weightstream::throw_error((code), (message))
