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

/// The rule for tensor names, as errors state it: the header parser and the writer both hold it.
inline constexpr std::string_view kTensorNameRule =
    "tensor names must be non-empty and hold no control characters (U+0000 to U+001F, U+007F)";

/// Why `name` breaks kTensorNameRule ("is empty", "has the control character U+000A at byte
/// 3"), or nullopt when it keeps it. A NUL is cut short by C APIs and control characters
/// rewrite what a terminal shows, so a header that holds them is hostile input.
std::optional<std::string> tensor_name_fault(std::string_view name);

/// nlohmann's message without its "[json.exception.parse_error.101] " prefix.
std::string json_error_text(const nlohmann::json::exception& error);

/// "an object", "a string", ... for messages.
std::string_view json_type_text(nlohmann::json::value_t type);

/// Parses `text` as JSON, rejecting invalid UTF-8 and any object with a repeated key.
/// Throws Error(kFormat) naming `object`.
nlohmann::json parse_json_strictly(std::string_view object, std::string_view text);

}  // namespace weightstream::detail
