#pragma once
/// @file stats.hpp
/// Named counters of a report, so that every front end (the CLI's JSON, the Python
/// bindings' dicts) prints one report under the same names.

#include <cstdint>
#include <string_view>
#include <variant>
#include <vector>

namespace weightstream {

/// One counter of a report: its name (snake_case, as `weightstream load --json` prints it)
/// and its value, a count or a quantity in the unit its name says (seconds, bytes, gbps).
struct StatField {
  std::string_view name;
  std::variant<uint64_t, double> value;
};

}  // namespace weightstream
