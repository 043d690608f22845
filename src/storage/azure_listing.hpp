#pragma once
// The Blob service's XML responses (internal to the storage layer): List Blobs pages and error
// bodies. Both are untrusted input: sizes are parsed strictly, and a malformed document is an
// error naming what was wrong, never a crash (fuzz/fuzz_azure_listing.cpp).
// https://learn.microsoft.com/rest/api/storageservices/list-blobs
// https://learn.microsoft.com/rest/api/storageservices/status-and-error-codes2

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "storage/object_store.hpp"

namespace weightstream::azure {

/// One page of a List Blobs response.
struct ListPage {
  std::vector<storage::ListedKey> objects;
  std::vector<std::string> prefixes;  ///< BlobPrefix names (with a delimiter)
  std::string next_marker;            ///< empty on the last page
};
/// Parses a List Blobs response body (<EnumerationResults><Blobs><Blob><Name>…<Properties>
/// <Content-Length>…). Throws Error(kFormat) on malformed XML, another root, a Blob without a
/// Name, or a Content-Length that is not a whole number of bytes below 2^64.
ListPage parse_list_page(std::string_view xml);

/// The parts of an error body (<Error><Code>…</Code><Message>…</Message></Error>).
struct ErrorBody {
  std::string code;     ///< e.g. "BlobNotFound", "AuthenticationFailed"
  std::string message;  ///< its first line
  /// AuthenticationErrorDetail's first line, which says why a signature was refused (a clock
  /// off by more than 15 minutes, a MAC that differs); empty for other errors.
  std::string detail;
};
/// Parses an error body leniently: anything else yields empty fields. Each field passes
/// through `redact` (when given) before it is cut short, so no part of a secret survives the cut.
ErrorBody parse_error_body(std::string_view xml, const std::function<std::string(std::string)>& redact = {});

}  // namespace weightstream::azure
