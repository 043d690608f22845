// Fuzzes the Blob service's XML parsers (src/storage/azure_listing.hpp): List Blobs pages and
// error bodies, both bytes a server (or anything between it and us) chose. A page is either
// rejected with Error(kFormat) or returned with named blobs; an error body never fails, and
// its fields stay short and free of control characters since they end up in messages, also
// after a redaction that lengthens them.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "storage/azure_listing.hpp"
#include "weightstream/error.hpp"

namespace {

// clip() keeps 200 characters and appends "…" (3 bytes of UTF-8).
constexpr size_t kMaxFieldBytes = 200 + 3;

void check_field(const std::string& field) {
  if (field.size() > kMaxFieldBytes) std::abort();
  for (char c : field) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view xml(reinterpret_cast<const char*>(data), size);
  try {
    auto page = weightstream::azure::parse_list_page(xml);
    for (const auto& object : page.objects) {
      if (object.key.empty()) std::abort();
    }
  } catch (const weightstream::Error& error) {
    if (error.code() != weightstream::ErrorCode::kFormat) std::abort();
  }
  auto body = weightstream::azure::parse_error_body(xml);
  check_field(body.code);
  check_field(body.message);
  check_field(body.detail);
  auto masked = weightstream::azure::parse_error_body(xml, [](std::string text) { return text + "<redacted>\n"; });
  check_field(masked.code);
  check_field(masked.message);
  check_field(masked.detail);
  return 0;
}
