// The S3 backend's parsers of untrusted text: credentials files, ListObjectsV2 pages,
// error bodies; and the checksums S3 stores.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "storage/s3_checksum.hpp"
#include "storage/s3_credentials.hpp"
#include "storage/s3_listing.hpp"
#include "support/test_support.hpp"
#include "weightstream/error.hpp"

namespace weightstream::s3 {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr const char* kSecret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";

std::span<const std::byte> bytes_of(std::string_view text) {
  return std::as_bytes(std::span(text.data(), text.size()));
}

TEST(S3Credentials, ExplicitKeysComeFirst) {
  S3Options options;
  options.access_key_id = "AKIAEXPLICIT";
  options.secret_access_key = kSecret;
  options.session_token = "token";
  options.credentials_file = "/nonexistent/credentials";
  auto credentials = resolve_credentials(options);
  EXPECT_EQ(credentials.access_key_id, "AKIAEXPLICIT");
  EXPECT_EQ(credentials.session_token, "token");
  EXPECT_THAT(credentials.source, Not(HasSubstr(kSecret)));
}

TEST(S3Credentials, UnsignedWhenAsked) {
  S3Options options;
  options.access_key_id = "AKIAEXPLICIT";
  options.secret_access_key = kSecret;
  options.unsigned_requests = true;
  EXPECT_TRUE(resolve_credentials(options).anonymous());
}

TEST(S3Credentials, HalfAPairIsAnErrorThatHidesTheSecret) {
  S3Options options;
  options.secret_access_key = kSecret;
  try {
    resolve_credentials(options);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kConfig);
    EXPECT_THAT(error.what(), HasSubstr("AWS_ACCESS_KEY_ID"));
    EXPECT_THAT(error.what(), Not(HasSubstr(kSecret)));
  }
}

TEST(S3Credentials, SharedFileWithProfiles) {
  testing::TempDir directory;
  auto path = directory / "credentials";
  testing::write_file(path,
                      "# comment\n[default]\naws_access_key_id = AKIADEFAULT\naws_secret_access_key = " +
                          std::string(kSecret) +
                          "\n\n[profile other]\n; another comment\nAWS_ACCESS_KEY_ID=AKIAOTHER\n"
                          "aws_secret_access_key=other-secret\naws_session_token = tok\n");
  S3Options options;
  options.credentials_file = path.string();
  options.profile = "default";
  auto credentials = resolve_credentials(options);
  EXPECT_EQ(credentials.access_key_id, "AKIADEFAULT");
  EXPECT_EQ(credentials.secret_access_key, kSecret);
  EXPECT_THAT(credentials.source, HasSubstr("profile 'default'"));

  options.profile = "other";
  credentials = resolve_credentials(options);
  EXPECT_EQ(credentials.access_key_id, "AKIAOTHER");
  EXPECT_EQ(credentials.session_token, "tok");

  options.profile = "missing";
  try {
    resolve_credentials(options);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kConfig);
    EXPECT_THAT(error.what(), HasSubstr("'missing'"));
    EXPECT_THAT(error.what(), HasSubstr(path.string()));
  }
}

TEST(S3Credentials, MalformedFileNamesTheLineNotTheText) {
  testing::TempDir directory;
  auto path = directory / "credentials";
  testing::write_file(path, "[default]\naws_access_key_id AKIA\n" + std::string(kSecret) + "\n");
  S3Options options;
  options.credentials_file = path.string();
  try {
    resolve_credentials(options);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), HasSubstr(":2:"));
    EXPECT_THAT(error.what(), Not(HasSubstr(kSecret)));
  }
}

TEST(S3Credentials, NoneFoundSaysWhatWasTried) {
  S3Options options;
  options.credentials_file = "/nonexistent/credentials";
  try {
    resolve_credentials(options);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kPermission);
    EXPECT_THAT(error.what(), HasSubstr("AWS_ACCESS_KEY_ID"));
    EXPECT_THAT(error.what(), HasSubstr("/nonexistent/credentials"));
    EXPECT_THAT(error.what(), HasSubstr("WEIGHTSTREAM_S3_UNSIGNED"));
  }
}

TEST(S3Listing, ParsesAPage) {
  auto page = parse_list_page(R"(<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">
  <Name>bucket</Name><Prefix>models/</Prefix><KeyCount>2</KeyCount><MaxKeys>2</MaxKeys>
  <IsTruncated>true</IsTruncated><NextContinuationToken>1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=</NextContinuationToken>
  <Contents><Key>models/a &amp; b.safetensors</Key><Size>18446744073709551615</Size><ETag>"x"</ETag></Contents>
  <Contents><Key>models/config.json</Key><Size>0</Size></Contents>
  <CommonPrefixes><Prefix>models/sub/</Prefix></CommonPrefixes>
</ListBucketResult>)");
  ASSERT_EQ(page.objects.size(), 2u);
  EXPECT_EQ(page.objects[0].key, "models/a & b.safetensors");
  EXPECT_EQ(page.objects[0].size, UINT64_MAX);
  EXPECT_EQ(page.objects[1].size, 0u);
  EXPECT_TRUE(page.truncated);
  EXPECT_EQ(page.next_token, "1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=");
  ASSERT_EQ(page.common_prefixes.size(), 1u);
  EXPECT_EQ(page.common_prefixes[0], "models/sub/");
}

TEST(S3Listing, RejectsHostilePages) {
  auto expect_format_error = [](std::string_view xml, std::string_view needle) {
    try {
      parse_list_page(xml);
      ADD_FAILURE() << "expected an error for " << xml;
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kFormat);
      EXPECT_THAT(error.what(), HasSubstr(std::string(needle)));
    }
  };
  expect_format_error("<ListBucketResult><Contents><Key>k</Key><Size>-1</Size></Contents></ListBucketResult>", "Size '-1'");
  expect_format_error("<ListBucketResult><Contents><Key>k</Key><Size>18446744073709551616</Size></Contents></ListBucketResult>",
                      "not a whole number");
  expect_format_error("<ListBucketResult><Contents><Size>1</Size></Contents></ListBucketResult>", "without <Key>");
  expect_format_error("<ListBucketResult><IsTruncated>true</IsTruncated></ListBucketResult>", "NextContinuationToken");
  expect_format_error("<Error><Code>AccessDenied</Code></Error>", "<Error>");
  expect_format_error("<ListBucketResult><Contents>", "malformed");
  expect_format_error("", "malformed");
}

TEST(S3Listing, ParsesErrorBodiesLeniently) {
  auto body = parse_error_body(R"(<?xml version="1.0" encoding="UTF-8"?>
<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message><RequestId>7F3A</RequestId></Error>)");
  EXPECT_EQ(body.code, "SlowDown");
  EXPECT_EQ(body.message, "Please reduce your request rate.");
  EXPECT_EQ(body.request_id, "7F3A");
  EXPECT_TRUE(parse_error_body("not xml at all").code.empty());
  EXPECT_TRUE(parse_error_body("<html><body>502 Bad Gateway</body></html>").code.empty());
  EXPECT_LE(parse_error_body("<Error><Code>" + std::string(10000, 'A') + "</Code></Error>").code.size(), 210u);
}

TEST(S3Checksum, Crc32cMatchesTheCatalogue) {
  // Check value of CRC-32/ISCSI in the CRC catalogue.
  EXPECT_EQ(crc32c(bytes_of("123456789")), 0xE3069283u);
  EXPECT_EQ(crc32c(bytes_of("")), 0u);
  // RFC 3720 B.4: 32 bytes of zeros, and of 0xFF.
  std::string zeros(32, '\0'), ones(32, '\xff');
  EXPECT_EQ(crc32c(bytes_of(zeros)), 0x8A9136AAu);
  EXPECT_EQ(crc32c(bytes_of(ones)), 0x62A8AB43u);
  // Continuing a CRC equals computing it in one go (and odd lengths take the tail path).
  std::string text = "The quick brown fox jumps over the lazy dog, thirteen times.";
  EXPECT_EQ(crc32c(bytes_of(text.substr(7)), crc32c(bytes_of(text.substr(0, 7)))), crc32c(bytes_of(text)));
}

TEST(S3Checksum, HeaderValuesAreBase64OfBigEndian) {
  // crc32c("123456789") = E3 06 92 83.
  EXPECT_EQ(crc32c_header_value(bytes_of("123456789")), "4waSgw==");
  // SHA-256 of the empty string, base64.
  EXPECT_EQ(sha256_header_value(bytes_of("")), "47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU=");
}

TEST(S3Checksum, Base64RoundTripsAndRejects) {
  for (std::string text : {"", "f", "fo", "foo", "foob", "fooba", "foobar"}) {
    auto decoded = base64_decode(base64_encode(text));
    ASSERT_TRUE(decoded.has_value());
    EXPECT_EQ(*decoded, text);
  }
  EXPECT_EQ(base64_encode("foobar"), "Zm9vYmFy");
  EXPECT_FALSE(base64_decode("Zm9").has_value());
  EXPECT_FALSE(base64_decode("Zm=v").has_value());
  EXPECT_FALSE(base64_decode("Zm9*").has_value());
}

}  // namespace
}  // namespace weightstream::s3
