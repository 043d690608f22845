#pragma once
// Small text helpers for messages; internal to the library (not installed).

#include <chrono>
#include <string>
#include <string_view>
#include <vector>

namespace weightstream::detail {

/// `items` joined with `separator`: join({"a", "b"}, ", ") is "a, b".
std::string join(const std::vector<std::string>& items, std::string_view separator);

/// The first `limit` items joined with ", ", then ", and N more" for the rest: long lists
/// in error messages stay readable.
std::string join_limited(const std::vector<std::string>& items, size_t limit);

/// A duration for a message, in seconds with three significant digits: "1.5 s", "0.25 s".
std::string seconds_text(std::chrono::milliseconds duration);

/// Seconds elapsed on the steady clock since `start`.
double seconds_since(std::chrono::steady_clock::time_point start);

}  // namespace weightstream::detail
