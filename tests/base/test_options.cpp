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
  EXPECT_EQ(options.stream.local_io, LocalIo::kAuto);
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
  EXPECT_THAT(config_error({{"WEIGHTSTREAM_LOCAL_IO", "splice"}}), HasSubstr("expected auto, pread, direct, uring or mmap"));
  // The message lists every spelling the parser takes (it once said "0 or 1" and took yes/no/on/off).
  EXPECT_THAT(config_error({{"WEIGHTSTREAM_PROGRESS", "maybe"}}),
              HasSubstr("WEIGHTSTREAM_PROGRESS='maybe': expected 1, true, yes or on, or 0, false, no or off"));
  for (const char* yes : {"1", "true", "yes", "on"}) {
    EXPECT_TRUE(options_from_environment({{"WEIGHTSTREAM_PROGRESS", yes}}).stream.progress) << yes;
  }
  for (const char* no : {"0", "false", "no", "off"}) {
    EXPECT_FALSE(options_from_environment({{"WEIGHTSTREAM_PROGRESS", no}}).stream.progress) << no;
  }
  EXPECT_THAT(config_error({{"WEIGHTSTREAM_GPU_PATH", "pinned"}}),
              HasSubstr("WEIGHTSTREAM_GPU_PATH='pinned': expected auto, staged, mapped or both"));
  EXPECT_THAT(config_error({{"WEIGHTSTREAM_MAPPED_SHARE", "1.5"}}),
              HasSubstr("WEIGHTSTREAM_MAPPED_SHARE='1.5': expected a fraction from 0 to 1, such as 0.4"));
  EXPECT_THAT(config_error({{"WEIGHTSTREAM_MAPPED_SHARE", "half"}}),
              HasSubstr("WEIGHTSTREAM_MAPPED_SHARE='half': expected a fraction from 0 to 1"));
  EXPECT_DOUBLE_EQ(options_from_environment({{"WEIGHTSTREAM_MAPPED_SHARE", "0.25"}}).stream.mapped_share, 0.25);
  EXPECT_THAT(config_error({{"WEIGHTSTREAM_UCX_PATH", "tag"}}),
              HasSubstr("WEIGHTSTREAM_UCX_PATH='tag': expected auto, rma or rendezvous"));
  EXPECT_EQ(options_from_environment({}).ucx_path, UcxPath::kAuto);
  EXPECT_EQ(options_from_environment({{"WEIGHTSTREAM_UCX_PATH", "rma"}}).ucx_path, UcxPath::kRma);
  EXPECT_EQ(options_from_environment({{"WEIGHTSTREAM_UCX_PATH", "rendezvous"}}).ucx_path, UcxPath::kRendezvous);
  EXPECT_THAT(config_error({{"WEIGHTSTREAM_PREFETCHERS", "-1"}}),
              HasSubstr("WEIGHTSTREAM_PREFETCHERS='-1': expected a whole number from 0 to 1024"));
  EXPECT_FALSE(options_from_environment({}).stream.prefetchers.has_value());
  EXPECT_EQ(options_from_environment({{"WEIGHTSTREAM_PREFETCHERS", "0"}}).stream.prefetchers, 0u);
}

TEST(Options, StagingLimitsBelowOnePageAreRefusedNamingTheVariable) {
  EXPECT_THAT(config_error({{"WEIGHTSTREAM_MEMORY_LIMIT", "1KiB"}}),
              HasSubstr("WEIGHTSTREAM_MEMORY_LIMIT 1024 bytes is too small: at least 4KiB"));
  EXPECT_THAT(config_error({{"WEIGHTSTREAM_CHUNK_SIZE", "100"}}),
              HasSubstr("WEIGHTSTREAM_CHUNK_SIZE 100 bytes is too small: at least 4KiB"));
  EXPECT_EQ(options_from_environment({{"WEIGHTSTREAM_MEMORY_LIMIT", "4KiB"}}).stream.memory_limit, kMinStagingBytes);
}

TEST(Options, OneParserForTheReadMethodAndTheGpuPath) {
  EXPECT_EQ(parse_local_io("pread"), LocalIo::kPread);
  EXPECT_EQ(parse_local_io("direct"), LocalIo::kDirect);
  EXPECT_EQ(parse_local_io("uring"), LocalIo::kUring);
  EXPECT_EQ(parse_local_io("mmap"), LocalIo::kMmap);
  EXPECT_EQ(parse_gpu_path("auto"), GpuPath::kAuto);
  EXPECT_EQ(parse_gpu_path("staged"), GpuPath::kStaged);
  EXPECT_EQ(parse_gpu_path("mapped"), GpuPath::kMapped);
  EXPECT_EQ(parse_gpu_path("both"), GpuPath::kBoth);
  for (LocalIo io : {LocalIo::kPread, LocalIo::kDirect, LocalIo::kUring, LocalIo::kMmap}) EXPECT_EQ(parse_local_io(local_io_name(io)), io);
  for (GpuPath path : {GpuPath::kAuto, GpuPath::kStaged, GpuPath::kMapped, GpuPath::kBoth})
    EXPECT_EQ(parse_gpu_path(gpu_path_name(path)), path);
  try {
    parse_local_io("splice", "--io");
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(error.what(), HasSubstr("--io='splice': expected auto, pread, direct, uring or mmap"));
  }
  try {
    StreamOptions options;
    options.memory_limit = 1000;
    check_stream_options(options, {"concurrency", "--memory-limit", "--chunk-size"});
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(error.what(), HasSubstr("--memory-limit 1000 bytes is too small: at least 4KiB"));
  }
}

TEST(Duration, TakesUnitsAndPlainSeconds) {
  EXPECT_DOUBLE_EQ(parse_duration("1s"), 1.0);
  EXPECT_DOUBLE_EQ(parse_duration("500ms"), 0.5);
  EXPECT_DOUBLE_EQ(parse_duration("2m"), 120.0);
  EXPECT_DOUBLE_EQ(parse_duration("1h"), 3600.0);
  EXPECT_DOUBLE_EQ(parse_duration("1.5"), 1.5);
  EXPECT_DOUBLE_EQ(parse_duration("30"), 30.0);
  for (const char* bad : {"", "s", "0", "0s", "-1s", "1 s", "1sec", "fast", "1e400"}) {
    try {
      parse_duration(bad, "--expires");
      ADD_FAILURE() << "expected an error for '" << bad << "'";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
      EXPECT_THAT(error.what(), HasSubstr("--expires='" + std::string(bad) + "': expected a positive duration"));
    }
  }
}

TEST(Duration, EveryTimeVariableTakesADuration) {
  auto options = options_from_environment({{"WEIGHTSTREAM_S3_TIMEOUT", "1s"},
                                           {"WEIGHTSTREAM_S3_DEADLINE", "2m"},
                                           {"WEIGHTSTREAM_S3_RETRY_BASE", "250ms"},
                                           {"WEIGHTSTREAM_S3_CONNECT_TIMEOUT", "1500ms"},
                                           {"WEIGHTSTREAM_S3_FIRST_BYTE_TIMEOUT", "4"}});
  EXPECT_DOUBLE_EQ(options.s3.timeout_seconds, 1.0);
  EXPECT_DOUBLE_EQ(options.s3.deadline_seconds, 120.0);
  EXPECT_DOUBLE_EQ(options.s3.retry_base_seconds, 0.25);
  EXPECT_DOUBLE_EQ(options.s3.connect_timeout_seconds, 1.5);
  EXPECT_DOUBLE_EQ(options.s3.first_byte_timeout_seconds, 4.0);
  EXPECT_THAT(config_error({{"WEIGHTSTREAM_S3_FIRST_BYTE_TIMEOUT", "soon"}}),
              HasSubstr("WEIGHTSTREAM_S3_FIRST_BYTE_TIMEOUT='soon': expected a positive duration such as 500ms, 1s, 2m"));
  // A dead endpoint must fail within 10 s by default: two unanswered attempts of 3 s.
  S3Options defaults;
  EXPECT_LE(2 * (defaults.first_byte_timeout_seconds + 1), 10.0);
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
