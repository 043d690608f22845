#pragma once
/// @file error.hpp
/// The one error model of weightstream: every failure is a weightstream::Error carrying a
/// code and a message that names the object, the range, the operation and the cause.

#include <stdexcept>
#include <string>
#include <string_view>

namespace weightstream {

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
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  /// The kind of failure.
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

/// Throws Error(code, message). WS_EXPECT and WS_FAIL call it; it is out of line so that
/// the checks stay small where they are inlined.
[[noreturn]] void throw_error(ErrorCode code, std::string message);

}  // namespace weightstream

/// Throws weightstream::Error(code, message) when `condition` is false. The message
/// expression is evaluated only on failure, so it may build strings freely.
#define WS_EXPECT(condition, code, message)                          \
  do {                                                               \
    if (!(condition)) [[unlikely]] {                                 \
      ::weightstream::throw_error((code), (message));        \
    }                                                                \
  } while (0)

/// Throws weightstream::Error(code, message) unconditionally.
#define WS_FAIL(code, message) ::weightstream::throw_error((code), (message))
