#include "storage/azure_signer.hpp"

#include <algorithm>
#include <cctype>
#include <ctime>
#include <map>

#include "storage/s3_checksum.hpp"
#include "storage/s3_signer.hpp"

namespace weightstream::azure {
namespace {

std::string lowercase(std::string_view text) {
  std::string out(text);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

// "Replace any linear whitespace in the header value with a single space", then trim.
std::string collapse_whitespace(std::string_view value) {
  std::string out;
  bool space = false;
  for (char c : value) {
    if (c == ' ' || c == '\t' || c == '\r' || c == '\n') {
      space = true;
      continue;
    }
    if (space && !out.empty()) out += ' ';
    space = false;
    out += c;
  }
  return out;
}

// The value of header `name` (any case), or empty: a standard header absent is an empty line.
std::string header_value(const std::vector<Field>& headers, std::string_view name) {
  for (const auto& [key, value] : headers)
    if (lowercase(key) == name) return value;
  return {};
}

}  // namespace

std::string canonicalized_headers(const std::vector<Field>& headers) {
  std::multimap<std::string, std::string> sorted;
  for (const auto& [name, value] : headers) {
    std::string lower = lowercase(name);
    if (lower.starts_with("x-ms-")) sorted.emplace(std::move(lower), collapse_whitespace(value));
  }
  std::string out;
  for (const auto& [name, value] : sorted) out += name + ":" + value + "\n";
  return out;
}

std::string canonicalized_resource(std::string_view account, std::string_view encoded_path,
                                   const std::vector<Field>& query) {
  std::string out = "/" + std::string(account) + std::string(encoded_path);
  std::map<std::string, std::vector<std::string>> parameters;
  for (const auto& [name, value] : query) parameters[lowercase(name)].push_back(value);
  for (auto& [name, values] : parameters) {
    std::sort(values.begin(), values.end());
    out += "\n" + name + ":";
    for (size_t i = 0; i < values.size(); ++i) out += (i ? "," : "") + values[i];
  }
  return out;
}

std::string string_to_sign(std::string_view account, const SharedKeyInput& input) {
  std::string out = input.method + "\n";
  for (std::string_view name : {"content-encoding", "content-language", "content-length", "content-md5", "content-type",
                                "date", "if-modified-since", "if-match", "if-none-match", "if-unmodified-since",
                                "range"}) {
    std::string value = header_value(input.headers, name);
    // From version 2015-02-21 a zero Content-Length is signed as an empty line.
    if (name == "content-length" && value == "0") value.clear();
    out += value + "\n";
  }
  out += canonicalized_headers(input.headers);
  out += canonicalized_resource(account, input.encoded_path, input.query);
  return out;
}

std::string shared_key_signature(std::string_view decoded_key, std::string_view text) {
  auto mac = s3::hmac_sha256(decoded_key, text);
  return s3::base64_encode(std::string_view(reinterpret_cast<const char*>(mac.data()), mac.size()));
}

std::string shared_key_authorization(std::string_view account, std::string_view decoded_key,
                                     const SharedKeyInput& input) {
  return "SharedKey " + std::string(account) + ":" + shared_key_signature(decoded_key, string_to_sign(account, input));
}

std::string rfc1123_date(std::chrono::system_clock::time_point time) {
  const std::time_t seconds = std::chrono::system_clock::to_time_t(time);
  std::tm utc{};
  gmtime_r(&seconds, &utc);
  // strftime's %a and %b follow the locale; HTTP dates are always English.
  static constexpr const char* kDays[] = {"Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"};
  static constexpr const char* kMonths[] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun",
                                            "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};
  char text[40];
  std::snprintf(text, sizeof(text), "%s, %02d %s %04d %02d:%02d:%02d GMT", kDays[utc.tm_wday], utc.tm_mday,
                kMonths[utc.tm_mon], utc.tm_year + 1900, utc.tm_hour, utc.tm_min, utc.tm_sec);
  return text;
}

}  // namespace weightstream::azure
