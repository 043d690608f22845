// Fuzzes checkpoint URI parsing (parse_uri), the first thing done with a user's or a
// config file's location. An accepted URI must keep the promises the storage layer relies
// on: an s3:// or gs:// bucket, or an az:// account and container, that follows its naming
// rules and a prefix without a trailing '/', an Azure https:// URL without a query,
// a non-empty local path, and the text kept as given.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "weightstream/error.hpp"
#include "storage/azure_credentials.hpp"
#include "storage/gcs_client.hpp"
#include "weightstream/storage.hpp"

namespace {

bool valid_bucket(std::string_view bucket) {
  if (bucket.size() < 3 || bucket.size() > 63) return false;
  for (char c : bucket) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '-')) return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  weightstream::Uri uri;
  try {
    uri = weightstream::parse_uri(text);
  } catch (const weightstream::Error& error) {
    // Rejections are argument errors, never another kind.
    if (error.code() != weightstream::ErrorCode::kInvalidArgument) std::abort();
    return 0;
  }
  if (uri.text != text || text.find('\0') != std::string_view::npos) std::abort();
  switch (uri.scheme) {
    case weightstream::Uri::Scheme::kFile:
      if (uri.path.empty()) std::abort();
      break;
    case weightstream::Uri::Scheme::kS3:
      if (!valid_bucket(uri.bucket) || uri.path.ends_with('/')) std::abort();
      break;
    case weightstream::Uri::Scheme::kGcs:
      if (!weightstream::gcs::valid_bucket_name(uri.bucket) || uri.path.ends_with('/')) std::abort();
      break;
    case weightstream::Uri::Scheme::kAzure:
      if (!weightstream::azure::valid_account_name(uri.account) ||
          !weightstream::azure::valid_container_name(uri.bucket) || uri.path.ends_with('/') ||
          uri.endpoint.find_first_of("?#") != std::string_view::npos)
        std::abort();
      break;
    case weightstream::Uri::Scheme::kHttp:
      if (uri.path != text) std::abort();
      break;
  }
  return 0;
}
