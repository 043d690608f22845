#pragma once
// errno as text for error messages; internal to the library (not installed).

#include <string>

namespace weightstream::detail {

/// strerror text and number, e.g. "No such file or directory (errno 2)".
std::string errno_text(int error_number);

}  // namespace weightstream::detail
