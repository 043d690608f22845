#pragma once
// JSON pieces shared by the parsers of the format layer: strict parsing of untrusted
// documents (duplicate keys are errors, not "last one wins") and one-line quoting of
// untrusted names for error messages.

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace weightstream::detail {

/// `text` in single quotes, with control and non-ASCII bytes escaped as \xNN so a message
/// stays on one line, and cut at 200 bytes so a hostile name cannot flood a log.
std::string quoted_name(std::string_view text);

/// Offset of the first byte of `text` that is not part of valid UTF-8 (overlong forms,
/// surrogates and code points above U+10FFFF included), or nullopt.
std::optional<size_t> invalid_utf8_offset(std::string_view text);

/// nlohmann's message without its "[json.exception.parse_error.101] " prefix.
std::string json_error_text(const nlohmann::json::exception& error);

/// "an object", "a string", ... for messages.
std::string_view json_type_text(nlohmann::json::value_t type);

/// Parses `text` as JSON, rejecting invalid UTF-8 and any object with a repeated key.
/// Throws Error(kFormat) naming `object`.
nlohmann::json parse_json_strictly(std::string_view object, std::string_view text);

}  // namespace weightstream::detail
