#pragma once
// S3 credentials (internal to the storage layer): where they come from, in the order
// issue 3 and the AWS CLI agree on. The secret never reaches a message: Credentials has no
// printer, and every error names only `source`.

#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "weightstream/options.hpp"

namespace weightstream::s3 {

/// Keys to sign with; empty access_key_id means unsigned (anonymous) requests.
struct Credentials {
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;
  /// Where they came from, for messages: "options or environment",
  /// "profile 'x' of /path/credentials", "none (unsigned requests)". Never a secret.
  std::string source;

  /// Whether requests go out unsigned.
  bool anonymous() const noexcept { return access_key_id.empty(); }
};

/// Resolves credentials from `options`, in order: unsigned when options.unsigned_requests;
/// the key fields of `options` (filled from explicit flags or from AWS_ACCESS_KEY_ID /
/// AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN by options_from_environment); then the profile
/// options.profile of the shared credentials file options.credentials_file.
/// Throws Error(kConfig) on a key id without a secret (or the reverse), an unreadable or
/// malformed credentials file, or a named profile that is missing; Error(kPermission) when
/// no source holds credentials, saying which were tried.
Credentials resolve_credentials(const S3Options& options);

/// Sections of an INI file such as ~/.aws/credentials: section name to (key to value).
/// Keys are lowercased, values trimmed; '#' and ';' start comment lines. A "[profile x]"
/// header (the ~/.aws/config form) is stored as "x". Throws Error(kConfig) naming `origin`
/// and the line number on a line that is neither a section, a key = value nor a comment
/// (the offending line's text is left out: it may hold a secret).
using IniSections = std::map<std::string, std::map<std::string, std::string>, std::less<>>;
IniSections parse_ini(std::string_view text, std::string_view origin);

}  // namespace weightstream::s3
