#pragma once
// Azure Storage's Shared Key authorization (internal to the storage layer), written against
// Microsoft's "Authorize with Shared Key" (https://learn.microsoft.com/rest/api/storageservices/authorize-with-shared-key),
// the Blob service's string-to-sign for version 2009-09-19 and later: the verb, eleven
// standard headers (Content-Length empty when zero, from version 2015-02-21), the
// canonicalized x-ms- headers and the canonicalized resource, signed with HMAC-SHA256 under
// the base64-decoded account key.

#include <chrono>
#include <string>
#include <string_view>
#include <vector>

#include "storage/http_client.hpp"

namespace weightstream::azure {

using storage::Field;

/// The service version every request asks for (x-ms-version): one that accepts Shared Key,
/// SAS and bearer tokens alike, and that Azurite serves.
inline constexpr std::string_view kApiVersion = "2021-08-06";

/// A request as Shared Key sees it.
struct SharedKeyInput {
  std::string method = "GET";
  /// The URL's path exactly as sent, percent-encoded, from its first '/' ("/container/a%20b").
  /// With an emulator's endpoint (http://127.0.0.1:10000/devstoreaccount1) the account is its
  /// first segment, and is signed so ("/devstoreaccount1/devstoreaccount1/container/…"), as
  /// Azure's SDKs and Azurite do.
  std::string encoded_path = "/";
  /// Query parameters, not encoded (the canonicalized resource takes them decoded).
  std::vector<Field> query;
  /// Every header sent, names in any case.
  std::vector<Field> headers;
};

/// The canonicalized headers: every x-ms- header, names lowercased, sorted by name, runs of
/// whitespace in a value made one space and the value trimmed, each "name:value\n".
std::string canonicalized_headers(const std::vector<Field>& headers);

/// The canonicalized resource: "/" + account + the encoded path, then for each query
/// parameter, names lowercased and sorted, "\nname:value" (several values of one name
/// sorted and joined with ',').
std::string canonicalized_resource(std::string_view account, std::string_view encoded_path,
                                   const std::vector<Field>& query);

/// The whole string-to-sign of `input` for `account`.
std::string string_to_sign(std::string_view account, const SharedKeyInput& input);

/// base64(HMAC-SHA256(key, text)): the signature of `text` under the account key, given
/// already base64-decoded.
std::string shared_key_signature(std::string_view decoded_key, std::string_view text);

/// The Authorization header's value: "SharedKey account:signature".
std::string shared_key_authorization(std::string_view account, std::string_view decoded_key,
                                     const SharedKeyInput& input);

/// `time` as RFC 1123 says, in GMT ("Sun, 11 Oct 2009 21:49:13 GMT"): the x-ms-date header.
std::string rfc1123_date(std::chrono::system_clock::time_point time);

}  // namespace weightstream::azure
