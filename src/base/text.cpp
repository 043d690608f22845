// Text helpers for messages (text.hpp).
#include "base/text.hpp"

#include <cstdio>

namespace weightstream::detail {

std::string join(const std::vector<std::string>& items, std::string_view separator) {
  std::string text;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) text += separator;
    text += items[i];
  }
  return text;
}

std::string join_limited(const std::vector<std::string>& items, size_t limit) {
  std::string text;
  for (size_t i = 0; i < items.size() && i < limit; ++i) text += (i ? ", " : "") + items[i];
  if (items.size() > limit) text += ", and " + std::to_string(items.size() - limit) + " more";
  return text;
}

std::string seconds_text(std::chrono::milliseconds duration) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.3g s", static_cast<double>(duration.count()) / 1000.0);
  return text;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace weightstream::detail
