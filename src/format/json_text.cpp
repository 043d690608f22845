#include "format/shared/json_text.hpp"

#include <cstdio>
#include <set>
#include <vector>

#include "weightstream/error.hpp"

namespace weightstream::detail {

std::string quoted_name(std::string_view text) {
  constexpr size_t kMaxShown = 200;
  std::string out = "'";
  for (size_t i = 0; i < text.size() && i < kMaxShown; ++i) {
    auto byte = static_cast<unsigned char>(text[i]);
    if (byte < 0x20 || byte >= 0x7f || byte == '\\') {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[byte >> 4];
      out += kHex[byte & 15];
    } else {
      out += static_cast<char>(byte);
    }
  }
  if (text.size() > kMaxShown) out += "...";
  out += "'";
  return out;
}

std::optional<size_t> invalid_utf8_offset(std::string_view text) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(text.data());
  size_t size = text.size();
  size_t i = 0;
  while (i < size) {
    unsigned char lead = bytes[i];
    if (lead < 0x80) {
      ++i;
      continue;
    }
    // Unicode 15, table 3-7: the well-formed byte sequences.
    size_t length = 0;
    unsigned char low = 0x80, high = 0xbf;
    if (lead >= 0xc2 && lead <= 0xdf) {
      length = 2;
    } else if (lead >= 0xe0 && lead <= 0xef) {
      length = 3;
      if (lead == 0xe0) low = 0xa0;
      if (lead == 0xed) high = 0x9f;  // UTF-16 surrogates
    } else if (lead >= 0xf0 && lead <= 0xf4) {
      length = 4;
      if (lead == 0xf0) low = 0x90;
      if (lead == 0xf4) high = 0x8f;  // above U+10FFFF
    } else {
      return i;
    }
    if (size - i < length) return i;
    if (bytes[i + 1] < low || bytes[i + 1] > high) return i;
    for (size_t k = 2; k < length; ++k) {
      if (bytes[i + k] < 0x80 || bytes[i + k] > 0xbf) return i;
    }
    i += length;
  }
  return std::nullopt;
}

std::string json_error_text(const nlohmann::json::exception& error) {
  std::string_view text = error.what();
  if (!text.empty() && text.front() == '[') {
    size_t close = text.find("] ");
    if (close != std::string_view::npos) text.remove_prefix(close + 2);
  }
  return std::string(text);
}

std::string_view json_type_text(nlohmann::json::value_t type) {
  using Type = nlohmann::json::value_t;
  switch (type) {
    case Type::null: return "null";
    case Type::object: return "an object";
    case Type::array: return "an array";
    case Type::string: return "a string";
    case Type::boolean: return "a boolean";
    case Type::number_integer:
    case Type::number_unsigned: return "an integer";
    case Type::number_float: return "a floating-point number";
    case Type::binary: return "binary";
    case Type::discarded: return "nothing";
  }
  return "?";
}

nlohmann::json parse_json_strictly(std::string_view object, std::string_view text) {
  if (auto bad = invalid_utf8_offset(text)) {
    WS_FAIL(ErrorCode::kFormat, std::string(object) + ": not valid UTF-8 at byte " + std::to_string(*bad));
  }
  // nlohmann's lexer takes a NUL byte for the end of its input; a raw NUL is never valid JSON.
  if (size_t nul = text.find('\0'); nul != std::string_view::npos) {
    WS_FAIL(ErrorCode::kFormat, std::string(object) + ": not valid JSON: NUL byte at byte " + std::to_string(nul));
  }
  // nlohmann keeps the last of repeated keys; a file whose meaning depends on which
  // duplicate a reader keeps is ambiguous, so each open object tracks its keys.
  std::vector<std::set<std::string>> open_objects;
  auto on_event = [&](int, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if (event == Event::object_start) {
      open_objects.emplace_back();
    } else if (event == Event::object_end) {
      if (!open_objects.empty()) open_objects.pop_back();
    } else if (event == Event::key && !open_objects.empty()) {
      const auto& key = parsed.get_ref<const std::string&>();
      WS_EXPECT(open_objects.back().insert(key).second, ErrorCode::kFormat,
                std::string(object) + ": key " + quoted_name(key) + " appears twice in one object");
    }
    return true;
  };
  try {
    return nlohmann::json::parse(text.begin(), text.end(), on_event);
  } catch (const nlohmann::json::exception& error) {
    WS_FAIL(ErrorCode::kFormat, std::string(object) + ": not valid JSON: " + json_error_text(error));
  }
}

std::optional<std::string> tensor_name_fault(std::string_view name) {
  if (name.empty()) return "is empty";
  for (size_t i = 0; i < name.size(); ++i) {
    auto byte = static_cast<unsigned char>(name[i]);
    if (byte < 0x20 || byte == 0x7f) {
      char code[8];
      std::snprintf(code, sizeof(code), "U+%04X", byte);
      return "has the control character " + std::string(code) + " at byte " + std::to_string(i);
    }
  }
  return std::nullopt;
}

}  // namespace weightstream::detail
