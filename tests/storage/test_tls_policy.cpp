// TLS policy of the S3 backend (issue 7, security): certificate verification is on by
// default, no environment variable can turn it off, and the one explicit way to turn it
// off (S3Options::verify_tls = false, API only) prints a warning naming the endpoint.
// tests/python/test_security.py checks the live behaviour against a self-signed server.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "storage/s3_client.hpp"
#include "weightstream/error.hpp"
#include "weightstream/options.hpp"

namespace weightstream::s3 {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

constexpr const char* kSecret = "tlsPolicySecret/DoNotPrint+0123456789abcdef";

S3Options https_options() {
  S3Options options;
  options.endpoint = "https://127.0.0.1:9";
  options.region = "us-east-1";
  options.access_key_id = "AKIATLSPOLICY";
  options.secret_access_key = kSecret;
  options.credentials_file = "/nonexistent/credentials";
  return options;
}

TEST(TlsPolicy, VerificationIsOnWhateverTheEnvironmentSays) {
  auto options = options_from_environment({{"AWS_ENDPOINT_URL", "https://127.0.0.1:9"},
                                           {"AWS_CA_BUNDLE", "/nonexistent/ca.pem"},
                                           {"AWS_ACCESS_KEY_ID", "AKIATLSPOLICY"},
                                           {"AWS_SECRET_ACCESS_KEY", kSecret},
                                           {"WEIGHTSTREAM_S3_UNSIGNED", "1"}});
  EXPECT_TRUE(options.s3.verify_tls);
}

TEST(TlsPolicy, NoEnvironmentVariableTurnsVerificationOff) {
  // The names someone would try; each is an unknown WEIGHTSTREAM_* variable, an error.
  for (const char* name : {"WEIGHTSTREAM_S3_VERIFY_TLS", "WEIGHTSTREAM_S3_INSECURE", "WEIGHTSTREAM_VERIFY_TLS",
                           "WEIGHTSTREAM_S3_NO_VERIFY"}) {
    try {
      auto options = options_from_environment({{name, "0"}});
      ADD_FAILURE() << name << " was accepted (verify_tls " << options.s3.verify_tls << ")";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kConfig);
      EXPECT_THAT(error.what(), HasSubstr(name));
    }
  }
}

TEST(TlsPolicy, TurningVerificationOffPrintsAWarningNamingTheEndpoint) {
  S3Options options = https_options();
  options.verify_tls = false;
  ::testing::internal::CaptureStderr();
  S3Client client(options);
  std::string warning = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(warning, HasSubstr("weightstream: warning: TLS certificate verification is OFF"));
  EXPECT_THAT(warning, HasSubstr("127.0.0.1:9"));
  EXPECT_THAT(warning, Not(HasSubstr(kSecret)));
}

TEST(TlsPolicy, DefaultClientIsSilentAndVerifies) {
  S3Options options = https_options();
  ::testing::internal::CaptureStderr();
  S3Client client(options);
  EXPECT_THAT(::testing::internal::GetCapturedStderr(), IsEmpty());
  EXPECT_TRUE(client.options().verify_tls);
  EXPECT_EQ(client.endpoint().scheme, "https");
}

}  // namespace
}  // namespace weightstream::s3
