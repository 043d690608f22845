#pragma once
// AWS Signature Version 4 (internal to the storage layer), written against AWS's
// specification: https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_sigv-create-signed-request.html
// and S3's variant: https://docs.aws.amazon.com/AmazonS3/latest/API/sig-v4-header-based-auth.html

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "storage/http_client.hpp"
#include "storage/s3_credentials.hpp"

namespace weightstream::s3 {

/// SHA-256 of the empty string, the payload hash of a GET or HEAD (hex).
inline constexpr std::string_view kEmptyPayloadSha256 =
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
/// Payload hash S3 accepts instead of a real one (and the one presigned URLs use).
inline constexpr std::string_view kUnsignedPayload = "UNSIGNED-PAYLOAD";

/// Lowercase hex of `bytes`.
std::string to_hex(std::string_view bytes);
/// SHA-256 of `data`, lowercase hex.
std::string sha256_hex(std::string_view data);
/// HMAC-SHA256 of `data` under `key`, raw 32 bytes.
std::array<unsigned char, 32> hmac_sha256(std::string_view key, std::string_view data);

// Percent-encoding and name/value pairs are the HTTP client's (storage/http_client.hpp).
using storage::Field;
using storage::uri_encode;

/// A request as SigV4 sees it.
struct SigningInput {
  std::string method = "GET";
  /// The path exactly as sent on the wire, already percent-encoded ("/bucket/my%20key").
  /// S3 signs it as is (no second encoding, no dot-segment normalisation).
  std::string encoded_path = "/";
  /// Query parameters, not encoded; the canonical form encodes and sorts them.
  std::vector<Field> query;
  /// Headers to sign, `host` included; names in any case.
  std::vector<Field> headers;
  /// Hex SHA-256 of the body, or kUnsignedPayload.
  std::string payload_hash = std::string(kEmptyPayloadSha256);
};

/// The pieces of one signature, exposed so tests can compare each against AWS's examples.
struct Signature {
  std::string canonical_request;
  std::string string_to_sign;
  std::string signed_headers;  ///< "host;range;x-amz-date"
  std::string signature;       ///< lowercase hex
  std::string authorization;   ///< the Authorization header value
};

/// The canonical query string: each name and value encoded, sorted by name then value.
std::string canonical_query(const std::vector<Field>& query);

/// Signs requests for one region and service with one set of credentials.
class SigV4Signer {
 public:
  SigV4Signer(Credentials credentials, std::string region, std::string service = "s3");

  /// Computes the signature of `input` at `amz_date` (YYYYMMDDTHHMMSSZ). The caller has
  /// put every header it wants signed in `input.headers`, x-amz-date included.
  Signature sign(const SigningInput& input, std::string_view amz_date) const;

  /// Adds x-amz-date, x-amz-content-sha256 (service s3), x-amz-security-token (with a
  /// session token) and Authorization to `input.headers`, signing all of them at `amz_date`.
  /// Unsigned credentials add nothing but x-amz-date.
  void sign_headers(SigningInput& input, std::string_view amz_date) const;

  /// The query string of a presigned URL for `input` (GET, host header only), valid for
  /// `expires_seconds` (1 to 604800) from `amz_date`, ending in X-Amz-Signature.
  /// https://docs.aws.amazon.com/AmazonS3/latest/API/sigv4-query-string-auth.html
  std::string presign_query(SigningInput input, std::string_view amz_date, uint64_t expires_seconds) const;

  /// The derived signing key for `date` (YYYYMMDD): HMAC chain over date, region, service.
  std::array<unsigned char, 32> signing_key(std::string_view date) const;

  const std::string& region() const noexcept { return region_; }
  const Credentials& credentials() const noexcept { return credentials_; }

 private:
  std::string scope(std::string_view date) const;
  Credentials credentials_;
  std::string region_;
  std::string service_;
};

/// The current UTC time as YYYYMMDDTHHMMSSZ.
std::string amz_date_now();
/// Whether `text` is a well-formed YYYYMMDDTHHMMSSZ timestamp.
bool is_amz_date(std::string_view text);

}  // namespace weightstream::s3
