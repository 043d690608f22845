#pragma once
// S3's XML responses (internal to the storage layer): ListObjectsV2 pages and error bodies.
// Both are untrusted input: sizes are parsed strictly, and a malformed document is an error
// naming what was wrong, never a crash.
// https://docs.aws.amazon.com/AmazonS3/latest/API/API_ListObjectsV2.html
// https://docs.aws.amazon.com/AmazonS3/latest/API/ErrorResponses.html

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace weightstream::s3 {

/// One object of a listing.
struct ListedObject {
  std::string key;
  uint64_t size = 0;
};

/// One page of ListObjectsV2.
struct ListPage {
  std::vector<ListedObject> objects;
  std::vector<std::string> common_prefixes;
  bool truncated = false;
  /// NextContinuationToken; set when `truncated`.
  std::string next_token;
};

/// Parses a ListObjectsV2 response body. Throws Error(kFormat) on malformed XML, a root
/// other than ListBucketResult, a Contents without Key or with a Size that is not a whole
/// number below 2^64, or a truncated page without a NextContinuationToken.
ListPage parse_list_page(std::string_view xml);

/// The fields of an S3 error body (<Error><Code>…</Code><Message>…</Message><RequestId>…).
struct ErrorBody {
  std::string code;
  std::string message;
  std::string request_id;
  std::string region;  ///< <Region>, sent with a wrong-region redirect
};

/// Parses an error body leniently: missing fields stay empty, and anything that is not an
/// S3 error document yields an empty ErrorBody. Fields are cut to 200 characters.
ErrorBody parse_error_body(std::string_view xml);

}  // namespace weightstream::s3
