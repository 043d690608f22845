// Configuration read in one place: every WEIGHTSTREAM_* variable, sizes, and the errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "weightstream/error.hpp"
#include "weightstream/options.hpp"

namespace weightstream {
namespace {

using ::testing::HasSubstr;

std::string config_error(const Environment& environment) {
  try {
    options_from_environment(environment);
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kConfig);
    return error.what();
  }
  return "no error";
}

TEST(Options, DefaultsWithEmptyEnvironment) {
  auto options = options_from_environment({});
  EXPECT_EQ(options.stream.concurrency, 16u);
  EXPECT_EQ(options.stream.memory_limit, kGiB);
  EXPECT_EQ(options.stream.local_io, LocalIo::kPread);
  EXPECT_TRUE(options.s3.verify_tls);
}

TEST(Options, ReadsEveryStreamVariable) {
  auto options = options_from_environment({{"WEIGHTSTREAM_CONCURRENCY", "4"},
                                           {"WEIGHTSTREAM_MEMORY_LIMIT", "256MiB"},
                                           {"WEIGHTSTREAM_CHUNK_SIZE", "1MiB"},
                                           {"WEIGHTSTREAM_LOCAL_IO", "direct"},
                                           {"WEIGHTSTREAM_PROGRESS", "1"}});
  EXPECT_EQ(options.stream.concurrency, 4u);
  EXPECT_EQ(options.stream.memory_limit, 256 * kMiB);
  EXPECT_EQ(options.stream.chunk_bytes, kMiB);
  EXPECT_EQ(options.stream.local_io, LocalIo::kDirect);
  EXPECT_TRUE(options.stream.progress);
}

TEST(Options, MalformedValuesNameTheVariable) {
  EXPECT_THAT(config_error({{"WEIGHTSTREAM_CONCURRENCY", "0"}}), HasSubstr("WEIGHTSTREAM_CONCURRENCY='0'"));
  EXPECT_THAT(config_error({{"WEIGHTSTREAM_CONCURRENCY", "four"}}), HasSubstr("expected a whole number"));
  EXPECT_THAT(config_error({{"WEIGHTSTREAM_MEMORY_LIMIT", "lots"}}), HasSubstr("WEIGHTSTREAM_MEMORY_LIMIT='lots'"));
  EXPECT_THAT(config_error({{"WEIGHTSTREAM_LOCAL_IO", "mmap"}}), HasSubstr("expected pread, direct or uring"));
  EXPECT_THAT(config_error({{"WEIGHTSTREAM_PROGRESS", "maybe"}}), HasSubstr("expected 0 or 1"));
}

TEST(Options, UnknownVariableIsAnError) {
  EXPECT_THAT(config_error({{"WEIGHTSTREAM_MEMORYLIMIT", "1GiB"}}), HasSubstr("unknown environment variable WEIGHTSTREAM_MEMORYLIMIT"));
}

TEST(Options, ModelUriAliasesMustAgree) {
  EXPECT_EQ(options_from_environment({{"MX_MODEL_URI", "s3://b/m"}}).model_uri, "s3://b/m");
  EXPECT_EQ(options_from_environment({{"WEIGHTSTREAM_MODEL_URI", "s3://b/m"}, {"MX_MODEL_URI", "s3://b/m"}}).model_uri, "s3://b/m");
  EXPECT_THAT(config_error({{"WEIGHTSTREAM_MODEL_URI", "s3://b/a"}, {"MX_MODEL_URI", "s3://b/b"}}), HasSubstr("disagree"));
}

TEST(Options, ModelUriRemembersWhereItCameFrom) {
  EXPECT_EQ(options_from_environment({{"MX_MODEL_URI", "s3://b/m"}}).model_uri_origin, "MX_MODEL_URI");
  EXPECT_EQ(options_from_environment({{"WEIGHTSTREAM_MODEL_URI", "s3://b/m"}}).model_uri_origin, "WEIGHTSTREAM_MODEL_URI");
  EXPECT_EQ(options_from_environment({{"WEIGHTSTREAM_MODEL_URI", "s3://b/m"}, {"MX_MODEL_URI", "s3://b/m"}}).model_uri_origin,
            "WEIGHTSTREAM_MODEL_URI");
  // Set by the caller, it is an option.
  EXPECT_EQ(Options{}.model_uri_origin, kModelUriOption);
  EXPECT_EQ(options_from_environment({}).model_uri_origin, kModelUriOption);
}

TEST(Options, AwsVariablesInTheirOrder) {
  auto options = options_from_environment({{"AWS_ENDPOINT_URL", "http://a"}, {"AWS_ENDPOINT_URL_S3", "http://b"},
                                           {"AWS_DEFAULT_REGION", "eu-west-1"}, {"HOME", "/home/u"}});
  EXPECT_EQ(options.s3.endpoint, "http://b");
  EXPECT_EQ(options.s3.region, "eu-west-1");
  EXPECT_EQ(options.s3.credentials_file, "/home/u/.aws/credentials");
  EXPECT_EQ(options.s3.profile, "default");
}

TEST(Size, ParsesUnits) {
  EXPECT_EQ(parse_size("4096"), 4096u);
  EXPECT_EQ(parse_size("64MiB"), 64 * kMiB);
  EXPECT_EQ(parse_size("2GiB"), 2 * kGiB);
  EXPECT_EQ(parse_size("1.5GB"), 1'500'000'000u);
  EXPECT_EQ(parse_size("512k"), 512 * kKiB);
  EXPECT_THROW(parse_size(""), Error);
  EXPECT_THROW(parse_size("1.5"), Error);
  EXPECT_THROW(parse_size("99999999999TiB"), Error);
  try {
    parse_size("7 bananas", "--memory-limit");
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), HasSubstr("--memory-limit='7 bananas'"));
  }
}

}  // namespace
}  // namespace weightstream
