// Fuzzes the S3 XML parsers (src/storage/s3_listing.hpp): ListObjectsV2 pages and error
// bodies, both bytes a server (or anything between it and us) chose. A page is either
// rejected with Error(kFormat) or returned with a continuation token whenever it says it
// is truncated; an error body never fails, and its fields stay short and free of control
// characters since they end up in messages.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "storage/s3_listing.hpp"
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
    auto page = weightstream::s3::parse_list_page(xml);
    if (page.truncated && page.next_token.empty()) std::abort();
  } catch (const weightstream::Error& error) {
    if (error.code() != weightstream::ErrorCode::kFormat) std::abort();
  }
  auto body = weightstream::s3::parse_error_body(xml);
  check_field(body.code);
  check_field(body.message);
  check_field(body.request_id);
  check_field(body.region);
  return 0;
}
