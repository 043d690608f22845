// Credential resolution for the S3 backend. Nothing here reads the environment: the
// environment's AWS_* values arrive already in S3Options (src/base/environment.cpp).
#include "storage/s3_credentials.hpp"

#include <cctype>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "weightstream/error.hpp"

namespace weightstream::s3 {
namespace {

std::string_view trim(std::string_view text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) text.remove_prefix(1);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.remove_suffix(1);
  return text;
}

std::string lowercase(std::string_view text) {
  std::string out(text);
  for (auto& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// The shared credentials file is small; refuse anything absurd rather than read it whole.
constexpr uintmax_t kMaxCredentialsFileBytes = 1 * kMiB;

}  // namespace

IniSections parse_ini(std::string_view text, std::string_view origin) {
  IniSections sections;
  std::string current;
  bool in_section = false;
  size_t line_number = 0;
  while (!text.empty()) {
    ++line_number;
    auto end = text.find('\n');
    std::string_view line = trim(text.substr(0, end));
    text = end == std::string_view::npos ? std::string_view{} : text.substr(end + 1);
    if (line.empty() || line.front() == '#' || line.front() == ';') continue;
    if (line.front() == '[') {
      WS_EXPECT(line.back() == ']' && line.size() > 2, ErrorCode::kConfig,
                std::string(origin) + ":" + std::to_string(line_number) + ": malformed section header");
      std::string_view name = trim(line.substr(1, line.size() - 2));
      if (name.starts_with("profile ")) name = trim(name.substr(8));
      current = std::string(name);
      sections[current];
      in_section = true;
      continue;
    }
    auto equals = line.find('=');
    // Say where, never what: the line may be a secret with a typo in it.
    WS_EXPECT(equals != std::string_view::npos && equals > 0, ErrorCode::kConfig,
              std::string(origin) + ":" + std::to_string(line_number) + ": expected 'name = value' or '[section]'");
    WS_EXPECT(in_section, ErrorCode::kConfig,
              std::string(origin) + ":" + std::to_string(line_number) + ": setting outside any [section]");
    sections[current][lowercase(trim(line.substr(0, equals)))] = std::string(trim(line.substr(equals + 1)));
  }
  return sections;
}

Credentials resolve_credentials(const S3Options& options) {
  Credentials credentials;
  if (options.unsigned_requests) {
    credentials.source = "none (unsigned requests)";
    return credentials;
  }
  if (!options.access_key_id.empty() || !options.secret_access_key.empty()) {
    WS_EXPECT(!options.access_key_id.empty() && !options.secret_access_key.empty(), ErrorCode::kConfig,
              std::string("incomplete S3 credentials: ") +
                  (options.access_key_id.empty() ? "a secret access key is set without an access key id"
                                                 : "an access key id is set without a secret access key") +
                  " (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY go together)");
    credentials.access_key_id = options.access_key_id;
    credentials.secret_access_key = options.secret_access_key;
    credentials.session_token = options.session_token;
    credentials.source = "options or environment (AWS_ACCESS_KEY_ID)";
    return credentials;
  }
  const std::string profile = options.profile.empty() ? "default" : options.profile;
  const std::string& path = options.credentials_file;
  std::error_code error;
  if (!path.empty() && std::filesystem::is_regular_file(path, error)) {
    auto size = std::filesystem::file_size(path, error);
    WS_EXPECT(!error && size <= kMaxCredentialsFileBytes, ErrorCode::kConfig,
              "S3 credentials file " + path + " is unreadable or larger than 1 MiB");
    std::ifstream file(path, std::ios::binary);
    WS_EXPECT(file.good(), ErrorCode::kConfig, "cannot open the S3 credentials file " + path);
    std::stringstream text;
    text << file.rdbuf();
    auto sections = parse_ini(text.str(), path);
    if (auto section = sections.find(profile); section != sections.end()) {
      auto value = [&](std::string_view key) {
        auto it = section->second.find(std::string(key));
        return it == section->second.end() ? std::string() : it->second;
      };
      credentials.access_key_id = value("aws_access_key_id");
      credentials.secret_access_key = value("aws_secret_access_key");
      credentials.session_token = value("aws_session_token");
      WS_EXPECT(!credentials.access_key_id.empty() && !credentials.secret_access_key.empty(), ErrorCode::kConfig,
                "profile '" + profile + "' of " + path +
                    " lacks aws_access_key_id or aws_secret_access_key");
      credentials.source = "profile '" + profile + "' of " + path;
      return credentials;
    }
    WS_EXPECT(profile == "default", ErrorCode::kConfig,
              "profile '" + profile + "' (AWS_PROFILE) is not in the credentials file " + path);
  } else {
    WS_EXPECT(profile == "default", ErrorCode::kConfig,
              "profile '" + profile + "' (AWS_PROFILE) was asked for but the credentials file " +
                  (path.empty() ? std::string("is not set") : path + " does not exist"));
  }
  WS_FAIL(ErrorCode::kPermission,
          "no S3 credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a [" + profile +
              "] profile in the credentials file (" + (path.empty() ? std::string("none set") : path) +
              ", AWS_SHARED_CREDENTIALS_FILE), or WEIGHTSTREAM_S3_UNSIGNED=1 for a public bucket");
}

}  // namespace weightstream::s3
