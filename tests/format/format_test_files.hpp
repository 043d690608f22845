#pragma once
// Small helpers of the format tests: building safetensors bytes by hand and catching the
// format error a parser throws.

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include <nlohmann/json.hpp>

#include "weightstream/error.hpp"
#include "weightstream/format.hpp"

namespace weightstream::testing {

/// An 8-byte little-endian length, `header_json`, then `data_bytes` bytes of data.
inline std::string safetensors_file(const std::string& header_json, uint64_t data_bytes = 0) {
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((header_json.size() >> (8 * i)) & 0xff);
  return file + header_json + std::string(data_bytes, '\x5a');
}

inline std::span<const std::byte> as_bytes(const std::string& text) {
  return {reinterpret_cast<const std::byte*>(text.data()), text.size()};
}

/// The message of the Error `action` throws, checking that it is one line of code `code`;
/// an empty string and a test failure when it throws nothing.
inline std::string error_text(const std::function<void()>& action, ErrorCode code = ErrorCode::kFormat) {
  try {
    action();
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), code) << error.what();
    std::string message = error.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << "message spans lines: " << message;
    return message;
  }
  ADD_FAILURE() << "no weightstream::Error thrown";
  return {};
}

/// The error parsing `header_json` followed by `data_bytes` bytes, as file "m.safetensors".
inline std::string header_error(const std::string& header_json, uint64_t data_bytes = 0) {
  std::string file = safetensors_file(header_json, data_bytes);
  return error_text([&] { parse_safetensors_bytes("/m/model.safetensors", as_bytes(file)); });
}

/// Parses `header_json` followed by `data_bytes` bytes.
inline SafetensorsHeader parse_header(const std::string& header_json, uint64_t data_bytes = 0) {
  std::string file = safetensors_file(header_json, data_bytes);
  return parse_safetensors_bytes("/m/model.safetensors", as_bytes(file));
}

}  // namespace weightstream::testing
