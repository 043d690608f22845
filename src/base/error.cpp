#include "weightstream/error.hpp"

#include "base/errno_text.hpp"

#include <cstring>

namespace weightstream {

std::string_view error_code_name(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "invalid_argument";
    case ErrorCode::kConfig: return "config";
    case ErrorCode::kFormat: return "format";
    case ErrorCode::kNotFound: return "not_found";
    case ErrorCode::kPermission: return "permission";
    case ErrorCode::kIo: return "io";
    case ErrorCode::kNetwork: return "network";
    case ErrorCode::kDevice: return "device";
    case ErrorCode::kModel: return "model";
    case ErrorCode::kProtocol: return "protocol";
    case ErrorCode::kTimeout: return "timeout";
    case ErrorCode::kCancelled: return "cancelled";
    case ErrorCode::kUnsupported: return "unsupported";
    case ErrorCode::kInternal: return "internal";
  }
  return "unknown";
}

void throw_error(ErrorCode code, std::string message, SourceLocation location) {
  throw Error(code, message, location);
}

namespace detail {

std::string errno_text(int error_number) {
  char buffer[256];
  // GNU strerror_r may return a static string rather than fill the buffer.
  const char* text = strerror_r(error_number, buffer, sizeof(buffer));
  return std::string(text) + " (errno " + std::to_string(error_number) + ")";
}

}  // namespace detail
}  // namespace weightstream
