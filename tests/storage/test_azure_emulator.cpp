// The Azure Blob backend (az://) against a Blob emulator, directly and through the
// fault-injecting proxy (the S3 and GCS paths' fault suite, with the Blob service's error
// documents): lists, stats and ranged reads, a missing blob and container, a wrong key, a
// killed server. Every test here needs an emulator (WS_TEST_AZURE_CONNECTION_STRING, set by
// scripts/azurite.sh where azurite-blob is installed) and skips without one, saying so.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <memory>

#include "storage/azure_client.hpp"
#include "storage/test_azure_fixture.hpp"
#include "support/test_support.hpp"
#include "weightstream/error.hpp"
#include "weightstream/storage.hpp"

namespace weightstream {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

std::span<std::byte> writable(std::string& bytes) { return std::as_writable_bytes(std::span(bytes.data(), bytes.size())); }

class AzureServer : public ::testing::Test {
 protected:
  void SetUp() override {
    WS_REQUIRE_AZURE_SERVER();
    connection_string_ = *testing::azure_test_connection_string();
    options_ = testing::azure_test_options(connection_string_);
    account_ = azure::parse_connection_string(connection_string_).account;
    container_ = testing::unique_container("aztest");
    azure::BlobClient setup(account_, "", options_.azure, options_.s3);
    setup.create_container(container_);
    payload_ = testing::pattern_bytes(300000, 7);
    setup.put_blob(container_, "ckpt/model.safetensors", payload_);
    setup.put_blob(container_, "ckpt/a b+c%d.bin", "encoded name");
    setup.put_blob(container_, "ckpt/nested/hidden.bin", "hidden");
    setup.put_blob(container_, "ckpt-other/outside.bin", "outside");
  }

  std::string root() const { return "az://" + account_ + "/" + container_ + "/ckpt"; }

  std::string connection_string_;
  Options options_;
  std::string account_;
  std::string container_;
  std::string payload_;
};

TEST_F(AzureServer, ListsStatsAndReadsThroughTheBlobApi) {
  auto storage = open_azure_storage(account_, container_, "ckpt", options_);
  EXPECT_EQ(storage->root_uri(), root());
  EXPECT_EQ(storage->object_uri("model.safetensors"), root() + "/model.safetensors");
  std::map<std::string, uint64_t> sizes;
  for (const auto& object : storage->list()) sizes[object.name] = object.size;
  EXPECT_EQ(sizes, (std::map<std::string, uint64_t>{{"model.safetensors", 300000}, {"a b+c%d.bin", 12}}));
  EXPECT_EQ(storage->stat("model.safetensors").size, 300000u);
  std::string range(100000, '\0');
  storage->read("model.safetensors", 4096, writable(range));
  EXPECT_EQ(range, payload_.substr(4096, 100000));
  std::string whole(payload_.size(), '\0');
  storage->read("model.safetensors", 0, writable(whole));  // one request, checked against Content-MD5
  EXPECT_EQ(whole, payload_);
  std::string encoded(12, '\0');
  storage->read("a b+c%d.bin", 0, writable(encoded));
  EXPECT_EQ(encoded, "encoded name");
}

TEST_F(AzureServer, MissingBlobAndContainerAreExplained) {
  auto storage = open_azure_storage(account_, container_, "ckpt", options_);
  try {
    storage->stat("absent.safetensors");
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kNotFound);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot stat " + root() + "/absent.safetensors"),
                                    HasSubstr("no object " + root() + "/absent.safetensors (HTTP 404"),
                                    HasSubstr("after 1 attempt")));
  }
  auto nowhere = open_azure_storage(account_, container_ + "-absent", "ckpt", options_);
  try {
    nowhere->list();
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kNotFound);
    EXPECT_THAT(error.what(), HasSubstr("no container az://" + account_ + "/" + container_ + "-absent"));
  }
}

TEST_F(AzureServer, AWrongKeyIsRefusedAndNeverShown) {
  // Another valid base64 key of the same length: the emulator's signature check refuses it.
  std::string wrong = std::string(azure::kDevelopmentKey);
  wrong[0] = wrong[0] == 'A' ? 'B' : 'A';
  auto options = options_;
  options.azure.connection_string = "AccountName=" + account_ + ";AccountKey=" + wrong + ";BlobEndpoint=" +
                                    azure::parse_connection_string(connection_string_).blob_endpoint;
  auto storage = open_azure_storage(account_, container_, "ckpt", options);
  try {
    storage->stat("model.safetensors");
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kPermission);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot stat " + root() + "/model.safetensors"), HasSubstr("HTTP 403"),
                                    HasSubstr("a credential problem"), Not(HasSubstr(wrong))));
  }
}

TEST_F(AzureServer, AKilledServerIsAClearErrorNamingTheObject) {
  const std::string upstream = azure::parse_connection_string(connection_string_).blob_endpoint;
  auto proxy = std::make_unique<testing::FaultProxy>(upstream.substr(0, upstream.find('/', upstream.find("://") + 3)), 3,
                                                     "azure");
  auto options = options_;
  options.azure.connection_string = testing::azure_connection_string_via(connection_string_, proxy->endpoint());
  auto storage = open_azure_storage(account_, container_, "ckpt", options);
  std::string bytes(1000, '\0');
  storage->read("model.safetensors", 0, writable(bytes));
  proxy.reset();  // the server is gone: its port refuses connections
  try {
    storage->read("model.safetensors", 0, writable(bytes));
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kNetwork);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot read 0+1000 bytes of " + root() + "/model.safetensors"),
                                    HasSubstr("transfer failed (curl error 7"), HasSubstr("after 5 attempts")));
  }
}

class AzureFaults : public AzureServer {
 protected:
  void SetUp() override {
    AzureServer::SetUp();
    if (IsSkipped()) return;
    const std::string upstream = azure::parse_connection_string(connection_string_).blob_endpoint;
    // The proxy holds a stalled body far longer than the client's 1 s stall timeout.
    proxy_ = std::make_unique<testing::FaultProxy>(upstream.substr(0, upstream.find('/', upstream.find("://") + 3)),
                                                   /*stall_seconds=*/10, "azure");
    options_.azure.connection_string = testing::azure_connection_string_via(connection_string_, proxy_->endpoint());
    options_.s3.timeout_seconds = 1;
    storage_ = open_azure_storage(account_, container_, "ckpt", options_);
  }

  std::string read(uint64_t offset, size_t size) {
    std::string bytes(size, '\0');
    storage_->read("model.safetensors", offset, writable(bytes));
    return bytes;
  }

  std::unique_ptr<testing::FaultProxy> proxy_;
  std::unique_ptr<Storage> storage_;
};

TEST_F(AzureFaults, RecoversFromEachFaultWithinTheAttemptBound) {
  for (std::string mode : {"reset", "truncate", "overlong", "badrange", "stall", "503", "429", "500"}) {
    SCOPED_TRACE(mode);
    proxy_->clear();
    proxy_->arm(mode, 2);
    EXPECT_EQ(read(4096, 100000), payload_.substr(4096, 100000));
    EXPECT_EQ(proxy_->faults(), 2);
    EXPECT_EQ(proxy_->requests("GET"), 3);  // two spoiled attempts, then the good one
  }
}

TEST_F(AzureFaults, PersistentBackendErrorsGiveOneErrorWithEverything) {
  proxy_->arm("503", 100);
  try {
    read(4096, 100000);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kNetwork);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot read 4096+100000 bytes of " + root() + "/model.safetensors"),
                                    HasSubstr("HTTP 503 ServerBusy: The server is currently unable"),
                                    HasSubstr("(request id FAULTPROXY"), HasSubstr("after 5 attempts")));
  }
  EXPECT_EQ(proxy_->requests("GET"), 5);
}

TEST_F(AzureFaults, ForbiddenIsNotRetriedAndSaysWhatToCheck) {
  proxy_->arm("403", 100, "");
  try {
    storage_->stat("model.safetensors");
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kPermission);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot stat " + root() + "/model.safetensors"),
                                    HasSubstr("HTTP 403 AuthorizationPermissionMismatch"),
                                    HasSubstr("check the credentials"), HasSubstr("after 1 attempt")));
  }
  EXPECT_EQ(proxy_->requests("HEAD"), 1);
}

TEST_F(AzureFaults, StallsPastTheTimeoutAreTimeouts) {
  auto options = options_;
  options.s3.max_attempts = 2;
  auto storage = open_azure_storage(account_, container_, "ckpt", options);
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

TEST_F(AzureFaults, CorruptBytesOfAWholeBlobAreCaughtByItsContentMd5) {
  storage_->stat("model.safetensors");  // the size is known: a whole read is one checked request
  proxy_->clear();
  proxy_->arm("corrupt", 1);
  EXPECT_EQ(read(0, payload_.size()), payload_);
  EXPECT_EQ(proxy_->requests("GET"), 2);  // the corrupted copy was refused and fetched again
}

TEST_F(AzureFaults, SplitReadsRecoverAndFailAsOne) {
  auto options = options_;
  options.s3.request_bytes = 32 * 1024;
  auto storage = open_azure_storage(account_, container_, "ckpt", options);
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
    EXPECT_THAT(error.what(), HasSubstr("HTTP 404 BlobNotFound"));
  }
  EXPECT_LE(proxy_->requests("GET"), static_cast<int>(options.s3.max_connections));
}

}  // namespace
}  // namespace weightstream
