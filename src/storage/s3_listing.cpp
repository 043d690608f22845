#include "storage/s3_listing.hpp"

#include <charconv>
#include <pugixml.hpp>

#include "weightstream/error.hpp"

namespace weightstream::s3 {
namespace {

// Names in messages come from the server: keep them short and printable.
std::string clip(std::string_view text, size_t limit = 200) {
  std::string out;
  for (char c : text.substr(0, limit)) out += (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) ? '?' : c;
  if (text.size() > limit) out += "…";
  return out;
}

pugi::xml_document load(std::string_view xml, pugi::xml_parse_result* result) {
  pugi::xml_document document;
  // parse_default without entity/doctype extras; pugixml never fetches external entities.
  *result = document.load_buffer(xml.data(), xml.size(), pugi::parse_default, pugi::encoding_utf8);
  return document;
}

}  // namespace

ListPage parse_list_page(std::string_view xml) {
  pugi::xml_parse_result parsed;
  auto document = load(xml, &parsed);
  WS_EXPECT(parsed, ErrorCode::kFormat,
            std::string("malformed ListObjectsV2 response: ") + parsed.description() + " at byte " +
                std::to_string(parsed.offset));
  auto root = document.child("ListBucketResult");
  WS_EXPECT(root, ErrorCode::kFormat,
            "malformed ListObjectsV2 response: the root element is <" + clip(document.first_child().name()) +
                ">, not <ListBucketResult>");
  ListPage page;
  for (auto contents : root.children("Contents")) {
    auto key = contents.child("Key");
    WS_EXPECT(key, ErrorCode::kFormat, "malformed ListObjectsV2 response: a <Contents> without <Key>");
    std::string_view size_text = contents.child_value("Size");
    uint64_t size = 0;
    auto [end, error] = std::from_chars(size_text.data(), size_text.data() + size_text.size(), size);
    WS_EXPECT(!size_text.empty() && error == std::errc() && end == size_text.data() + size_text.size(),
              ErrorCode::kFormat,
              "malformed ListObjectsV2 response: object '" + clip(key.text().get()) + "' has Size '" +
                  clip(size_text) + "', not a whole number of bytes");
    page.objects.push_back({key.text().get(), size});
  }
  for (auto prefix : root.children("CommonPrefixes")) page.common_prefixes.emplace_back(prefix.child_value("Prefix"));
  std::string_view truncated = root.child_value("IsTruncated");
  page.truncated = truncated == "true";
  page.next_token = root.child_value("NextContinuationToken");
  WS_EXPECT(!page.truncated || !page.next_token.empty(), ErrorCode::kFormat,
            "malformed ListObjectsV2 response: IsTruncated is true but there is no NextContinuationToken");
  return page;
}

ErrorBody parse_error_body(std::string_view xml) {
  ErrorBody body;
  if (xml.empty()) return body;
  pugi::xml_parse_result parsed;
  auto document = load(xml, &parsed);
  if (!parsed) return body;
  auto root = document.child("Error");
  if (!root) return body;
  body.code = clip(root.child_value("Code"));
  body.message = clip(root.child_value("Message"));
  body.request_id = clip(root.child_value("RequestId"));
  body.region = clip(root.child_value("Region"));
  return body;
}

}  // namespace weightstream::s3
