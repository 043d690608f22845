#include "storage/azure_listing.hpp"

#include <charconv>
#include <pugixml.hpp>

#include "weightstream/error.hpp"

namespace weightstream::azure {
namespace {

// Text a server sent, cut short and kept printable, for messages.
std::string clip(std::string_view text, size_t limit = 200) {
  std::string out;
  for (char c : text.substr(0, limit)) out += (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) ? '?' : c;
  if (text.size() > limit) out += "…";
  return out;
}

// A whole number of decimal digits below 2^64.
std::optional<uint64_t> parse_size(std::string_view text) {
  uint64_t value = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

}  // namespace

ListPage parse_list_page(std::string_view xml) {
  pugi::xml_document document;
  // parse_default without entity/doctype extras; pugixml never fetches external entities.
  pugi::xml_parse_result parsed = document.load_buffer(xml.data(), xml.size(), pugi::parse_default, pugi::encoding_utf8);
  WS_EXPECT(parsed, ErrorCode::kFormat,
            std::string("malformed List Blobs response: ") + parsed.description() + " at byte " +
                std::to_string(parsed.offset));
  auto root = document.child("EnumerationResults");
  WS_EXPECT(root, ErrorCode::kFormat,
            "malformed List Blobs response: the root element is <" + clip(document.first_child().name()) +
                ">, not <EnumerationResults>");
  ListPage page;
  auto blobs = root.child("Blobs");
  for (auto blob : blobs.children("Blob")) {
    auto name = blob.child("Name");
    WS_EXPECT(name && *name.text().get() != '\0', ErrorCode::kFormat,
              "malformed List Blobs response: a <Blob> without <Name>");
    std::string_view size_text = blob.child("Properties").child_value("Content-Length");
    auto size = parse_size(size_text);
    WS_EXPECT(size.has_value(), ErrorCode::kFormat,
              "malformed List Blobs response: blob '" + clip(name.text().get()) + "' has Content-Length '" +
                  clip(size_text) + "', not a whole number of bytes");
    page.objects.push_back({name.text().get(), *size});
  }
  for (auto prefix : blobs.children("BlobPrefix")) page.prefixes.emplace_back(prefix.child_value("Name"));
  page.next_marker = root.child_value("NextMarker");
  return page;
}

ErrorBody parse_error_body(std::string_view xml, const std::function<std::string(std::string)>& redact) {
  ErrorBody body;
  if (xml.empty()) return body;
  pugi::xml_document document;
  if (!document.load_buffer(xml.data(), xml.size(), pugi::parse_default, pugi::encoding_utf8)) return body;
  auto root = document.child("Error");
  if (!root) return body;
  auto masked = [&](std::string text) { return redact ? redact(std::move(text)) : text; };
  body.code = clip(masked(root.child_value("Code")), 80);
  // The first line: Azure adds "RequestId:…\nTime:…" on the next ones.
  std::string_view message = root.child_value("Message");
  body.message = clip(masked(std::string(message.substr(0, message.find('\n')))));
  std::string_view detail = root.child_value("AuthenticationErrorDetail");
  body.detail = clip(masked(std::string(detail.substr(0, detail.find('\n')))));
  return body;
}

}  // namespace weightstream::azure
