// The S3 backend against a real S3-compatible server (moto's), directly and through the
// fault-injecting proxy: pagination, connection reuse, checksums, explained 403/404,
// retries that stay within their bounds, and secrets that never reach a message.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "storage/s3_checksum.hpp"
#include "storage/s3_client.hpp"
#include "storage/test_loopback_server.hpp"
#include "storage/test_s3_fixture.hpp"
#include "weightstream/error.hpp"
#include "weightstream/storage.hpp"

namespace weightstream {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

std::span<std::byte> writable(std::string& bytes) { return std::as_writable_bytes(std::span(bytes.data(), bytes.size())); }
std::span<const std::byte> readable(const std::string& bytes) { return std::as_bytes(std::span(bytes.data(), bytes.size())); }

class S3Server : public ::testing::Test {
 protected:
  void SetUp() override {
    WS_REQUIRE_S3_SERVER();
    endpoint_ = *testing::s3_test_endpoint();
    options_ = testing::s3_test_options(endpoint_);
    bucket_ = testing::unique_bucket("s3test");
    s3::S3Client setup(options_);
    setup.create_bucket(bucket_);
    payload_ = testing::pattern_bytes(300000, 7);
    setup.put_object(bucket_, "ckpt/model.safetensors", payload_);
    // An object that carries a stored CRC-32C, as S3 keeps when the uploader sends one.
    setup.put_object(bucket_, "ckpt/checked.bin", payload_,
                     {{"x-amz-sdk-checksum-algorithm", "CRC32C"},
                      {"x-amz-checksum-crc32c", s3::crc32c_header_value(readable(payload_))}});
  }

  std::string endpoint_;
  S3Options options_;
  std::string bucket_;
  std::string payload_;
};

TEST_F(S3Server, ListsAcrossPages) {
  s3::S3Client client(options_);
  for (int i = 0; i < 7; ++i) client.put_object(bucket_, "paged/object-" + std::to_string(i), std::string(i, 'x'));
  auto objects = client.list_objects(bucket_, "paged/", "/", /*max_keys=*/2);
  ASSERT_EQ(objects.size(), 7u);
  for (int i = 0; i < 7; ++i) {
    EXPECT_EQ(objects[i].key, "paged/object-" + std::to_string(i));
    EXPECT_EQ(objects[i].size, static_cast<uint64_t>(i));
  }
  // 7 objects at 2 a page: 4 requests.
  EXPECT_EQ(client.stats().requests, 7u + 4u);
}

TEST_F(S3Server, ReusesConnections) {
  s3::S3Client client(options_);
  std::string bytes(1000, '\0');
  for (int i = 0; i < 20; ++i) client.get_range(bucket_, "ckpt/model.safetensors", i * 1000, writable(bytes));
  EXPECT_EQ(client.connections_opened(), 1u);
  EXPECT_EQ(bytes, payload_.substr(19000, 1000));
}

TEST_F(S3Server, BoundsConnectionsInFlight) {
  auto options = options_;
  options.max_connections = 2;
  s3::S3Client client(options);
  {
    std::vector<std::jthread> threads;
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([&, t] {
        std::string bytes(20000, '\0');
        for (int i = 0; i < 3; ++i) client.get_range(bucket_, "ckpt/model.safetensors", (t * 3 + i) * 10000, writable(bytes));
      });
    }
  }
  EXPECT_EQ(client.stats().requests, 24u);
  EXPECT_LE(client.connections_opened(), 2u);
}

TEST_F(S3Server, VerifiesStoredSha256) {
  s3::S3Client client(options_);
  client.put_object(bucket_, "ckpt/sha.bin", payload_,
                    {{"x-amz-sdk-checksum-algorithm", "SHA256"},
                     {"x-amz-checksum-sha256", s3::sha256_header_value(readable(payload_))}});
  auto head = client.head_object(bucket_, "ckpt/sha.bin", true);
  EXPECT_EQ(head.checksum_sha256, s3::sha256_header_value(readable(payload_)));
  auto storage = open_s3_storage(bucket_, "ckpt", options_);
  storage->stat("sha.bin");
  std::string bytes(payload_.size(), '\0');
  storage->read("sha.bin", 0, writable(bytes));
  EXPECT_EQ(bytes, payload_);
}

TEST_F(S3Server, VerifiesStoredChecksumsOnWholeReads) {
  auto storage = open_s3_storage(bucket_, "ckpt", options_);
  EXPECT_EQ(storage->stat("checked.bin").size, payload_.size());
  std::string bytes(payload_.size(), '\0');
  storage->read("checked.bin", 0, writable(bytes));
  EXPECT_EQ(bytes, payload_);

  // The same object read in 64 KiB pieces is checked after the pieces are joined.
  auto options = options_;
  options.request_bytes = 64 * 1024;
  auto split = open_s3_storage(bucket_, "ckpt", options);
  split->stat("checked.bin");
  std::fill(bytes.begin(), bytes.end(), '\0');
  split->read("checked.bin", 0, writable(bytes));
  EXPECT_EQ(bytes, payload_);
}

TEST_F(S3Server, MissingBucketAndKeyAreExplained) {
  auto storage = open_s3_storage(testing::unique_bucket("absent"), "ckpt", options_);
  try {
    storage->list();
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kNotFound);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot list s3://absent-"), HasSubstr("HTTP 404"),
                                    HasSubstr("check the bucket name"), HasSubstr("after 1 attempt")));
  }
  auto present = open_s3_storage(bucket_, "ckpt", options_);
  try {
    std::string bytes(10, '\0');
    present->read("nothing-here.safetensors", 0, writable(bytes));
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kNotFound);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot read 0+10 bytes of s3://" + bucket_ + "/ckpt/nothing-here.safetensors"),
                                    HasSubstr("NoSuchKey"), HasSubstr("check the bucket"), HasSubstr("prefix")));
  }
}

TEST_F(S3Server, UnsignedRequestsReadPublicObjects) {
  s3::S3Client client(options_);
  client.put_object(bucket_, "public/open.bin", "public bytes", {{"x-amz-acl", "public-read"}});
  auto options = options_;
  options.access_key_id.clear();
  options.secret_access_key.clear();
  options.unsigned_requests = true;
  auto storage = open_s3_storage(bucket_, "public", options);
  std::string bytes(12, '\0');
  storage->read("open.bin", 0, writable(bytes));
  EXPECT_EQ(bytes, "public bytes");
}

class S3Faults : public S3Server {
 protected:
  void SetUp() override {
    S3Server::SetUp();
    if (IsSkipped()) return;
    // The proxy holds a stalled body far longer than the client's 1 s stall timeout, so a
    // stall is always noticed by the client, never ended by the proxy.
    proxy_ = std::make_unique<testing::FaultProxy>(endpoint_, /*stall_seconds=*/10);
    options_.endpoint = proxy_->endpoint();
    options_.timeout_seconds = 1;
    storage_ = open_s3_storage(bucket_, "ckpt", options_);
  }

  std::string read(uint64_t offset, size_t size, const std::string& name = "model.safetensors") {
    std::string bytes(size, '\0');
    storage_->read(name, offset, writable(bytes));
    return bytes;
  }

  std::unique_ptr<testing::FaultProxy> proxy_;
  std::unique_ptr<Storage> storage_;
};

TEST_F(S3Faults, RecoversFromEachFaultWithinTheAttemptBound) {
  for (std::string mode : {"reset", "truncate", "overlong", "badrange", "stall", "503", "500"}) {
    SCOPED_TRACE(mode);
    proxy_->clear();
    proxy_->arm(mode, 2);
    const StorageStats before = storage_->stats();
    EXPECT_EQ(read(4096, 100000), payload_.substr(4096, 100000));
    EXPECT_EQ(proxy_->faults(), 2);
    EXPECT_EQ(proxy_->requests("GET"), 3);  // two spoiled attempts, then the good one
    // What `load --metrics-listen` shows as weightstream_storage_retries_total.
    EXPECT_EQ(storage_->stats().retries - before.retries, 2u);
    EXPECT_EQ(storage_->stats().requests - before.requests, 3u);
    EXPECT_EQ(storage_->stats().checksum_failures, 0u);
  }
}

// Neighbouring tensors read into their own memory: one GET for the range, its body
// scattered across the segments, and a retried GET starts them over.
TEST_F(S3Faults, AScatterReadIsOneRequestAndARetryRewritesEverySegment) {
  std::string first(1000, '\0'), second(60000, '\0'), third(39000, '\0');
  std::string empty;
  const std::span<std::byte> segments[] = {writable(first), writable(empty), writable(second), writable(third)};
  storage_->read_scattered("model.safetensors", 4096, segments);
  EXPECT_EQ(first + second + third, payload_.substr(4096, 100000));
  EXPECT_EQ(proxy_->requests("GET"), 1);

  proxy_->clear();
  first.assign(first.size(), '\0');
  second.assign(second.size(), '\0');
  third.assign(third.size(), '\0');
  proxy_->arm("truncate", 1);
  storage_->read_scattered("model.safetensors", 4096, segments);
  EXPECT_EQ(first + second + third, payload_.substr(4096, 100000));
  EXPECT_EQ(proxy_->requests("GET"), 2);
}

TEST_F(S3Faults, AScatterReadLargerThanARequestIsCutIntoRangesAcrossItsSegments) {
  auto options = options_;
  options.request_bytes = 32768;
  auto storage = open_s3_storage(bucket_, "ckpt", options);
  std::string first(50000, '\0'), second(50000, '\0');
  const std::span<std::byte> segments[] = {writable(first), writable(second)};
  storage->read_scattered("model.safetensors", 100, segments);
  EXPECT_EQ(first + second, payload_.substr(100, 100000));
  EXPECT_EQ(proxy_->requests("GET"), 4);  // 100000 bytes in ranges of 32768
}

TEST_F(S3Faults, AScatterReadPastTheEndIsRefusedBeforeAnyRequest) {
  storage_->list();  // the sizes are known from the listing
  proxy_->clear();
  std::string first(1000, '\0'), second(1000, '\0');
  const std::span<std::byte> segments[] = {writable(first), writable(second)};
  try {
    storage_->read_scattered("model.safetensors", payload_.size() - 1500, segments);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kIo);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot read 298500+2000 bytes of s3://" + bucket_ + "/ckpt/model.safetensors"),
                                    HasSubstr("past the end of the 300000-byte object")));
  }
  EXPECT_EQ(proxy_->requests("GET"), 0);
}

TEST_F(S3Faults, PersistentSlowDownGivesOneErrorWithEverything) {
  proxy_->arm("503", 100);
  try {
    read(4096, 100000);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kNetwork);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot read 4096+100000 bytes of s3://" + bucket_ + "/ckpt/model.safetensors"),
                                    HasSubstr("HTTP 503 SlowDown"), HasSubstr("(request id FAULTPROXY"),
                                    HasSubstr("after 5 attempts")));
    EXPECT_THAT(error.what(), Not(HasSubstr(testing::kTestSecret)));
  }
  EXPECT_EQ(proxy_->requests("GET"), 5);
}

TEST_F(S3Faults, ForbiddenIsNotRetriedAndSaysWhatToCheck) {
  proxy_->arm("403", 100, "");
  try {
    storage_->stat("model.safetensors");
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kPermission);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot stat s3://" + bucket_ + "/ckpt/model.safetensors"),
                                    HasSubstr("HTTP 403"), HasSubstr("check the credentials"),
                                    HasSubstr("region (us-east-1"), HasSubstr("after 1 attempt")));
    EXPECT_THAT(error.what(), Not(HasSubstr(testing::kTestSecret)));
  }
  EXPECT_EQ(proxy_->requests("HEAD"), 1);
  try {
    read(0, 10);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), AllOf(HasSubstr("HTTP 403 AccessDenied"), HasSubstr("check the credentials")));
    EXPECT_THAT(error.what(), Not(HasSubstr(testing::kTestSecret)));
  }
  EXPECT_EQ(proxy_->requests("GET"), 1);
}

TEST_F(S3Faults, StallsPastTheTimeoutAreTimeouts) {
  auto options = options_;
  options.max_attempts = 2;
  auto storage = open_s3_storage(bucket_, "ckpt", options);
  proxy_->arm("stall", 100);
  auto start = std::chrono::steady_clock::now();
  try {
    std::string bytes(100000, '\0');
    storage->read("model.safetensors", 0, writable(bytes));
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kTimeout);
    // The message says what had moved: the status and half of the body, not "nothing".
    EXPECT_THAT(error.what(), AllOf(HasSubstr("stall timeout (WEIGHTSTREAM_S3_TIMEOUT): no byte moved for 1 s after "
                                              "HTTP 206 and 50000 of 100000 body bytes arrived"),
                                    HasSubstr("after 2 attempts (stall timeout (WEIGHTSTREAM_S3_TIMEOUT): 2 times)")));
    EXPECT_THAT(error.what(), Not(HasSubstr("no bytes moved in either direction")));
  }
  // Two stalls of about the 1 s timeout each (noticed within a second of it), not the
  // proxy's 10 s hold.
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 8.0);
}

TEST_F(S3Faults, TheDeadlineBoundsAllAttempts) {
  auto options = options_;
  options.max_attempts = 100;
  options.retry_base_seconds = 0.2;
  options.deadline_seconds = 1.0;
  auto storage = open_s3_storage(bucket_, "ckpt", options);
  proxy_->arm("503", 1000);
  auto start = std::chrono::steady_clock::now();
  try {
    std::string bytes(10, '\0');
    storage->read("model.safetensors", 0, writable(bytes));
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kTimeout);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("deadline of 1 s passed"), HasSubstr("HTTP 503 SlowDown")));
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 2.0);
  EXPECT_LT(proxy_->requests("GET"), 100);
}

TEST_F(S3Faults, CorruptBytesAreCaughtWhereAChecksumCoversThem) {
  storage_->stat("checked.bin");
  proxy_->clear();
  proxy_->arm("corrupt", 1);
  EXPECT_EQ(read(0, payload_.size(), "checked.bin"), payload_);
  EXPECT_EQ(proxy_->requests("GET"), 2);  // the corrupted copy was refused and fetched again
  EXPECT_EQ(storage_->stats().checksum_failures, 1u);
  EXPECT_EQ(storage_->stats().retries, 1u);

  proxy_->clear();
  proxy_->arm("corrupt", 100);
  try {
    read(0, payload_.size(), "checked.bin");
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kNetwork);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("checksum mismatch"), HasSubstr("x-amz-checksum-crc32c"),
                                    HasSubstr("after 5 attempts")));
  }
}

TEST_F(S3Faults, CorruptPiecesOfAWholeObjectAreCaughtToo) {
  auto options = options_;
  options.request_bytes = 64 * 1024;
  auto storage = open_s3_storage(bucket_, "ckpt", options);
  storage->stat("checked.bin");
  proxy_->clear();
  proxy_->arm("corrupt", 1);
  std::string bytes(payload_.size(), '\0');
  storage->read("checked.bin", 0, writable(bytes));
  EXPECT_EQ(bytes, payload_);
  EXPECT_EQ(proxy_->faults(), 1);
  EXPECT_EQ(storage->stats().checksum_failures, 1u);  // the whole object, read again

  proxy_->clear();
  proxy_->arm("corrupt", 1000);
  try {
    storage->read("checked.bin", 0, writable(bytes));
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), AllOf(HasSubstr("checksum mismatch"), HasSubstr("after 5 reads")));
  }
}

TEST_F(S3Faults, SplitReadsRecoverAndFailAsOne) {
  auto options = options_;
  options.request_bytes = 32 * 1024;
  auto storage = open_s3_storage(bucket_, "ckpt", options);
  proxy_->arm("reset", 3);
  std::string bytes(payload_.size(), '\0');
  storage->read("model.safetensors", 0, writable(bytes));
  EXPECT_EQ(bytes, payload_);

  proxy_->clear();
  proxy_->arm("404", 1000);
  try {
    storage->read("model.safetensors", 0, writable(bytes));
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kNotFound);
    EXPECT_THAT(error.what(), HasSubstr("NoSuchKey"));
  }
  // 404 is not retried, and the first failure stops the other workers.
  EXPECT_LE(proxy_->requests("GET"), static_cast<int>(options.max_connections));
}

using testing::LoopbackServer;

S3Options loopback_options(const std::string& endpoint) {
  S3Options options;  // the defaults, but for where to go and who signs
  options.endpoint = endpoint;
  options.region = "us-east-1";
  options.access_key_id = "AKIDLOOPBACKTEST";
  options.secret_access_key = testing::kTestSecret;
  options.credentials_file = "";
  options.addressing = S3Addressing::kPath;
  return options;
}

TEST(S3DeadEndpoint, AnEndpointThatAcceptsAndNeverAnswersFailsWithinTenSecondsByDefault) {
  LoopbackServer dead("");
  S3Options options = loopback_options(dead.endpoint());
  auto storage = open_s3_storage("bucket", "ckpt", options);
  const auto start = std::chrono::steady_clock::now();
  try {
    storage->stat("model.safetensors");
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kTimeout);
    EXPECT_THAT(error.what(),
                AllOf(HasSubstr("cannot stat s3://bucket/ckpt/model.safetensors"),
                      HasSubstr("first-byte timeout (WEIGHTSTREAM_S3_FIRST_BYTE_TIMEOUT): no response within 3 s of "
                                "sending the request"),
                      HasSubstr("after 2 attempts (first-byte timeout (WEIGHTSTREAM_S3_FIRST_BYTE_TIMEOUT): 2 times)"),
                      HasSubstr("answered none of the last 2 attempts within the timeouts above"),
                      HasSubstr("needs longer WEIGHTSTREAM_S3_CONNECT_TIMEOUT / WEIGHTSTREAM_S3_FIRST_BYTE_TIMEOUT"),
                      HasSubstr(dead.endpoint()), Not(HasSubstr("is an S3 endpoint that is up"))));
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LE(seconds, 10.0);
  EXPECT_GE(seconds, 6.0);  // two full first-byte timeouts: it did wait for an answer
  EXPECT_EQ(dead.connections(), 2);
}

TEST(S3DeadEndpoint, TheFirstByteTimeoutIsItsOwnSetting) {
  LoopbackServer dead("");
  S3Options options = loopback_options(dead.endpoint());
  options.first_byte_timeout_seconds = 0.5;
  options.timeout_seconds = 60;  // the stall timeout plays no part before the first byte
  auto storage = open_s3_storage("bucket", "ckpt", options);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(storage->stat("model.safetensors"), Error);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
}

std::string error_response(int status, const std::string& code, const std::string& message, const std::string& request_id,
                           const std::string& region, const std::string& header_region) {
  std::string body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>" + code + "</Code><Message>" + message +
                     "</Message><RequestId>" + request_id + "</RequestId><Region>" + region + "</Region></Error>";
  return "HTTP/1.1 " + std::to_string(status) + " Whatever\r\nContent-Type: application/xml\r\nContent-Length: " +
         std::to_string(body.size()) + "\r\nx-amz-request-id: " + request_id + "\r\nx-amz-bucket-region: " +
         header_region + "\r\nConnection: close\r\n\r\n" + body;
}

TEST(S3Secrets, ServerTextThatEchoesTheSecretKeyOrTokenIsMasked) {
  const std::string token = "wsSessionToken-DoNotPrint-9876543210";
  const std::string secret = testing::kTestSecret;
  // A hostile or broken server echoes the credentials in every field it controls.
  for (int status : {403, 301, 503}) {
    SCOPED_TRACE(status);
    LoopbackServer echo(error_response(status, status == 301 ? "PermanentRedirect" : "AccessDenied",
                                       "key " + secret + " token " + token, "RID-" + secret, "eu-" + token,
                                       "hdr-" + secret));
    S3Options options = loopback_options(echo.endpoint());
    options.session_token = token;
    options.max_attempts = 2;
    options.retry_base_seconds = 0.01;
    std::vector<std::string> outputs;
    for (int operation = 0; operation < 3; ++operation) {
      try {
        s3::S3Client client(options);
        std::string bytes(16, '\0');
        if (operation == 0) client.head_object("bucket", "k");
        if (operation == 1) client.get_range("bucket", "k", 0, writable(bytes));
        if (operation == 2) client.list_objects("bucket", "p/", "/");
        ADD_FAILURE() << "expected an error";
      } catch (const Error& error) {
        outputs.push_back(error.what());
      }
    }
    for (const std::string& output : outputs) {
      EXPECT_THAT(output, Not(HasSubstr(secret)));
      EXPECT_THAT(output, Not(HasSubstr(token)));
      // Not even the start of one: masking comes before any field is cut short.
      EXPECT_THAT(output, Not(HasSubstr(secret.substr(0, 12))));
      EXPECT_THAT(output, Not(HasSubstr(token.substr(0, 12))));
    }
    // The rest of the server's text is still there to read.
    EXPECT_THAT(outputs[1], AllOf(HasSubstr("HTTP " + std::to_string(status)), HasSubstr("<redacted>")));
    if (status != 301) EXPECT_THAT(outputs[1], HasSubstr("(request id RID-<redacted>)"));
  }
}

TEST(S3Retries, AfterSeveralAttemptsEachDistinctCauseIsNamedWithItsCount) {
  S3Options options = loopback_options("http://127.0.0.1:9");
  options.retry_base_seconds = 0.001;
  s3::S3Client client(options);
  int attempt = 0;
  try {
    client.with_retries("cannot read 0+10 bytes of s3://b/k", [&](double) -> std::optional<s3::S3Client::Failure> {
      ++attempt;
      s3::S3Client::Failure failure("HTTP 503 SlowDown (request id R" + std::to_string(attempt) + ")", true);
      if (attempt == 2 || attempt == 4) failure = s3::S3Client::Failure("short body: 5 of 10 bytes", true);
      if (attempt == 5) failure = s3::S3Client::Failure("reset by peer", true);
      return failure;
    });
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), HasSubstr("cannot read 0+10 bytes of s3://b/k: reset by peer, after 5 attempts "
                                        "(HTTP 503 SlowDown: 2 times; short body: 5 of 10 bytes: 2 times; "
                                        "reset by peer: 1 time)"));
  }
  EXPECT_EQ(attempt, 5);
}

TEST(S3Retries, TwoUnansweredAttemptsInARowEndTheRequest) {
  S3Options options = loopback_options("http://127.0.0.1:9");
  options.retry_base_seconds = 0.001;
  s3::S3Client client(options);
  int attempt = 0;
  try {
    client.with_retries("cannot stat s3://b/k", [&](double) -> std::optional<s3::S3Client::Failure> {
      s3::S3Client::Failure failure("no response", true, ErrorCode::kTimeout);
      failure.kind = "first-byte timeout";
      // An answered failure between two silent ones restarts the count.
      failure.silent = ++attempt != 2;
      return failure;
    });
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kTimeout);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("after 4 attempts (first-byte timeout: 4 times)"),
                                    HasSubstr("answered none of the last 2 attempts")));
  }
  EXPECT_EQ(attempt, 4);
}

TEST(S3Secrets, UserinfoInTheEndpointUrlIsRedactedFromMessages) {
  for (std::string endpoint : {"http://user:SECRETPW@127.0.0.1:9/", "ftp://user:SECRETPW@127.0.0.1:9"}) {
    S3Options options = loopback_options(endpoint);
    try {
      s3::S3Client client(options);
      FAIL() << "expected an error";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kConfig);
      EXPECT_THAT(error.what(), Not(HasSubstr("SECRETPW")));
      EXPECT_THAT(error.what(), Not(HasSubstr("user:")));
      EXPECT_THAT(error.what(), HasSubstr("<redacted>@127.0.0.1:9"));
    }
  }
  EXPECT_EQ(storage::redact_userinfo("https://a:b@host:9000/base?x=y@z"), "https://<redacted>@host:9000/base?x=y@z");
  EXPECT_EQ(storage::redact_userinfo("https://host:9000/p@q"), "https://host:9000/p@q");
}

}  // namespace
}  // namespace weightstream
