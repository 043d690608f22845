// The GCS backend (gs://) against the real emulator fake-gcs-server, directly and through the
// fault-injecting proxy (the S3 path's fault suite, with the JSON API's error documents);
// credentials as Google's libraries find them: the service-account JWT checked with the key's
// public half, key files that cannot be used, a token endpoint that refuses, the metadata
// server, token reuse and renewal; and no secret in any message.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rsa.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>

#include "storage/gcs_client.hpp"
#include "storage/gcs_credentials.hpp"
#include "storage/s3_checksum.hpp"
#include "storage/test_gcs_fixture.hpp"
#include "storage/test_loopback_server.hpp"
#include "support/test_support.hpp"
#include "weightstream/error.hpp"
#include "weightstream/storage.hpp"

namespace weightstream {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::json_response;
using testing::LoopbackServer;

std::span<std::byte> writable(std::string& bytes) { return std::as_writable_bytes(std::span(bytes.data(), bytes.size())); }

/// A token no message may show.
constexpr const char* kTestToken = "ya29.wsTestTokenDoNotPrint0123456789";

class GcsServer : public ::testing::Test {
 protected:
  void SetUp() override {
    WS_REQUIRE_GCS_SERVER();
    endpoint_ = *testing::gcs_test_endpoint();
    options_ = testing::gcs_test_options(endpoint_);
    bucket_ = testing::unique_bucket("gcstest");
    gcs::GcsClient setup(options_.gcs, options_.s3);
    setup.create_bucket(bucket_);
    payload_ = testing::pattern_bytes(300000, 7);
    setup.put_object(bucket_, "ckpt/model.safetensors", payload_);
    setup.put_object(bucket_, "ckpt/a b+c%d.bin", "encoded name");
    setup.put_object(bucket_, "ckpt/nested/hidden.bin", "hidden");
    setup.put_object(bucket_, "ckpt-other/outside.bin", "outside");
  }

  std::string endpoint_;
  Options options_;
  std::string bucket_;
  std::string payload_;
};

TEST_F(GcsServer, ListsStatsAndReadsThroughTheJsonApi) {
  auto storage = open_gcs_storage(bucket_, "ckpt", options_);
  EXPECT_EQ(storage->root_uri(), "gs://" + bucket_ + "/ckpt");
  EXPECT_EQ(storage->object_uri("model.safetensors"), "gs://" + bucket_ + "/ckpt/model.safetensors");
  std::map<std::string, uint64_t> sizes;
  for (const auto& object : storage->list()) sizes[object.name] = object.size;
  EXPECT_EQ(sizes, (std::map<std::string, uint64_t>{{"model.safetensors", 300000}, {"a b+c%d.bin", 12}}));
  EXPECT_EQ(storage->stat("model.safetensors").size, 300000u);
  std::string range(100000, '\0');
  storage->read("model.safetensors", 4096, writable(range));
  EXPECT_EQ(range, payload_.substr(4096, 100000));
  std::string whole(payload_.size(), '\0');
  storage->read("model.safetensors", 0, writable(whole));  // one request, checked against x-goog-hash
  EXPECT_EQ(whole, payload_);
  std::string encoded(12, '\0');
  storage->read("a b+c%d.bin", 0, writable(encoded));
  EXPECT_EQ(encoded, "encoded name");
}

TEST_F(GcsServer, ReadsRunInParallelPiecesOnPooledConnections) {
  auto options = options_;
  options.s3.request_bytes = 16 * 1024;
  options.s3.max_connections = 4;
  gcs::GcsClient client(options.gcs, options.s3);
  auto storage = open_gcs_storage(bucket_, "ckpt", options);
  storage->stat("model.safetensors");
  std::string whole(payload_.size(), '\0');
  storage->read("model.safetensors", 0, writable(whole));  // 19 ranges, checked against the stored crc32c
  EXPECT_EQ(whole, payload_);
  for (int i = 0; i < 20; ++i) client.metadata(bucket_, "ckpt/model.safetensors");
  EXPECT_EQ(client.connections_opened(), 1u);  // one after another: one reused connection
}

TEST_F(GcsServer, MissingObjectAndBucketAreExplained) {
  auto storage = open_gcs_storage(bucket_, "ckpt", options_);
  try {
    storage->stat("absent.safetensors");
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kNotFound);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot stat gs://" + bucket_ + "/ckpt/absent.safetensors"),
                                    HasSubstr("no object gs://" + bucket_ + "/ckpt/absent.safetensors (HTTP 404"),
                                    HasSubstr("after 1 attempt"), HasSubstr("check the bucket")));
  }
  try {
    std::string bytes(16, '\0');
    storage->read("absent.safetensors", 0, writable(bytes));
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kNotFound);
    EXPECT_THAT(error.what(), HasSubstr("cannot read 0+16 bytes of gs://" + bucket_ + "/ckpt/absent.safetensors"));
  }
  auto nowhere = open_gcs_storage(bucket_ + "-absent", "ckpt", options_);
  try {
    nowhere->list();
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kNotFound);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("no bucket gs://" + bucket_ + "-absent"), HasSubstr(endpoint_)));
  }
}

TEST_F(GcsServer, AKilledServerIsAClearErrorNamingTheObject) {
  auto proxy = std::make_unique<testing::FaultProxy>(endpoint_, 3, "gcs");
  auto options = options_;
  options.gcs.emulator_host = proxy->endpoint();
  auto storage = open_gcs_storage(bucket_, "ckpt", options);
  std::string bytes(1000, '\0');
  storage->read("model.safetensors", 0, writable(bytes));
  proxy.reset();  // the server is gone: its port refuses connections
  try {
    storage->read("model.safetensors", 0, writable(bytes));
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kNetwork);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot read 0+1000 bytes of gs://" + bucket_ + "/ckpt/model.safetensors"),
                                    HasSubstr("transfer failed (curl error 7"), HasSubstr("after 5 attempts")));
  }
}

class GcsFaults : public GcsServer {
 protected:
  void SetUp() override {
    GcsServer::SetUp();
    if (IsSkipped()) return;
    // The proxy holds a stalled body far longer than the client's 1 s stall timeout.
    proxy_ = std::make_unique<testing::FaultProxy>(endpoint_, /*stall_seconds=*/10, "gcs");
    options_.gcs.emulator_host = proxy_->endpoint();
    options_.s3.timeout_seconds = 1;
    storage_ = open_gcs_storage(bucket_, "ckpt", options_);
  }

  std::string read(uint64_t offset, size_t size) {
    std::string bytes(size, '\0');
    storage_->read("model.safetensors", offset, writable(bytes));
    return bytes;
  }

  std::unique_ptr<testing::FaultProxy> proxy_;
  std::unique_ptr<Storage> storage_;
};

TEST_F(GcsFaults, RecoversFromEachFaultWithinTheAttemptBound) {
  for (std::string mode : {"reset", "truncate", "overlong", "badrange", "stall", "503", "429", "500"}) {
    SCOPED_TRACE(mode);
    proxy_->clear();
    proxy_->arm(mode, 2);
    EXPECT_EQ(read(4096, 100000), payload_.substr(4096, 100000));
    EXPECT_EQ(proxy_->faults(), 2);
    EXPECT_EQ(proxy_->requests("GET"), 3);  // two spoiled attempts, then the good one
  }
}

TEST_F(GcsFaults, PersistentBackendErrorsGiveOneErrorWithEverything) {
  proxy_->arm("503", 100);
  try {
    read(4096, 100000);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kNetwork);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot read 4096+100000 bytes of gs://" + bucket_ + "/ckpt/model.safetensors"),
                                    HasSubstr("HTTP 503 backendError: Backend Error"),
                                    HasSubstr("(request id FAULTPROXY"), HasSubstr("after 5 attempts")));
  }
  EXPECT_EQ(proxy_->requests("GET"), 5);
}

TEST_F(GcsFaults, ForbiddenIsNotRetriedAndSaysWhatToCheck) {
  proxy_->arm("403", 100, "");
  try {
    storage_->stat("model.safetensors");
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kPermission);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot stat gs://" + bucket_ + "/ckpt/model.safetensors"),
                                    HasSubstr("HTTP 403 forbidden"), HasSubstr("check the credentials"),
                                    HasSubstr("after 1 attempt")));
  }
  EXPECT_EQ(proxy_->requests("GET"), 1);
}

TEST_F(GcsFaults, StallsPastTheTimeoutAreTimeouts) {
  auto options = options_;
  options.s3.max_attempts = 2;
  auto storage = open_gcs_storage(bucket_, "ckpt", options);
  proxy_->arm("stall", 100);
  try {
    std::string bytes(100000, '\0');
    storage->read("model.safetensors", 0, writable(bytes));
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kTimeout);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("no byte moved for 1 s after HTTP 206 and 50000 of 100000 body bytes arrived"),
                                    HasSubstr("after 2 attempts (stall timeout (WEIGHTSTREAM_S3_TIMEOUT): 2 times)")));
  }
}

TEST_F(GcsFaults, CorruptBytesOfAWholeObjectAreCaughtByItsCrc32c) {
  storage_->stat("model.safetensors");  // the size is known: a whole read is one checked request
  proxy_->clear();
  proxy_->arm("corrupt", 1);
  EXPECT_EQ(read(0, payload_.size()), payload_);
  EXPECT_EQ(proxy_->requests("GET"), 2);  // the corrupted copy was refused and fetched again

  auto options = options_;
  options.s3.request_bytes = 64 * 1024;  // in pieces: checked against the crc32c of the metadata
  auto storage = open_gcs_storage(bucket_, "ckpt", options);
  storage->stat("model.safetensors");
  proxy_->clear();
  proxy_->arm("corrupt", 1000, "GET", "alt=media");  // the media, not the metadata
  try {
    std::string bytes(payload_.size(), '\0');
    storage->read("model.safetensors", 0, writable(bytes));
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), AllOf(HasSubstr("checksum mismatch: crc32c is"), HasSubstr("after 5 reads")));
  }
}

TEST_F(GcsFaults, SplitReadsRecoverAndFailAsOne) {
  auto options = options_;
  options.s3.request_bytes = 32 * 1024;
  auto storage = open_gcs_storage(bucket_, "ckpt", options);
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
    EXPECT_THAT(error.what(), HasSubstr("HTTP 404 notFound"));
  }
  EXPECT_LE(proxy_->requests("GET"), static_cast<int>(options.s3.max_connections));
}

// ---- credentials -----------------------------------------------------------------------

std::string base64url_decode(std::string text) {
  for (char& c : text) c = c == '-' ? '+' : c == '_' ? '/' : c;
  while (text.size() % 4) text += '=';
  std::string out(text.size(), '\0');
  int length = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                               reinterpret_cast<const unsigned char*>(text.data()), static_cast<int>(text.size()));
  EXPECT_GE(length, 0);
  out.resize(static_cast<size_t>(std::max(length, 0)));
  while (!out.empty() && text.ends_with('=') && out.back() == '\0') {  // EVP_DecodeBlock keeps padding's zeros
    out.pop_back();
    text.pop_back();
  }
  return out;
}

/// A fresh RSA key: its private PEM (the service account's secret) and public PEM.
struct TestKey {
  std::string private_pem;
  std::string public_pem;
};
TestKey make_rsa_key() {
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(EVP_RSA_gen(2048), EVP_PKEY_free);
  EXPECT_NE(key, nullptr);
  auto pem = [&](bool is_private) {
    std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new(BIO_s_mem()), BIO_free);
    if (is_private) PEM_write_bio_PrivateKey(bio.get(), key.get(), nullptr, nullptr, 0, nullptr, nullptr);
    else PEM_write_bio_PUBKEY(bio.get(), key.get());
    char* data = nullptr;
    long length = BIO_get_mem_data(bio.get(), &data);
    return std::string(data, static_cast<size_t>(length));
  };
  return {pem(true), pem(false)};
}

const TestKey& test_key() {
  static const TestKey key = make_rsa_key();
  return key;
}

bool verifies(const std::string& public_pem, const std::string& signed_text, const std::string& signature) {
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new_mem_buf(public_pem.data(), static_cast<int>(public_pem.size())),
                                                BIO_free);
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(PEM_read_bio_PUBKEY(bio.get(), nullptr, nullptr, nullptr),
                                                          EVP_PKEY_free);
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> context(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  return key && EVP_DigestVerifyInit(context.get(), nullptr, EVP_sha256(), nullptr, key.get()) == 1 &&
         EVP_DigestVerify(context.get(), reinterpret_cast<const unsigned char*>(signature.data()), signature.size(),
                          reinterpret_cast<const unsigned char*>(signed_text.data()), signed_text.size()) == 1;
}

std::string key_file_json(const std::string& token_uri, const std::string& private_key = test_key().private_pem) {
  return nlohmann::json{{"type", "service_account"},
                        {"project_id", "weightstream-test"},
                        {"private_key_id", "0123abcd"},
                        {"private_key", private_key},
                        {"client_email", "loader@weightstream-test.iam.gserviceaccount.com"},
                        {"token_uri", token_uri}}
      .dump();
}

/// The PEM's base64 body lines: any of them in a message would leak the key.
std::vector<std::string> secret_lines() {
  std::vector<std::string> lines;
  std::istringstream pem(test_key().private_pem);
  for (std::string line; std::getline(pem, line);)
    if (!line.starts_with("-----") && line.size() > 20) lines.push_back(line);
  return lines;
}

void expect_no_secret(const std::string& text) {
  EXPECT_THAT(text, Not(HasSubstr(kTestToken)));
  EXPECT_THAT(text, Not(HasSubstr("PRIVATE KEY")));
  for (const auto& line : secret_lines()) EXPECT_THAT(text, Not(HasSubstr(line)));
}

TEST(GcsCredentials, TheAssertionIsAnRs256JwtThatTheKeysPublicHalfVerifies) {
  auto account = gcs::parse_service_account(key_file_json("https://oauth2.googleapis.com/token"), "key.json");
  const std::string jwt = gcs::service_account_assertion(account, 1700000000, gcs::kReadOnlyScope);
  const size_t first = jwt.find('.'), second = jwt.rfind('.');
  ASSERT_NE(first, second);
  auto header = nlohmann::json::parse(base64url_decode(jwt.substr(0, first)));
  auto claims = nlohmann::json::parse(base64url_decode(jwt.substr(first + 1, second - first - 1)));
  EXPECT_EQ(header, (nlohmann::json{{"alg", "RS256"}, {"typ", "JWT"}, {"kid", "0123abcd"}}));
  EXPECT_EQ(claims, (nlohmann::json{{"iss", "loader@weightstream-test.iam.gserviceaccount.com"},
                                    {"scope", "https://www.googleapis.com/auth/devstorage.read_only"},
                                    {"aud", "https://oauth2.googleapis.com/token"},
                                    {"iat", 1700000000},
                                    {"exp", 1700003600}}));
  EXPECT_EQ(jwt.find_first_of("+/="), std::string::npos) << "base64url without padding";
  const std::string signature = base64url_decode(jwt.substr(second + 1));
  EXPECT_EQ(signature.size(), 256u);  // RSA-2048
  EXPECT_TRUE(verifies(test_key().public_pem, jwt.substr(0, second), signature));
  // Any other claims (a later exp) do not verify under that signature.
  auto later = gcs::service_account_assertion(account, 1700000001, gcs::kReadOnlyScope);
  EXPECT_FALSE(verifies(test_key().public_pem, later.substr(0, later.rfind('.')), signature));
  EXPECT_EQ(gcs::base64url("\xfb\xff"), "-_8");
}

TEST(GcsCredentials, KeyFilesThatCannotBeUsedAreRefusedNamingTheFileNotTheKey) {
  testing::TempDir directory;
  const std::string path = (directory / "key.json").string();
  auto refused = [&](const std::string& text, const std::string& expected) {
    SCOPED_TRACE(expected);
    testing::write_file(path, text);
    Options options;
    options.gcs.credentials_file = path;
    try {
      auto storage = open_gcs_storage("my-bucket", "models/llama", options);
      storage->stat("config.json");
      ADD_FAILURE() << "expected an error";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kConfig) << error.what();
      EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot open gs://my-bucket/models/llama"),
                                      HasSubstr(path + " (GOOGLE_APPLICATION_CREDENTIALS)"), HasSubstr(expected)));
      expect_no_secret(error.what());
    }
  };
  // Cut short in the middle of the key: the parser's message would quote it.
  const std::string whole = key_file_json("https://oauth2.googleapis.com/token");
  refused(whole.substr(0, whole.size() / 2), "is not a JSON object");
  refused(R"({"type": "external_account", "audience": "x"})", "has type 'external_account'");
  refused(R"({"type": "authorized_user", "client_id": "x", "refresh_token": "y"})", "(authorized_user) has no client_secret");
  refused(R"({"type": "service_account", "client_email": "a@b.c"})", "has no private_key");
  refused(R"({"type": "service_account", "private_key": "k"})", "has no client_email");
  Options options;
  options.gcs.credentials_file = (directory / "absent.json").string();
  EXPECT_THROW(open_gcs_storage("my-bucket", "", options), Error);
}

TEST(GcsCredentials, AKeyThatIsNotAPemPrivateKeyFailsAtItsFirstRequest) {
  testing::TempDir directory;
  testing::write_file(directory / "key.json",
                      key_file_json("http://127.0.0.1:9/token", "-----BEGIN PRIVATE KEY-----\nnotakey\n-----END PRIVATE KEY-----\n"));
  Options options;
  options.gcs.credentials_file = (directory / "key.json").string();
  options.gcs.endpoint = "http://127.0.0.1:9";
  auto storage = open_gcs_storage("my-bucket", "m", options);
  try {
    storage->stat("config.json");
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kConfig);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot stat gs://my-bucket/m/config.json"),
                                    HasSubstr("is not a PEM private key that can sign RS256")));
    EXPECT_THAT(error.what(), Not(HasSubstr("notakey")));
  }
}

TEST(GcsCredentials, ATokenEndpointThatRefusesIsAClearErrorWithoutSecrets) {
  // The refusal echoes what it was sent, as some servers do: nothing of it may be shown.
  LoopbackServer token_endpoint(json_response(
      400, "Bad Request",
      nlohmann::json{{"error", "invalid_grant"},
                     {"error_description", "Invalid JWT Signature. key " + secret_lines().front()}}.dump()));
  testing::TempDir directory;
  testing::write_file(directory / "key.json", key_file_json(token_endpoint.endpoint() + "/token"));
  Options options;
  options.gcs.credentials_file = (directory / "key.json").string();
  options.gcs.endpoint = "http://127.0.0.1:9";  // never reached: no token, no request
  options.s3.retry_base_seconds = 0.01;
  auto storage = open_gcs_storage("my-bucket", "m", options);
  try {
    storage->stat("config.json");
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kPermission);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot stat gs://my-bucket/m/config.json"),
                                    HasSubstr("cannot get an access token for service account "
                                              "loader@weightstream-test.iam.gserviceaccount.com"),
                                    HasSubstr("HTTP 400 invalid_grant: Invalid JWT Signature"),
                                    HasSubstr("the token endpoint refused")));
    expect_no_secret(error.what());
  }
  auto requests = token_endpoint.requests();
  ASSERT_EQ(requests.size(), 1u);  // a refusal is not retried
  EXPECT_THAT(requests[0], AllOf(HasSubstr("POST /token HTTP/1.1"),
                                 HasSubstr("grant_type=urn%3Aietf%3Aparams%3Aoauth%3Agrant-type%3Ajwt-bearer&assertion=")));
}

/// A storage endpoint that answers every request with an object's metadata.
std::string metadata_response() { return json_response(200, "OK", R"({"size": "5", "crc32c": "AAAAAA=="})"); }

TEST(GcsCredentials, ATokenIsSentAsBearerAndReusedUntilItNearsItsExpiry) {
  for (int lifetime : {3600, 0}) {
    SCOPED_TRACE(lifetime);
    LoopbackServer token_endpoint(json_response(
        200, "OK", nlohmann::json{{"access_token", kTestToken}, {"expires_in", lifetime}, {"token_type", "Bearer"}}.dump()));
    LoopbackServer storage_endpoint(metadata_response());
    testing::TempDir directory;
    testing::write_file(directory / "key.json", key_file_json(token_endpoint.endpoint() + "/token"));
    GcsOptions options;
    options.credentials_file = (directory / "key.json").string();
    options.endpoint = storage_endpoint.endpoint();
    gcs::GcsClient client(options, testing::s3_test_options("http://127.0.0.1:9"));
    for (int i = 0; i < 3; ++i) EXPECT_EQ(client.metadata("my-bucket", "m/config.json").size, 5u);
    // An hour's token serves every request; one that expires at once is renewed for each.
    EXPECT_EQ(client.credentials().tokens_fetched(), lifetime == 3600 ? 1u : 3u);
    for (const auto& request : storage_endpoint.requests())
      EXPECT_THAT(request, AllOf(HasSubstr("GET /storage/v1/b/my-bucket/o/m%2Fconfig.json?"),
                                 HasSubstr(std::string("Authorization: Bearer ") + kTestToken)));
  }
}

TEST(GcsCredentials, A401GetsOneFreshTokenAndNeverShowsIt) {
  LoopbackServer token_endpoint(
      json_response(200, "OK", nlohmann::json{{"access_token", kTestToken}, {"expires_in", 3600}}.dump()));
  LoopbackServer storage_endpoint(json_response(
      401, "Unauthorized",
      nlohmann::json{{"error", {{"code", 401}, {"message", std::string("Invalid Credentials: ") + kTestToken},
                                {"errors", {{{"reason", "authError"}}}}}}}.dump()));
  testing::TempDir directory;
  testing::write_file(directory / "key.json", key_file_json(token_endpoint.endpoint() + "/token"));
  GcsOptions options;
  options.credentials_file = (directory / "key.json").string();
  options.endpoint = storage_endpoint.endpoint();
  gcs::GcsClient client(options, testing::s3_test_options("http://127.0.0.1:9"));
  try {
    client.metadata("my-bucket", "m/config.json");
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kPermission);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot stat gs://my-bucket/m/config.json"),
                                    HasSubstr("HTTP 401 authError: Invalid Credentials: <redacted>"),
                                    HasSubstr("after 2 attempts"), HasSubstr("check the credentials")));
    expect_no_secret(error.what());
  }
  EXPECT_EQ(client.credentials().tokens_fetched(), 2u);
  EXPECT_EQ(storage_endpoint.requests().size(), 2u);
}

TEST(GcsCredentials, GcloudUserCredentialsRenewTokensWithTheirRefreshTokenAndHideIt) {
  constexpr const char* kClientSecret = "wsClientSecretDoNotPrint";
  constexpr const char* kRefreshToken = "1//wsRefreshTokenDoNotPrint";
  for (bool refused : {false, true}) {
    SCOPED_TRACE(refused);
    LoopbackServer token_endpoint(
        refused ? json_response(400, "Bad Request",
                                nlohmann::json{{"error", "invalid_grant"},
                                               {"error_description", std::string("Token has been expired or revoked: ") +
                                                                         kRefreshToken}}.dump())
                : json_response(200, "OK", nlohmann::json{{"access_token", kTestToken}, {"expires_in", 3599}}.dump()));
    LoopbackServer storage_endpoint(metadata_response());
    testing::TempDir directory;
    testing::write_file(directory / "adc.json", nlohmann::json{{"type", "authorized_user"},
                                                               {"client_id", "764086051850.apps.googleusercontent.com"},
                                                               {"client_secret", kClientSecret},
                                                               {"refresh_token", kRefreshToken},
                                                               {"token_uri", token_endpoint.endpoint() + "/token"}}
                                                    .dump());
    GcsOptions options;
    options.credentials_file = (directory / "adc.json").string();
    options.endpoint = storage_endpoint.endpoint();
    gcs::GcsClient client(options, testing::s3_test_options("http://127.0.0.1:9"));
    if (!refused) {
      EXPECT_EQ(client.metadata("my-bucket", "m/config.json").size, 5u);
      EXPECT_THAT(storage_endpoint.requests().at(0), HasSubstr(std::string("Authorization: Bearer ") + kTestToken));
    } else {
      try {
        client.metadata("my-bucket", "m/config.json");
        FAIL() << "expected an error";
      } catch (const Error& error) {
        EXPECT_EQ(error.code(), ErrorCode::kPermission);
        EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot stat gs://my-bucket/m/config.json"),
                                        HasSubstr("gcloud's user credentials (client 764086051850.apps"),
                                        HasSubstr("HTTP 400 invalid_grant: Token has been expired or revoked: <redacted>"),
                                        HasSubstr("gcloud auth application-default login")));
        EXPECT_THAT(error.what(), AllOf(Not(HasSubstr(kRefreshToken)), Not(HasSubstr(kClientSecret))));
      }
    }
    ASSERT_EQ(token_endpoint.requests().size(), 1u);
    EXPECT_THAT(token_endpoint.requests()[0],
                AllOf(HasSubstr("POST /token HTTP/1.1"),
                      HasSubstr("grant_type=refresh_token&client_id=764086051850.apps.googleusercontent.com"
                                "&client_secret=wsClientSecretDoNotPrint&refresh_token=1%2F%2FwsRefreshTokenDoNotPrint")));
  }
}

TEST(GcsCredentials, TheMetadataServerHandsOutTokensAndItsAbsenceIsExplained) {
  LoopbackServer metadata_server(
      json_response(200, "OK", nlohmann::json{{"access_token", kTestToken}, {"expires_in", 3599}}.dump()));
  LoopbackServer storage_endpoint(metadata_response());
  GcsOptions options;
  options.metadata_host = metadata_server.authority();
  options.endpoint = storage_endpoint.endpoint();
  gcs::GcsClient client(options, testing::s3_test_options("http://127.0.0.1:9"));
  EXPECT_EQ(client.metadata("my-bucket", "m/config.json").size, 5u);
  ASSERT_EQ(metadata_server.requests().size(), 1u);
  EXPECT_THAT(metadata_server.requests()[0],
              AllOf(HasSubstr("GET /computeMetadata/v1/instance/service-accounts/default/token HTTP/1.1"),
                    HasSubstr("Metadata-Flavor: Google")));

  options.metadata_host = "127.0.0.1:9";  // off Google Cloud: nothing there
  gcs::GcsClient nowhere(options, testing::s3_test_options("http://127.0.0.1:9"));
  try {
    nowhere.metadata("my-bucket", "m/config.json");
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kPermission);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot stat gs://my-bucket/m/config.json"),
                                    HasSubstr("the metadata server http://127.0.0.1:9"),
                                    HasSubstr("set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file")));
  }
}

TEST(GcsCredentials, AnEmulatorOrAnonymousAccessSendsNoAuthorization) {
  LoopbackServer storage_endpoint(metadata_response());
  GcsOptions options;
  options.emulator_host = storage_endpoint.authority();  // "host:port", as Google's examples give it
  options.credentials_file = "/nonexistent/key.json";    // not read: an emulator takes no credentials
  gcs::GcsClient client(options, testing::s3_test_options("http://127.0.0.1:9"));
  EXPECT_EQ(client.endpoint(), storage_endpoint.endpoint());
  EXPECT_EQ(client.metadata("b-1", "k").size, 5u);
  EXPECT_THAT(storage_endpoint.requests().at(0), Not(HasSubstr("Authorization")));
}

TEST(GcsOptions, GooglesVariablesAreReadIntoOptions) {
  auto options = options_from_environment({{"STORAGE_EMULATOR_HOST", "127.0.0.1:4443"},
                                           {"GOOGLE_APPLICATION_CREDENTIALS", "/keys/sa.json"},
                                           {"GCE_METADATA_HOST", "169.254.169.254"},
                                           {"WEIGHTSTREAM_GCS_ANONYMOUS", "1"}});
  EXPECT_EQ(options.gcs.emulator_host, "127.0.0.1:4443");
  EXPECT_EQ(options.gcs.credentials_file, "/keys/sa.json");
  EXPECT_EQ(options.gcs.metadata_host, "169.254.169.254");
  EXPECT_TRUE(options.gcs.anonymous);
  auto defaults = options_from_environment({});
  EXPECT_EQ(defaults.gcs.metadata_host, "metadata.google.internal");
  EXPECT_FALSE(defaults.gcs.anonymous);
  EXPECT_THROW(options_from_environment({{"WEIGHTSTREAM_GCS_ANONYMOUS", "maybe"}}), Error);
}

TEST(GcsUri, ParsesBucketAndPrefixAndRefusesBadBuckets) {
  auto uri = parse_uri("gs://my-bucket/models/llama-8b/");
  EXPECT_EQ(uri.scheme, Uri::Scheme::kGcs);
  EXPECT_EQ(uri.bucket, "my-bucket");
  EXPECT_EQ(uri.path, "models/llama-8b");
  EXPECT_EQ(parse_uri("gs://my_bucket.example.com").path, "");
  for (std::string bad : {"gs://", "gs:///x", "gs://UPPER/x", "gs://ab/x", "gs://-dash/x"}) {
    try {
      parse_uri(bad);
      ADD_FAILURE() << bad;
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument) << bad;
      EXPECT_THAT(error.what(), HasSubstr("gs://")) << bad;
    }
  }
}

TEST(GcsListing, ParsesPagesAndRefusesMalformedOnes) {
  auto page = gcs::parse_list_page(
      R"({"items": [{"name": "p/a", "size": "18446744073709551615"}], "prefixes": ["p/d/"], "nextPageToken": "t2"})");
  ASSERT_EQ(page.objects.size(), 1u);
  EXPECT_EQ(page.objects[0].size, UINT64_MAX);
  EXPECT_EQ(page.prefixes, std::vector<std::string>{"p/d/"});
  EXPECT_EQ(page.next_page_token, "t2");
  EXPECT_TRUE(gcs::parse_list_page("{}").objects.empty());
  for (std::string bad : {"[", R"({"items": 3})", R"({"items": [{"size": "1"}]})",
                          R"({"items": [{"name": "a", "size": "-1"}]})", R"({"items": [{"name": "a"}]})"}) {
    EXPECT_THROW(gcs::parse_list_page(bad), Error) << bad;
  }
  auto error = gcs::parse_error_body(R"({"error": {"code": 404, "message": "No such object: b/k", "errors": [{"reason": "notFound"}]}})");
  EXPECT_EQ(error.reason, "notFound");
  EXPECT_EQ(error.message, "No such object: b/k");
  EXPECT_EQ(gcs::parse_error_body("<html>").reason, "");
}

}  // namespace
}  // namespace weightstream
