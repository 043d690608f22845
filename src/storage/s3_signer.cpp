// AWS Signature Version 4. Each step follows the numbered tasks of AWS's
// "Create a signed AWS API request" (canonical request, string to sign, signing key,
// signature); S3's departures (no double encoding of the path, x-amz-content-sha256) follow
// https://docs.aws.amazon.com/AmazonS3/latest/API/sig-v4-header-based-auth.html
#include "storage/s3_signer.hpp"

#include <openssl/evp.h>

#include <algorithm>
#include <cctype>
#include <ctime>

#include "weightstream/error.hpp"

namespace weightstream::s3 {
namespace {

constexpr std::string_view kAlgorithm = "AWS4-HMAC-SHA256";

std::string lowercase(std::string_view text) {
  std::string out(text);
  for (auto& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// Canonical header values: leading and trailing spaces trimmed, runs of spaces inside
// collapsed to one (task 1, "CanonicalHeaders").
std::string canonical_header_value(std::string_view value) {
  std::string out;
  bool space = false;
  for (char c : value) {
    if (c == ' ' || c == '\t') {
      space = !out.empty();
      continue;
    }
    if (space) out += ' ';
    space = false;
    out += c;
  }
  return out;
}

}  // namespace

std::string to_hex(std::string_view bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out += kDigits[c >> 4];
    out += kDigits[c & 15];
  }
  return out;
}

std::string sha256_hex(std::string_view data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  WS_EXPECT(EVP_Digest(data.data(), data.size(), digest, &length, EVP_sha256(), nullptr) == 1, ErrorCode::kInternal,
            "OpenSSL EVP_Digest(SHA-256) failed");
  return to_hex(std::string_view(reinterpret_cast<const char*>(digest), length));
}

std::array<unsigned char, 32> hmac_sha256(std::string_view key, std::string_view data) {
  std::array<unsigned char, 32> out{};
  size_t length = 0;
  auto* result = EVP_Q_mac(nullptr, "HMAC", nullptr, "SHA256", nullptr, key.data(), key.size(),
                           reinterpret_cast<const unsigned char*>(data.data()), data.size(), out.data(), out.size(),
                           &length);
  WS_EXPECT(result != nullptr && length == out.size(), ErrorCode::kInternal, "OpenSSL EVP_Q_mac(HMAC-SHA256) failed");
  return out;
}

std::string canonical_query(const std::vector<Field>& query) {
  std::vector<Field> encoded;
  encoded.reserve(query.size());
  for (const auto& [name, value] : query) encoded.emplace_back(uri_encode(name, false), uri_encode(value, false));
  // Sorted by encoded name (byte order), then by value for repeated names.
  std::sort(encoded.begin(), encoded.end());
  std::string out;
  for (const auto& [name, value] : encoded) {
    if (!out.empty()) out += '&';
    out += name;
    out += '=';
    out += value;
  }
  return out;
}

SigV4Signer::SigV4Signer(Credentials credentials, std::string region, std::string service)
    : credentials_(std::move(credentials)), region_(std::move(region)), service_(std::move(service)) {
  if (region_.empty()) region_ = "us-east-1";
}

std::string SigV4Signer::scope(std::string_view date) const {
  return std::string(date) + "/" + region_ + "/" + service_ + "/aws4_request";
}

std::array<unsigned char, 32> SigV4Signer::signing_key(std::string_view date) const {
  auto as_view = [](const std::array<unsigned char, 32>& key) {
    return std::string_view(reinterpret_cast<const char*>(key.data()), key.size());
  };
  const std::string secret = "AWS4" + credentials_.secret_access_key;
  auto date_key = hmac_sha256(secret, date);
  auto region_key = hmac_sha256(as_view(date_key), region_);
  auto service_key = hmac_sha256(as_view(region_key), service_);
  return hmac_sha256(as_view(service_key), "aws4_request");
}

Signature SigV4Signer::sign(const SigningInput& input, std::string_view amz_date) const {
  WS_EXPECT(is_amz_date(amz_date), ErrorCode::kInvalidArgument,
            "signing time '" + std::string(amz_date) + "' is not of the form YYYYMMDDTHHMMSSZ");
  Signature result;
  // Task 1: the canonical request.
  std::vector<Field> headers;
  headers.reserve(input.headers.size());
  for (const auto& [name, value] : input.headers) headers.emplace_back(lowercase(name), canonical_header_value(value));
  std::sort(headers.begin(), headers.end());
  std::string canonical_headers;
  for (size_t i = 0; i < headers.size(); ++i) {
    // Repeated names join their values with commas into one line.
    if (i > 0 && headers[i].first == headers[i - 1].first) {
      canonical_headers.pop_back();
      canonical_headers += ',' + headers[i].second + '\n';
      continue;
    }
    canonical_headers += headers[i].first + ':' + headers[i].second + '\n';
    if (!result.signed_headers.empty()) result.signed_headers += ';';
    result.signed_headers += headers[i].first;
  }
  result.canonical_request = input.method + '\n' + input.encoded_path + '\n' + canonical_query(input.query) + '\n' +
                             canonical_headers + '\n' + result.signed_headers + '\n' + input.payload_hash;
  // Task 2: the string to sign.
  const std::string_view date = amz_date.substr(0, 8);
  const std::string credential_scope = scope(date);
  result.string_to_sign = std::string(kAlgorithm) + '\n' + std::string(amz_date) + '\n' + credential_scope + '\n' +
                          sha256_hex(result.canonical_request);
  // Tasks 3 and 4: the signing key and the signature.
  auto key = signing_key(date);
  auto mac = hmac_sha256(std::string_view(reinterpret_cast<const char*>(key.data()), key.size()), result.string_to_sign);
  result.signature = to_hex(std::string_view(reinterpret_cast<const char*>(mac.data()), mac.size()));
  result.authorization = std::string(kAlgorithm) + " Credential=" + credentials_.access_key_id + "/" +
                         credential_scope + ", SignedHeaders=" + result.signed_headers +
                         ", Signature=" + result.signature;
  return result;
}

void SigV4Signer::sign_headers(SigningInput& input, std::string_view amz_date) const {
  input.headers.emplace_back("x-amz-date", std::string(amz_date));
  if (credentials_.anonymous()) return;
  // S3 requires the payload hash as a header too (and signs it).
  if (service_ == "s3") input.headers.emplace_back("x-amz-content-sha256", input.payload_hash);
  if (!credentials_.session_token.empty()) input.headers.emplace_back("x-amz-security-token", credentials_.session_token);
  auto signature = sign(input, amz_date);
  input.headers.emplace_back("Authorization", std::move(signature.authorization));
}

std::string SigV4Signer::presign_query(SigningInput input, std::string_view amz_date, uint64_t expires_seconds) const {
  // S3 caps presigned URLs at seven days.
  WS_EXPECT(expires_seconds >= 1 && expires_seconds <= 604800, ErrorCode::kInvalidArgument,
            "expiry of " + std::to_string(expires_seconds) + " s is out of range: 1 to 604800 (7 days)");
  WS_EXPECT(!credentials_.anonymous(), ErrorCode::kInvalidArgument,
            "cannot presign a URL without credentials (" + credentials_.source + ")");
  const std::string credential_scope = scope(amz_date.substr(0, 8));
  input.payload_hash = std::string(kUnsignedPayload);
  input.query.emplace_back("X-Amz-Algorithm", std::string(kAlgorithm));
  input.query.emplace_back("X-Amz-Credential", credentials_.access_key_id + "/" + credential_scope);
  input.query.emplace_back("X-Amz-Date", std::string(amz_date));
  input.query.emplace_back("X-Amz-Expires", std::to_string(expires_seconds));
  if (!credentials_.session_token.empty()) input.query.emplace_back("X-Amz-Security-Token", credentials_.session_token);
  std::vector<Field> headers = input.headers;
  std::string signed_headers;
  for (auto& [name, value] : headers) name = lowercase(name);
  std::sort(headers.begin(), headers.end());
  for (const auto& [name, value] : headers) signed_headers += (signed_headers.empty() ? "" : ";") + name;
  input.query.emplace_back("X-Amz-SignedHeaders", signed_headers);
  auto signature = sign(input, amz_date);
  return canonical_query(input.query) + "&X-Amz-Signature=" + signature.signature;
}

std::string amz_date_now() {
  std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char text[32];
  std::strftime(text, sizeof(text), "%Y%m%dT%H%M%SZ", &utc);
  return text;
}

bool is_amz_date(std::string_view text) {
  if (text.size() != 16 || text[8] != 'T' || text[15] != 'Z') return false;
  for (size_t i = 0; i < 15; ++i) {
    if (i != 8 && !std::isdigit(static_cast<unsigned char>(text[i]))) return false;
  }
  auto number = [&](size_t at, size_t length) { return std::stoi(std::string(text.substr(at, length))); };
  int month = number(4, 2), day = number(6, 2), hour = number(9, 2), minute = number(11, 2), second = number(13, 2);
  return month >= 1 && month <= 12 && day >= 1 && day <= 31 && hour <= 23 && minute <= 59 && second <= 60;
}

}  // namespace weightstream::s3
