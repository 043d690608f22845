// SigV4 against AWS's published examples:
// - the Signature Version 4 test suite (credential scope AKIDEXAMPLE/20150830/us-east-1/service):
//   https://docs.aws.amazon.com/general/latest/gr/signature-v4-test-suite.html
// - the signing-key derivation example of the IAM user guide,
// - S3's worked examples (examplebucket, 20130524T000000Z):
//   https://docs.aws.amazon.com/AmazonS3/latest/API/sig-v4-header-based-auth.html and
//   https://docs.aws.amazon.com/AmazonS3/latest/API/sigv4-query-string-auth.html
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "storage/s3_client.hpp"
#include "storage/s3_signer.hpp"

namespace weightstream::s3 {
namespace {

using ::testing::HasSubstr;

Credentials suite_credentials() {
  return {"AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "", "test"};
}

Credentials s3_example_credentials() {
  return {"AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "", "test"};
}

std::string hex_of(const std::array<unsigned char, 32>& bytes) {
  return to_hex(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
}

TEST(SigV4, DerivesTheSigningKeyOfTheDocumentation) {
  SigV4Signer signer(suite_credentials(), "us-east-1", "iam");
  EXPECT_EQ(hex_of(signer.signing_key("20150830")), "c4afb1cc5771d871763a393e44b703571b55cc28424d1a5e86da6ed3c154a4b9");
}

TEST(SigV4, TestSuiteGetVanilla) {
  SigV4Signer signer(suite_credentials(), "us-east-1", "service");
  SigningInput input;
  input.headers = {{"Host", "example.amazonaws.com"}, {"X-Amz-Date", "20150830T123600Z"}};
  auto signature = signer.sign(input, "20150830T123600Z");
  EXPECT_EQ(signature.canonical_request,
            "GET\n/\n\nhost:example.amazonaws.com\nx-amz-date:20150830T123600Z\n\nhost;x-amz-date\n"
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(signature.string_to_sign,
            "AWS4-HMAC-SHA256\n20150830T123600Z\n20150830/us-east-1/service/aws4_request\n"
            "bb579772317eb040ac9ed261061d46c1f17a8133879d6129b6e1c25292927e63");
  EXPECT_EQ(signature.signature, "5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31");
  EXPECT_EQ(signature.authorization,
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, "
            "SignedHeaders=host;x-amz-date, Signature=5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31");
}

TEST(SigV4, TestSuiteGetVanillaQueryOrderKeyCase) {
  SigV4Signer signer(suite_credentials(), "us-east-1", "service");
  SigningInput input;
  input.query = {{"Param2", "value2"}, {"Param1", "value1"}};
  input.headers = {{"Host", "example.amazonaws.com"}, {"X-Amz-Date", "20150830T123600Z"}};
  auto signature = signer.sign(input, "20150830T123600Z");
  EXPECT_THAT(signature.canonical_request, HasSubstr("GET\n/\nParam1=value1&Param2=value2\n"));
  EXPECT_EQ(signature.signature, "b97d918cfa904a5beff61c982a1b6f458b799221646efd99d3219ec94cdf2500");
}

TEST(SigV4, S3ExampleGetObjectWithRange) {
  SigV4Signer signer(s3_example_credentials(), "us-east-1");
  SigningInput input;
  input.encoded_path = "/test.txt";
  input.headers = {{"Host", "examplebucket.s3.amazonaws.com"}, {"Range", "bytes=0-9"}};
  signer.sign_headers(input, "20130524T000000Z");
  std::string authorization;
  for (const auto& [name, value] : input.headers)
    if (name == "Authorization") authorization = value;
  EXPECT_EQ(authorization,
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
            "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
            "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41");
  // The documented intermediate: SHA-256 of the canonical request.
  input.headers.pop_back();
  auto signature = signer.sign(input, "20130524T000000Z");
  EXPECT_THAT(signature.string_to_sign,
              HasSubstr("20130524/us-east-1/s3/aws4_request\n"
                        "7344ae5b7ee6c3e7e6b0fe0640412a37625d1fbfff95c48bbb2dc43964946972"));
}

TEST(SigV4, S3ExamplePutObjectEncodesTheKey) {
  SigV4Signer signer(s3_example_credentials(), "us-east-1");
  SigningInput input;
  input.method = "PUT";
  input.encoded_path = "/" + uri_encode("test$file.text", true);
  EXPECT_EQ(input.encoded_path, "/test%24file.text");
  input.payload_hash = sha256_hex("Welcome to Amazon S3.");
  EXPECT_EQ(input.payload_hash, "44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072");
  input.headers = {{"Host", "examplebucket.s3.amazonaws.com"},
                   {"Date", "Fri, 24 May 2013 00:00:00 GMT"},
                   {"x-amz-storage-class", "REDUCED_REDUNDANCY"},
                   {"x-amz-content-sha256", input.payload_hash},
                   {"x-amz-date", "20130524T000000Z"}};
  auto signature = signer.sign(input, "20130524T000000Z");
  EXPECT_EQ(signature.signed_headers, "date;host;x-amz-content-sha256;x-amz-date;x-amz-storage-class");
  EXPECT_EQ(signature.signature, "98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd");
}

TEST(SigV4, S3ExampleListObjects) {
  SigV4Signer signer(s3_example_credentials(), "us-east-1");
  SigningInput input;
  input.query = {{"prefix", "J"}, {"max-keys", "2"}};
  input.headers = {{"Host", "examplebucket.s3.amazonaws.com"}};
  signer.sign_headers(input, "20130524T000000Z");
  std::string authorization = input.headers.back().second;
  EXPECT_THAT(authorization, HasSubstr("Signature=34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7"));
  input.headers.pop_back();
  auto signature = signer.sign(input, "20130524T000000Z");
  EXPECT_THAT(signature.canonical_request, HasSubstr("GET\n/\nmax-keys=2&prefix=J\n"));
  EXPECT_THAT(signature.string_to_sign, HasSubstr("df57d21db20da04d7fa30298dd4488ba3a2b47ca3a489c74750e0f1e7df1b9b7"));
}

TEST(SigV4, S3ExamplePresignedUrl) {
  S3Options options;
  options.access_key_id = "AKIAIOSFODNN7EXAMPLE";
  options.secret_access_key = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";
  options.region = "us-east-1";
  options.credentials_file = "";
  S3Client client(options);
  auto url = client.presign_get("examplebucket", "test.txt", 86400, "20130524T000000Z");
  EXPECT_EQ(url,
            "https://examplebucket.s3.amazonaws.com/test.txt"
            "?X-Amz-Algorithm=AWS4-HMAC-SHA256"
            "&X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F20130524%2Fus-east-1%2Fs3%2Faws4_request"
            "&X-Amz-Date=20130524T000000Z&X-Amz-Expires=86400&X-Amz-SignedHeaders=host"
            "&X-Amz-Signature=aeeed9bbccd4d02ee5c0109b86d86835f995330da4c265957d157751f604d404");
}

TEST(SigV4, PresignRefusesBadExpiryAndMissingCredentials) {
  SigV4Signer signer(s3_example_credentials(), "us-east-1");
  SigningInput input;
  input.headers = {{"host", "examplebucket.s3.amazonaws.com"}};
  try {
    signer.presign_query(input, "20130524T000000Z", 604801);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(error.what(), HasSubstr("604800"));
  }
  SigV4Signer anonymous(Credentials{"", "", "", "none (unsigned requests)"}, "us-east-1");
  EXPECT_THROW(anonymous.presign_query(input, "20130524T000000Z", 60), Error);
}

TEST(SigV4, SessionTokenIsSignedAndSent) {
  Credentials credentials = s3_example_credentials();
  credentials.session_token = "FQoGZXIvYXdzEXAMPLETOKEN";
  SigV4Signer signer(credentials, "us-east-1");
  SigningInput input;
  input.headers = {{"host", "examplebucket.s3.amazonaws.com"}};
  signer.sign_headers(input, "20130524T000000Z");
  bool sent = false;
  for (const auto& [name, value] : input.headers) sent |= name == "x-amz-security-token" && value == credentials.session_token;
  EXPECT_TRUE(sent);
  EXPECT_THAT(input.headers.back().second, HasSubstr("x-amz-security-token"));
}

TEST(SigV4, UnsignedRequestsCarryNoAuthorization) {
  SigV4Signer signer(Credentials{"", "", "", "none"}, "us-east-1");
  SigningInput input;
  input.headers = {{"host", "h"}};
  signer.sign_headers(input, "20130524T000000Z");
  for (const auto& [name, value] : input.headers) EXPECT_NE(name, "Authorization");
}

TEST(SigV4, UriEncodingFollowsRfc3986) {
  EXPECT_EQ(uri_encode("a b/c~d_e.f-g", true), "a%20b/c~d_e.f-g");
  EXPECT_EQ(uri_encode("a b/c", false), "a%20b%2Fc");
  EXPECT_EQ(uri_encode("\xe1\x88\xb4", false), "%E1%88%B4");
  EXPECT_EQ(uri_encode("+=&", false), "%2B%3D%26");
  EXPECT_EQ(canonical_query({{"b", "2"}, {"a", "x y"}, {"A", "0"}}), "A=0&a=x%20y&b=2");
  EXPECT_EQ(canonical_query({{"list-type", "2"}, {"continuation-token", "1/abc=="}}),
            "continuation-token=1%2Fabc%3D%3D&list-type=2");
}

TEST(SigV4, HeaderValuesAreTrimmedAndCollapsed) {
  SigV4Signer signer(suite_credentials(), "us-east-1", "service");
  SigningInput input;
  input.headers = {{"Host", "example.amazonaws.com"}, {"My-Header1", "  value1   value2  "}, {"X-Amz-Date", "20150830T123600Z"}};
  auto signature = signer.sign(input, "20150830T123600Z");
  EXPECT_THAT(signature.canonical_request, HasSubstr("\nmy-header1:value1 value2\n"));
}

TEST(SigV4, AmzDateIsValidated) {
  EXPECT_TRUE(is_amz_date("20130524T000000Z"));
  EXPECT_TRUE(is_amz_date(amz_date_now()));
  EXPECT_FALSE(is_amz_date("2013-05-24T00:00:00Z"));
  EXPECT_FALSE(is_amz_date("20131324T000000Z"));
  EXPECT_FALSE(is_amz_date("20130524T250000Z"));
  SigV4Signer signer(suite_credentials(), "us-east-1");
  EXPECT_THROW(signer.sign(SigningInput{}, "yesterday"), Error);
}

TEST(S3Endpoint, AddressingFollowsTheOptions) {
  S3Options options;
  options.unsigned_requests = true;
  options.region = "eu-west-1";
  S3Client aws(options);
  EXPECT_EQ(aws.target("my-bucket", "dir/a b.safetensors").url,
            "https://my-bucket.s3.eu-west-1.amazonaws.com/dir/a%20b.safetensors");
  // A bucket with dots cannot be virtual-hosted under TLS: path-style instead.
  EXPECT_EQ(aws.target("my.bucket", "k").url, "https://s3.eu-west-1.amazonaws.com/my.bucket/k");

  options.endpoint = "http://127.0.0.1:9000/";
  S3Client custom(options);
  auto target = custom.target("bucket", "model.safetensors", {{"list-type", "2"}});
  EXPECT_EQ(target.url, "http://127.0.0.1:9000/bucket/model.safetensors?list-type=2");
  EXPECT_EQ(target.host, "127.0.0.1:9000");
  EXPECT_EQ(target.encoded_path, "/bucket/model.safetensors");

  options.addressing = S3Addressing::kVirtual;
  options.endpoint = "https://storage.example.com";
  S3Client virtual_hosted(options);
  EXPECT_EQ(virtual_hosted.target("bucket", "k").url, "https://bucket.storage.example.com/k");

  options.endpoint = "ftp://storage.example.com";
  try {
    S3Client bad(options);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kConfig);
    EXPECT_THAT(error.what(), HasSubstr("http:// or https://"));
  }
}

TEST(S3ContentRange, ParsesAndRejects) {
  auto range = storage::parse_content_range("bytes 4096-8191/1048576");
  ASSERT_TRUE(range.has_value());
  EXPECT_EQ(range->first, 4096u);
  EXPECT_EQ(range->last, 8191u);
  EXPECT_EQ(range->total, 1048576u);
  EXPECT_TRUE(storage::parse_content_range("bytes 0-9/*").has_value());
  EXPECT_FALSE(storage::parse_content_range("bytes 9-0/10").has_value());
  EXPECT_FALSE(storage::parse_content_range("bytes 0-10/10").has_value());
  EXPECT_FALSE(storage::parse_content_range("bytes=0-9/10").has_value());
  EXPECT_FALSE(storage::parse_content_range("bytes 0-99999999999999999999/1").has_value());
}

}  // namespace
}  // namespace weightstream::s3
