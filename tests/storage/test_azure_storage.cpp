// The Azure Blob backend (az://). No Blob emulator installs here (Azurite needs npm; the PyPI
// and Debian candidates serve no Blob REST API, see docs/AZURE.md), so what runs here is:
// Shared Key signing checked against the canonical strings of Microsoft's "Authorize with
// Shared Key" and against the signatures Microsoft's own Python SDK computes
// (tests/tools/azure_shared_key_reference.py); connection strings, SAS tokens and the
// managed-identity endpoints (IMDS, App Service); the requests as they leave the client,
// captured by a loopback server that answers one canned response (never a Blob service of our
// own: it has no state and decides nothing); error documents as Azure documents them; a dead
// endpoint; and no secret in any message.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <nlohmann/json.hpp>

#include "storage/azure_client.hpp"
#include "storage/azure_credentials.hpp"
#include "storage/azure_signer.hpp"
#include "storage/s3_checksum.hpp"
#include "storage/test_loopback_server.hpp"
#include "storage/test_s3_fixture.hpp"
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

/// The storage emulator's well-known key: public, and what the SDK reference signed with.
const std::string kKey(azure::kDevelopmentKey);
/// Secrets no message may show.
constexpr const char* kTestToken = "eyJ0eXAiOiJKV1QiwsTestTokenDoNotPrint0123456789";
constexpr const char* kSasSignature = "wsSecretSig0123456789abcdefABCDEF%2B%2F%3D";
constexpr const char* kIdentityHeader = "wsIdentityHeaderDoNotPrint42";

std::string sas_token() { return "sv=2021-08-06&ss=b&srt=co&sp=rl&se=2030-01-01T00%3A00%3A00Z&sig=" + std::string(kSasSignature); }

void expect_no_secret(const std::string& text) {
  for (std::string secret : {kKey, std::string(kTestToken), std::string(kSasSignature),
                             std::string("wsSecretSig0123456789abcdefABCDEF+/="), std::string(kIdentityHeader)}) {
    EXPECT_THAT(text, Not(HasSubstr(secret))) << "a secret in: " << text;
  }
}

S3Options transfer() { return testing::s3_test_options("http://127.0.0.1:9"); }

/// A closed loopback port: connections to it are refused (a killed server).
std::string closed_endpoint() {
  int port = 0;
  {
    LoopbackServer server("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n");
    port = std::stoi(server.authority().substr(server.authority().find(':') + 1));
  }
  return "http://127.0.0.1:" + std::to_string(port);
}

/// Options whose connection string sends requests to `endpoint` as the emulator's account.
Options emulator_options(const std::string& endpoint) {
  Options options;
  options.s3 = transfer();
  options.azure.connection_string = "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=" + kKey +
                                    ";BlobEndpoint=" + endpoint + "/devstoreaccount1;";
  options.azure.imds_host = "http://127.0.0.1:9";  // never the real IMDS from a test
  return options;
}

/// The value of header `name` in a captured request, or empty.
std::string header_of(const std::string& request, const std::string& name) {
  auto at = request.find("\r\n" + name + ": ");
  if (at == std::string::npos) return {};
  at += name.size() + 4;
  return request.substr(at, request.find("\r\n", at) - at);
}

std::string head_response(uint64_t size) {
  return "HTTP/1.1 200 OK\r\nContent-Length: " + std::to_string(size) +
         "\r\nx-ms-request-id: req-1\r\nConnection: close\r\n\r\n";
}

/// An Azure error document, as the service sends it.
std::string error_response(int status, const std::string& reason, const std::string& code, const std::string& message,
                           const std::string& detail = {}) {
  const std::string body = "\xEF\xBB\xBF<?xml version=\"1.0\" encoding=\"utf-8\"?><Error><Code>" + code +
                           "</Code><Message>" + message + "\nRequestId:abc\nTime:2026-12-07T12:00:00Z</Message>" +
                           (detail.empty() ? "" : "<AuthenticationErrorDetail>" + detail + "</AuthenticationErrorDetail>") +
                           "</Error>";
  return "HTTP/1.1 " + std::to_string(status) + " " + reason +
         "\r\nContent-Type: application/xml\r\nx-ms-request-id: req-9\r\nx-ms-error-code: " + code +
         "\r\nConnection: close\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

// ---- Shared Key, against Microsoft's documentation and its SDK ----

TEST(AzureSharedKey, CanonicalizedResourceAsMicrosoftsExamplesGiveIt) {
  // https://learn.microsoft.com/rest/api/storageservices/authorize-with-shared-key#shared-key-format-for-2009-09-19-and-later
  EXPECT_EQ(azure::canonicalized_resource("myaccount", "/mycontainer", {{"restype", "container"}, {"comp", "metadata"}}),
            "/myaccount/mycontainer\ncomp:metadata\nrestype:container");
  EXPECT_EQ(azure::canonicalized_resource("myaccount", "/mycontainer",
                                          {{"restype", "container"},
                                           {"comp", "list"},
                                           {"include", "snapshots"},
                                           {"include", "metadata"},
                                           {"include", "uncommittedblobs"}}),
            "/myaccount/mycontainer\ncomp:list\ninclude:metadata,snapshots,uncommittedblobs\nrestype:container");
  // A secondary endpoint (myaccount-secondary.blob…) signs with the primary account's name.
  EXPECT_EQ(azure::canonicalized_resource("myaccount", "/mycontainer/myblob", {}), "/myaccount/mycontainer/myblob");
  // Names are lowercased before sorting; values stay as they are, decoded.
  EXPECT_EQ(azure::canonicalized_resource("a12", "/c/b%20x", {{"Prefix", "m/a b"}, {"COMP", "list"}}),
            "/a12/c/b%20x\ncomp:list\nprefix:m/a b");
}

TEST(AzureSharedKey, CanonicalizedHeadersAsMicrosoftsRulesGiveThem) {
  // The documented example's headers, given out of order and in mixed case.
  EXPECT_EQ(azure::canonicalized_headers({{"x-ms-version", "2014-02-14"},
                                          {"Content-Type", "application/xml"},
                                          {"X-MS-Date", "Sat, 21 Feb 2015 00:48:38 GMT"}}),
            "x-ms-date:Sat, 21 Feb 2015 00:48:38 GMT\nx-ms-version:2014-02-14\n");
  // "Replace any linear whitespace in the header value with a single space", trimmed.
  EXPECT_EQ(azure::canonicalized_headers({{"x-ms-meta-name", "  a \t  b  "}}), "x-ms-meta-name:a b\n");
  EXPECT_EQ(azure::canonicalized_headers({{"Range", "bytes=0-1"}}), "");
}

TEST(AzureSharedKey, TheDocumentedStringToSign) {
  // The documented example: GET …/mycontainer?restype=container&comp=metadata&timeout=20,
  // signed with the account in the path as well.
  azure::SharedKeyInput input;
  input.method = "GET";
  input.encoded_path = "/myaccount/mycontainer";
  input.query = {{"restype", "container"}, {"comp", "metadata"}, {"timeout", "20"}};
  input.headers = {{"x-ms-date", "Sun, 11 Oct 2009 21:49:13 GMT"}, {"x-ms-version", "2009-09-19"}};
  EXPECT_EQ(azure::string_to_sign("myaccount", input),
            "GET\n\n\n\n\n\n\n\n\n\n\n\n"
            "x-ms-date:Sun, 11 Oct 2009 21:49:13 GMT\nx-ms-version:2009-09-19\n"
            "/myaccount/myaccount/mycontainer\ncomp:metadata\nrestype:container\ntimeout:20");
  // The eleven standard headers take their lines in the documented order; a zero
  // Content-Length is an empty line (version 2015-02-21 and later), another is signed.
  input.method = "PUT";
  input.query.clear();
  input.headers = {{"Content-Length", "0"},       {"x-ms-date", "D"},         {"Content-Type", "text/plain"},
                   {"Content-MD5", "md5=="},      {"If-Match", "\"etag\""},   {"Content-Encoding", "gzip"},
                   {"Content-Language", "en"},    {"Range", "bytes=0-9"},     {"If-None-Match", "*"},
                   {"If-Modified-Since", "M"},    {"If-Unmodified-Since", "U"}, {"Date", "T"}};
  EXPECT_EQ(azure::string_to_sign("a12", input),
            "PUT\ngzip\nen\n\nmd5==\ntext/plain\nT\nM\n\"etag\"\n*\nU\nbytes=0-9\nx-ms-date:D\n/a12/myaccount/mycontainer");
  input.headers[0].second = "11";
  EXPECT_THAT(azure::string_to_sign("a12", input), HasSubstr("PUT\ngzip\nen\n11\nmd5==\n"));
}

TEST(AzureSharedKey, SignaturesEqualMicrosoftsPythonSdks) {
  // Each expected value is what azure-storage-blob 12.31.1's SharedKeyCredentialPolicy
  // computed for the same request (tests/tools/azure_shared_key_reference.py prints them).
  const std::string key = *s3::base64_decode(kKey);
  const std::vector<storage::Field> headers = {{"x-ms-date", "Mon, 07 Dec 2026 12:00:00 GMT"},
                                               {"x-ms-version", "2021-08-06"}};
  azure::SharedKeyInput properties{"HEAD", "/mycontainer/" + storage::uri_encode("models/a b+c.safetensors", true), {},
                                   headers};
  EXPECT_EQ(properties.encoded_path, "/mycontainer/models/a%20b%2Bc.safetensors");
  EXPECT_EQ(azure::shared_key_authorization("myaccount", key, properties),
            "SharedKey myaccount:z+1CFwK/Ft9LnFGxNGdkRnQYTyb+i1l3X5oKcFrgxP8=");
  azure::SharedKeyInput list{"GET",
                             "/mycontainer",
                             {{"restype", "container"},
                              {"comp", "list"},
                              {"maxresults", "5000"},
                              {"prefix", "models/llama/"},
                              {"delimiter", "/"},
                              {"marker", "2!abc"}},
                             headers};
  EXPECT_EQ(azure::shared_key_authorization("myaccount", key, list),
            "SharedKey myaccount:Haqc7gMovYBXl/LjzdVq+83LwTmyQ+S+qeax3ycCIXI=");
  azure::SharedKeyInput range{"GET", "/devstoreaccount1/mycontainer/model.safetensors", {}, headers};
  range.headers.emplace_back("x-ms-range", "bytes=4096-1052671");
  EXPECT_EQ(azure::shared_key_authorization("devstoreaccount1", key, range),
            "SharedKey devstoreaccount1:QFpTwKl4RX5YESCSMR5ovoGNJihJLe28ItotpDrMock=");
  azure::SharedKeyInput create{"PUT", "/devstoreaccount1/mycontainer", {{"restype", "container"}}, headers};
  create.headers.emplace_back("Content-Length", "0");
  EXPECT_EQ(azure::shared_key_authorization("devstoreaccount1", key, create),
            "SharedKey devstoreaccount1:sZqBT+ZsNZ5PZx+4oPdD1txPUk43E6w4EwJPqXivR2k=");
  azure::SharedKeyInput put{"PUT", "/mycontainer/dir/w.bin", {}, headers};
  put.headers.insert(put.headers.end(), {{"Content-Length", "11"},
                                         {"Content-Type", "application/octet-stream"},
                                         {"x-ms-blob-type", "BlockBlob"}});
  EXPECT_EQ(azure::shared_key_authorization("myaccount", key, put),
            "SharedKey myaccount:Sv0qADx+KS86CnJWMzRNAZZGLitEmo0ykVOvtS04uvE=");
}

TEST(AzureSharedKey, DatesAreRfc1123InGmt) {
  EXPECT_EQ(azure::rfc1123_date(std::chrono::system_clock::from_time_t(1255297753)), "Sun, 11 Oct 2009 21:49:13 GMT");
  EXPECT_EQ(azure::rfc1123_date(std::chrono::system_clock::from_time_t(0)), "Thu, 01 Jan 1970 00:00:00 GMT");
}

// ---- Connection strings, keys and SAS tokens ----

TEST(AzureConnectionString, ParsesEveryFormAzuresToolsWrite) {
  auto full = azure::parse_connection_string(
      "DefaultEndpointsProtocol=https;AccountName=myaccount;AccountKey=" + kKey + ";EndpointSuffix=core.chinacloudapi.cn");
  EXPECT_EQ(full.protocol, "https");
  EXPECT_EQ(full.account, "myaccount");
  EXPECT_EQ(full.key, kKey);  // the key's own '=' padding stays part of it
  EXPECT_EQ(full.endpoint_suffix, "core.chinacloudapi.cn");
  EXPECT_TRUE(full.blob_endpoint.empty());

  auto emulator = azure::parse_connection_string("DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=" +
                                                 kKey + ";BlobEndpoint=http://127.0.0.1:10000/devstoreaccount1/;"
                                                 "QueueEndpoint=http://127.0.0.1:10001/devstoreaccount1;");
  EXPECT_EQ(emulator.blob_endpoint, "http://127.0.0.1:10000/devstoreaccount1");

  auto development = azure::parse_connection_string("UseDevelopmentStorage=true");
  EXPECT_TRUE(development.development);
  EXPECT_EQ(development.account, "devstoreaccount1");
  EXPECT_EQ(development.key, kKey);
  EXPECT_EQ(development.blob_endpoint, "http://127.0.0.1:10000/devstoreaccount1");

  auto sas = azure::parse_connection_string("BlobEndpoint=https://myaccount.blob.core.windows.net;SharedAccessSignature=" +
                                            sas_token());
  EXPECT_EQ(sas.sas, sas_token());
  EXPECT_TRUE(sas.account.empty());
}

TEST(AzureConnectionString, MalformedOnesAreRefusedWithoutQuotingThem) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"AccountName=myaccount;" + kKey, "part 2 is not a setting of a connection string"},
      {"AccountName=myaccount;" + std::string(kSasSignature), "part 2 is not Name=value"},
      {"DefaultEndpointsProtocol=ftp;AccountName=myaccount;AccountKey=" + kKey, "DefaultEndpointsProtocol is 'ftp'"},
      {"BlobEndpoint=localhost:10000;AccountKey=" + kKey, "BlobEndpoint is not an http(s) URL"},
      {"AccountKey=" + kKey, "names neither an AccountName nor a BlobEndpoint"},
      {"BlobEndpoint=http://127.0.0.1:1/x;AccountKey=" + kKey, "has an AccountKey but no AccountName"},
  };
  for (const auto& [text, expected] : cases) {
    try {
      azure::parse_connection_string(text);
      ADD_FAILURE() << expected;
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kConfig);
      EXPECT_THAT(error.what(), AllOf(HasSubstr("AZURE_STORAGE_CONNECTION_STRING"), HasSubstr(expected)));
      expect_no_secret(error.what());
    }
  }
}

TEST(AzureCredentials, EndpointsAndKindsAsAzuresToolsPickThem) {
  AzureOptions options;
  options.imds_host = "http://127.0.0.1:9";
  // Nothing set: the machine's managed identity, at Azure's endpoint.
  azure::Credentials identity("myaccount", "", options);
  EXPECT_EQ(identity.kind(), azure::Credentials::Kind::kManagedIdentity);
  EXPECT_EQ(identity.endpoint(), "https://myaccount.blob.core.windows.net");
  EXPECT_EQ(identity.endpoint_path(), "");
  EXPECT_THAT(identity.description(), HasSubstr("IMDS at http://127.0.0.1:9"));
  // The https URL form's endpoint is used as given.
  EXPECT_EQ(azure::Credentials("myaccount", "https://myaccount.blob.core.windows.net", options).endpoint(),
            "https://myaccount.blob.core.windows.net");

  options.identity_endpoint = "http://127.0.0.1:9/msi/token";
  options.identity_header = kIdentityHeader;
  options.client_id = "1234-client";
  azure::Credentials app_service("myaccount", "", options);
  EXPECT_THAT(app_service.description(), AllOf(HasSubstr("App Service (IDENTITY_ENDPOINT http://127.0.0.1:9/msi/token)"),
                                               HasSubstr("client id 1234-client (AZURE_CLIENT_ID)")));

  options.anonymous = true;
  EXPECT_EQ(azure::Credentials("myaccount", "", options).kind(), azure::Credentials::Kind::kNone);
  options.sas_token = "?" + sas_token();
  azure::Credentials sas("myaccount", "", options);
  EXPECT_EQ(sas.kind(), azure::Credentials::Kind::kSas);
  EXPECT_EQ(sas.sas(), sas_token());  // without its '?'
  options.account_key = kKey;
  EXPECT_EQ(azure::Credentials("myaccount", "", options).kind(), azure::Credentials::Kind::kSharedKey);

  // A connection string comes first, with its own endpoint.
  options.connection_string = "UseDevelopmentStorage=true";
  azure::Credentials development("devstoreaccount1", "", options);
  EXPECT_EQ(development.kind(), azure::Credentials::Kind::kSharedKey);
  EXPECT_EQ(development.endpoint(), "http://127.0.0.1:10000/devstoreaccount1");
  EXPECT_EQ(development.endpoint_path(), "/devstoreaccount1");
  options.connection_string = "AccountName=myaccount;AccountKey=" + kKey + ";EndpointSuffix=core.usgovcloudapi.net";
  EXPECT_EQ(azure::Credentials("myaccount", "", options).endpoint(), "https://myaccount.blob.core.usgovcloudapi.net");
}

TEST(AzureCredentials, CredentialsThatCannotBeUsedAreRefusedNamingTheVariableNotTheSecret) {
  struct Case {
    std::string account;
    AzureOptions options;
    std::string expected;
  };
  std::vector<Case> cases(6);
  cases[0] = {"otheraccount", {}, "AZURE_STORAGE_CONNECTION_STRING is for account 'devstoreaccount1', not 'otheraccount'"};
  cases[0].options.connection_string = "UseDevelopmentStorage=true";
  cases[1] = {"otheraccount", {}, "AZURE_STORAGE_KEY is the key of account 'myaccount' (AZURE_STORAGE_ACCOUNT), not of "
                                  "'otheraccount'"};
  cases[1].options.account = "myaccount";
  cases[1].options.account_key = kKey;
  cases[2] = {"myaccount", {}, "the AZURE_STORAGE_KEY is not base64"};
  cases[2].options.account_key = "not base64 at all! " + std::string(kSasSignature);
  cases[3] = {"myaccount", {}, "AZURE_STORAGE_SAS_TOKEN is not a SAS token: it has no sig= parameter"};
  cases[3].options.sas_token = "sv=2021-08-06&sp=r";
  cases[4] = {"myaccount", {}, "AZURE_STORAGE_SAS_TOKEN holds characters a query string cannot"};
  cases[4].options.sas_token = "sv=1 2&sig=" + std::string(kSasSignature);
  cases[5] = {"myaccount", {}, "AZURE_STORAGE_SAS_TOKEN is a token of account 'myaccount2'"};
  cases[5].options.account = "myaccount2";
  cases[5].options.sas_token = sas_token();
  for (const auto& test : cases) {
    Options options;
    options.azure = test.options;
    try {
      open_azure_storage(test.account, "models", "llama", options);
      ADD_FAILURE() << test.expected;
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kConfig);
      EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot open az://" + test.account + "/models/llama"),
                                      HasSubstr(test.expected)));
      expect_no_secret(error.what());
    }
  }
}

// ---- Requests as they leave the client ----

TEST(AzureRequests, SharedKeyRequestsCarryTheSignatureOfWhatIsSent) {
  LoopbackServer server(head_response(5));
  azure::BlobClient client("devstoreaccount1", "", emulator_options(server.endpoint()).azure, transfer());
  EXPECT_EQ(client.metadata("models", "llama/a b+c.json").size, 5u);
  ASSERT_EQ(server.requests().size(), 1u);
  const std::string request = server.requests()[0];
  EXPECT_THAT(request, AllOf(HasSubstr("HEAD /devstoreaccount1/models/llama/a%20b%2Bc.json HTTP/1.1"),
                             HasSubstr("x-ms-version: 2021-08-06"), HasSubstr("Authorization: SharedKey devstoreaccount1:")));
  // Recomputed from the request as received: the path signed is the path sent.
  azure::SharedKeyInput input{"HEAD",
                              "/devstoreaccount1/models/llama/a%20b%2Bc.json",
                              {},
                              {{"x-ms-date", header_of(request, "x-ms-date")}, {"x-ms-version", "2021-08-06"}}};
  EXPECT_EQ(header_of(request, "Authorization"),
            azure::shared_key_authorization("devstoreaccount1", *s3::base64_decode(kKey), input));
}

TEST(AzureRequests, RangedReadsAskForTheirBytesWithXMsRange) {
  LoopbackServer server("HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 4096-4100/9000\r\nContent-Length: 5\r\n"
                        "Connection: close\r\n\r\nhello");
  azure::BlobClient client("devstoreaccount1", "", emulator_options(server.endpoint()).azure, transfer());
  std::string bytes(5, '\0');
  std::span<std::byte> segment = std::as_writable_bytes(std::span(bytes.data(), bytes.size()));
  client.get_range("models", "model.safetensors", 4096, std::span(&segment, 1), std::nullopt);
  EXPECT_EQ(bytes, "hello");
  const std::string request = server.requests().at(0);
  EXPECT_THAT(request, AllOf(HasSubstr("GET /devstoreaccount1/models/model.safetensors HTTP/1.1"),
                             HasSubstr("x-ms-range: bytes=4096-4100")));
  azure::SharedKeyInput input{"GET",
                              "/devstoreaccount1/models/model.safetensors",
                              {},
                              {{"x-ms-date", header_of(request, "x-ms-date")},
                               {"x-ms-version", "2021-08-06"},
                               {"x-ms-range", "bytes=4096-4100"}}};
  EXPECT_EQ(header_of(request, "Authorization"),
            azure::shared_key_authorization("devstoreaccount1", *s3::base64_decode(kKey), input));
}

TEST(AzureRequests, ListingsAskForOneLevelUnderThePrefixAndSignTheQuery) {
  const std::string body =
      "<?xml version=\"1.0\" encoding=\"utf-8\"?><EnumerationResults ContainerName=\"models\"><Prefix>llama/</Prefix>"
      "<Blobs><Blob><Name>llama/config.json</Name><Properties><Content-Length>12</Content-Length></Properties></Blob>"
      "<BlobPrefix><Name>llama/sub/</Name></BlobPrefix></Blobs><NextMarker /></EnumerationResults>";
  LoopbackServer server("HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\nConnection: close\r\nContent-Length: " +
                        std::to_string(body.size()) + "\r\n\r\n" + body);
  auto storage = open_azure_storage("devstoreaccount1", "models", "llama", emulator_options(server.endpoint()));
  EXPECT_EQ(storage->root_uri(), "az://devstoreaccount1/models/llama");
  auto objects = storage->list();
  ASSERT_EQ(objects.size(), 1u);
  EXPECT_EQ(objects[0].name, "config.json");
  EXPECT_EQ(objects[0].size, 12u);
  const std::string request = server.requests().at(0);
  EXPECT_THAT(request, HasSubstr("GET /devstoreaccount1/models?restype=container&comp=list&maxresults=5000&"
                                 "prefix=llama%2F&delimiter=%2F HTTP/1.1"));
  azure::SharedKeyInput input{"GET",
                              "/devstoreaccount1/models",
                              {{"restype", "container"},
                               {"comp", "list"},
                               {"maxresults", "5000"},
                               {"prefix", "llama/"},
                               {"delimiter", "/"}},
                              {{"x-ms-date", header_of(request, "x-ms-date")}, {"x-ms-version", "2021-08-06"}}};
  EXPECT_EQ(header_of(request, "Authorization"),
            azure::shared_key_authorization("devstoreaccount1", *s3::base64_decode(kKey), input));
}

TEST(AzureRequests, UploadsSignTheLengthAndTypeTheyAreSentWith) {
  LoopbackServer server("HTTP/1.1 201 Created\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
  azure::BlobClient client("devstoreaccount1", "", emulator_options(server.endpoint()).azure, transfer());
  client.put_blob("models", "dir/w.bin", "hello world");
  client.create_container("models");
  ASSERT_EQ(server.requests().size(), 2u);
  const std::string put = server.requests()[0];
  EXPECT_THAT(put, AllOf(HasSubstr("PUT /devstoreaccount1/models/dir/w.bin HTTP/1.1"), HasSubstr("Content-Length: 11"),
                         HasSubstr("x-ms-blob-type: BlockBlob"), HasSubstr("hello world")));
  azure::SharedKeyInput input{"PUT",
                              "/devstoreaccount1/models/dir/w.bin",
                              {},
                              {{"Content-Length", header_of(put, "Content-Length")},
                               {"Content-Type", header_of(put, "Content-Type")},
                               {"x-ms-blob-type", "BlockBlob"},
                               {"x-ms-date", header_of(put, "x-ms-date")},
                               {"x-ms-version", "2021-08-06"}}};
  EXPECT_EQ(header_of(put, "Authorization"),
            azure::shared_key_authorization("devstoreaccount1", *s3::base64_decode(kKey), input));
  const std::string create = server.requests()[1];
  EXPECT_THAT(create, AllOf(HasSubstr("PUT /devstoreaccount1/models?restype=container HTTP/1.1"),
                            HasSubstr("Content-Length: 0")));
  azure::SharedKeyInput container{"PUT",
                                  "/devstoreaccount1/models",
                                  {{"restype", "container"}},
                                  {{"x-ms-date", header_of(create, "x-ms-date")}, {"x-ms-version", "2021-08-06"}}};
  EXPECT_EQ(header_of(create, "Authorization"),
            azure::shared_key_authorization("devstoreaccount1", *s3::base64_decode(kKey), container));
}

TEST(AzureRequests, SasTokensGoInTheQueryAndAnonymousRequestsCarryNothing) {
  LoopbackServer server(head_response(7));
  AzureOptions options;
  options.connection_string = "BlobEndpoint=" + server.endpoint() + "/myaccount;SharedAccessSignature=" + sas_token();
  azure::BlobClient client("myaccount", "", options, transfer());
  EXPECT_EQ(client.metadata("models", "m.bin").size, 7u);
  EXPECT_THAT(server.requests().at(0), AllOf(HasSubstr("HEAD /myaccount/models/m.bin?" + sas_token() + " HTTP/1.1"),
                                             Not(HasSubstr("Authorization"))));
  AzureOptions anonymous;
  anonymous.anonymous = true;
  azure::BlobClient public_client("myaccount", server.endpoint(), anonymous, transfer());
  EXPECT_EQ(public_client.metadata("models", "m.bin").size, 7u);
  EXPECT_THAT(server.requests().at(1), AllOf(HasSubstr("HEAD /models/m.bin HTTP/1.1"), Not(HasSubstr("Authorization")),
                                             HasSubstr("x-ms-version: 2021-08-06")));
}

// ---- Managed identity ----

TEST(AzureManagedIdentity, ImdsTokensAreSentAsBearerAndReusedUntilTheyNearTheirExpiry) {
  for (int lifetime : {3600, 0}) {
    SCOPED_TRACE(lifetime);
    // IMDS sends its numbers as strings.
    LoopbackServer imds(json_response(200, "OK",
                                      nlohmann::json{{"access_token", kTestToken},
                                                     {"expires_in", std::to_string(lifetime)},
                                                     {"token_type", "Bearer"}}
                                          .dump()));
    LoopbackServer storage_endpoint(head_response(5));
    AzureOptions options;
    options.imds_host = imds.authority();  // "host:port", as AZURE_POD_IDENTITY_AUTHORITY_HOST may give it
    azure::BlobClient client("myaccount", storage_endpoint.endpoint(), options, transfer());
    for (int i = 0; i < 3; ++i) EXPECT_EQ(client.metadata("models", "m/config.json").size, 5u);
    EXPECT_EQ(client.credentials().tokens_fetched(), lifetime == 3600 ? 1u : 3u);
    EXPECT_THAT(imds.requests().at(0),
                AllOf(HasSubstr("GET /metadata/identity/oauth2/token?api-version=2018-02-01&resource="
                                "https%3A%2F%2Fstorage.azure.com%2F HTTP/1.1"),
                      HasSubstr("Metadata: true")));
    for (const auto& request : storage_endpoint.requests())
      EXPECT_THAT(request, HasSubstr(std::string("Authorization: Bearer ") + kTestToken));
  }
}

TEST(AzureManagedIdentity, AppServiceTokensComeWithTheIdentityHeader) {
  const auto expires_on = std::chrono::duration_cast<std::chrono::seconds>(
                              std::chrono::system_clock::now().time_since_epoch() + std::chrono::hours(1))
                              .count();
  LoopbackServer identity(json_response(
      200, "OK",
      nlohmann::json{{"access_token", kTestToken}, {"expires_on", std::to_string(expires_on)}, {"resource", "x"}}.dump()));
  LoopbackServer storage_endpoint(head_response(5));
  AzureOptions options;
  options.identity_endpoint = identity.endpoint() + "/msi/token";
  options.identity_header = kIdentityHeader;
  options.client_id = "user-assigned-1";
  azure::BlobClient client("myaccount", storage_endpoint.endpoint(), options, transfer());
  for (int i = 0; i < 2; ++i) EXPECT_EQ(client.metadata("models", "m").size, 5u);
  EXPECT_EQ(client.credentials().tokens_fetched(), 1u);
  ASSERT_EQ(identity.requests().size(), 1u);
  EXPECT_THAT(identity.requests()[0],
              AllOf(HasSubstr("GET /msi/token?api-version=2019-08-01&resource=https%3A%2F%2Fstorage.azure.com%2F"
                              "&client_id=user-assigned-1 HTTP/1.1"),
                    HasSubstr(std::string("X-IDENTITY-HEADER: ") + kIdentityHeader)));
}

TEST(AzureManagedIdentity, NoIdentityEndpointIsExplainedWithTheVariablesToSet) {
  Options options;
  options.s3 = transfer();
  options.azure.imds_host = closed_endpoint();  // off Azure: nothing there
  auto storage = open_azure_storage("myaccount", "models", "llama", options);
  try {
    storage->stat("config.json");
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kPermission);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot stat az://myaccount/models/llama/config.json"),
                                    HasSubstr("cannot get an access token from the managed identity of the machine "
                                              "(IMDS at " + options.azure.imds_host + ")"),
                                    HasSubstr("set AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_KEY"),
                                    HasSubstr("AZURE_STORAGE_SAS_TOKEN")));
  }
}

TEST(AzureManagedIdentity, ARefusingIdentityEndpointIsAClearErrorWithoutSecrets) {
  // The refusal echoes the identity header, as a careless proxy might: it may not be shown.
  LoopbackServer identity(json_response(
      400, "Bad Request",
      nlohmann::json{{"statusCode", 400}, {"message", std::string("No identity for header ") + kIdentityHeader}}.dump()));
  Options options;
  options.s3 = transfer();
  options.azure.identity_endpoint = identity.endpoint() + "/msi/token";
  options.azure.identity_header = kIdentityHeader;
  auto storage = open_azure_storage("myaccount", "models", "llama", options, closed_endpoint());
  try {
    storage->stat("config.json");
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kPermission);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot stat az://myaccount/models/llama/config.json"),
                                    HasSubstr("HTTP 400: No identity for header <redacted>"),
                                    HasSubstr("the identity endpoint refused")));
    expect_no_secret(error.what());
  }
  EXPECT_EQ(identity.requests().size(), 1u);  // a refusal is not retried
}

TEST(AzureManagedIdentity, A401GetsOneFreshTokenAndNeverShowsIt) {
  LoopbackServer imds(json_response(200, "OK", nlohmann::json{{"access_token", kTestToken}, {"expires_in", "3600"}}.dump()));
  LoopbackServer storage_endpoint(error_response(401, "Unauthorized", "InvalidAuthenticationInfo",
                                                 std::string("Server failed to authenticate the request. ") + kTestToken));
  Options options;
  options.s3 = transfer();
  options.azure.imds_host = imds.endpoint();
  auto storage = open_azure_storage("myaccount", "models", "llama", options, storage_endpoint.endpoint());
  try {
    storage->stat("config.json");
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kPermission);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("HTTP 401 InvalidAuthenticationInfo"), HasSubstr("after 2 attempts"),
                                    HasSubstr("a credential problem")));
    expect_no_secret(error.what());
  }
  EXPECT_EQ(imds.requests().size(), 2u);  // the first token, and one fresh one after the 401
  EXPECT_EQ(storage_endpoint.requests().size(), 2u);
}

// ---- Errors ----

TEST(AzureErrors, AuthenticationFailedIsNotRetriedAndEchoesNoSignature) {
  // Azure quotes the signature it was sent back in AuthenticationFailed; a test server that
  // echoes the key as well stands for the worst a proxy could do.
  LoopbackServer server(error_response(
      403, "Server failed to authenticate the request",
      "AuthenticationFailed",
      "Server failed to authenticate the request. The MAC signature found in the HTTP request '" + kKey +
          "' is not the same as any computed signature."));
  auto options = emulator_options(server.endpoint());
  auto storage = open_azure_storage("devstoreaccount1", "models", "llama", options);
  try {
    storage->list();  // a GET: its answer has the document (a HEAD's has x-ms-error-code only)
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kPermission);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot list az://devstoreaccount1/models/llama"),
                                    HasSubstr("HTTP 403 AuthenticationFailed: Server failed to authenticate"),
                                    HasSubstr("The MAC signature found in the HTTP request '<redacted>'"),
                                    HasSubstr("(request id req-9), after 1 attempt"), HasSubstr("a credential problem"),
                                    HasSubstr("the account key of AZURE_STORAGE_CONNECTION_STRING")));
    expect_no_secret(error.what());
  }
  EXPECT_EQ(server.requests().size(), 1u);
}

TEST(AzureErrors, WhyASignatureWasRefusedIsShownWithoutTheSignature) {
  // Azure says why in AuthenticationErrorDetail: a clock too far off, or a MAC that differs
  // (quoting the signature it was sent, which is masked).
  LoopbackServer clock(error_response(403, "Forbidden", "AuthenticationFailed",
                                      "Server failed to authenticate the request. Make sure the value of Authorization "
                                      "header is formed correctly including the signature.",
                                      "Request date header too old: 'Mon, 07 Dec 2026 11:00:00 GMT'"));
  try {
    open_azure_storage("devstoreaccount1", "models", "llama", emulator_options(clock.endpoint()))->list();
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kPermission);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("HTTP 403 AuthenticationFailed: Server failed to authenticate"),
                                    HasSubstr("(Request date header too old: 'Mon, 07 Dec 2026 11:00:00 GMT')")));
  }
  LoopbackServer mac(error_response(403, "Forbidden", "AuthenticationFailed", "Server failed to authenticate the request.",
                                    "The MAC signature found in the HTTP request '" + kKey +
                                        "' is not the same as any computed signature. Server used following string "
                                        "to sign: 'GET\n\n'."));
  try {
    open_azure_storage("devstoreaccount1", "models", "llama", emulator_options(mac.endpoint()))->list();
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), HasSubstr("(The MAC signature found in the HTTP request '<redacted>' is not the same"));
    expect_no_secret(error.what());
  }
}

TEST(AzureErrors, NoSignatureOrTokenSentIsQuotedBack) {
  // A server that quotes back the whole Authorization header it was sent, in the message and
  // in the detail: the Shared Key signature of that request, and a managed identity's token.
  const std::string refusal = error_response(403, "Forbidden", "AuthenticationFailed",
                                             "Refused " + std::string(LoopbackServer::kEchoAuthorization),
                                             "Header " + std::string(LoopbackServer::kEchoAuthorization));
  LoopbackServer server(refusal);
  try {
    open_azure_storage("devstoreaccount1", "models", "llama", emulator_options(server.endpoint()))->list();
    FAIL() << "expected an error";
  } catch (const Error& error) {
    const std::string sent = header_of(server.requests().at(0), "Authorization");
    ASSERT_TRUE(sent.starts_with("SharedKey devstoreaccount1:"));
    EXPECT_THAT(error.what(), AllOf(HasSubstr("Refused SharedKey devstoreaccount1:<redacted>"),
                                    HasSubstr("(Header SharedKey devstoreaccount1:<redacted>)"),
                                    Not(HasSubstr(sent.substr(sent.find(':') + 1)))));
  }
  LoopbackServer imds(json_response(200, "OK", nlohmann::json{{"access_token", kTestToken}, {"expires_in", "3600"}}.dump()));
  LoopbackServer storage_endpoint(refusal);
  Options options;
  options.s3 = transfer();
  options.azure.imds_host = imds.endpoint();
  try {
    open_azure_storage("myaccount", "models", "llama", options, storage_endpoint.endpoint())->list();
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), HasSubstr("Refused Bearer <redacted>"));
    expect_no_secret(error.what());
  }
}

TEST(AzureErrors, AMissingBlobOrContainerIsNotFoundNamingIt) {
  {
    // A HEAD's 404 has no body: the code is in x-ms-error-code.
    LoopbackServer server("HTTP/1.1 404 The specified blob does not exist.\r\nx-ms-error-code: BlobNotFound\r\n"
                          "x-ms-request-id: req-4\r\nContent-Length: 215\r\nConnection: close\r\n\r\n");
    auto storage = open_azure_storage("devstoreaccount1", "models", "llama", emulator_options(server.endpoint()));
    try {
      storage->stat("missing.safetensors");
      FAIL() << "expected an error";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kNotFound);
      EXPECT_THAT(error.what(),
                  AllOf(HasSubstr("no object az://devstoreaccount1/models/llama/missing.safetensors (HTTP 404 BlobNotFound"),
                        HasSubstr("check the container 'models'")));
    }
  }
  LoopbackServer server(error_response(404, "The specified container does not exist.", "ContainerNotFound",
                                       "The specified container does not exist."));
  auto storage = open_azure_storage("devstoreaccount1", "nomodels", "llama", emulator_options(server.endpoint()));
  try {
    storage->list();
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kNotFound);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot list az://devstoreaccount1/nomodels/llama"),
                                    HasSubstr("no container az://devstoreaccount1/nomodels (HTTP 404 ContainerNotFound"),
                                    HasSubstr("check the account 'devstoreaccount1'")));
  }
}

TEST(AzureErrors, ServerBusyIsRetriedAndCountedInOneError) {
  LoopbackServer server(error_response(503, "Server Busy", "ServerBusy", "The server is currently unable to receive requests."));
  auto options = emulator_options(server.endpoint());
  options.s3.max_attempts = 3;
  auto storage = open_azure_storage("devstoreaccount1", "models", "llama", options);
  try {
    storage->stat("config.json");
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot stat az://devstoreaccount1/models/llama/config.json"),
                                    HasSubstr("HTTP 503 ServerBusy"), HasSubstr("after 3 attempts")));
  }
  EXPECT_EQ(server.requests().size(), 3u);
}

TEST(AzureErrors, AKilledServerIsAClearErrorNamingTheObject) {
  auto storage = open_azure_storage("devstoreaccount1", "models", "llama", emulator_options(closed_endpoint()));
  std::string bytes(1000, '\0');
  try {
    storage->read("model.safetensors", 0, std::as_writable_bytes(std::span(bytes.data(), bytes.size())));
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kNetwork);
    EXPECT_THAT(error.what(), AllOf(HasSubstr("cannot read 0+1000 bytes of az://devstoreaccount1/models/llama/model.safetensors"),
                                    HasSubstr("transfer failed (curl error 7")));
    expect_no_secret(error.what());
  }
}

// ---- Documents, URIs and options ----

TEST(AzureListing, ParsesMicrosoftsDocumentedResponseAndRefusesMalformedOnes) {
  // The shape of https://learn.microsoft.com/rest/api/storageservices/list-blobs#response-body.
  auto page = azure::parse_list_page(R"(<?xml version="1.0" encoding="utf-8"?>
<EnumerationResults ServiceEndpoint="https://myaccount.blob.core.windows.net/" ContainerName="mycontainer">
  <Prefix>m/</Prefix><Marker>string-value</Marker><MaxResults>5000</MaxResults><Delimiter>/</Delimiter>
  <Blobs>
    <Blob><Name>m/a.safetensors</Name><Properties><Creation-Time>Mon, 07 Dec 2026 12:00:00 GMT</Creation-Time>
      <Content-Length>18446744073709551615</Content-Length><Content-Type>application/octet-stream</Content-Type>
      <BlobType>BlockBlob</BlobType></Properties><Metadata /></Blob>
    <BlobPrefix><Name>m/d/</Name></BlobPrefix>
  </Blobs>
  <NextMarker>2!96!abc</NextMarker>
</EnumerationResults>)");
  ASSERT_EQ(page.objects.size(), 1u);
  EXPECT_EQ(page.objects[0].key, "m/a.safetensors");
  EXPECT_EQ(page.objects[0].size, UINT64_MAX);
  EXPECT_EQ(page.prefixes, std::vector<std::string>{"m/d/"});
  EXPECT_EQ(page.next_marker, "2!96!abc");
  EXPECT_TRUE(azure::parse_list_page("<EnumerationResults/>").objects.empty());
  // Azure starts its XML with a UTF-8 byte order mark.
  auto bom = azure::parse_list_page("\xEF\xBB\xBF<?xml version=\"1.0\" encoding=\"utf-8\"?><EnumerationResults><Blobs><Blob>"
                                    "<Name>x</Name><Properties><Content-Length>3</Content-Length></Properties></Blob>"
                                    "</Blobs></EnumerationResults>");
  ASSERT_EQ(bom.objects.size(), 1u);
  EXPECT_EQ(bom.objects[0].size, 3u);
  for (std::string bad : {"<EnumerationResults>", "<ListBucketResult/>",
                          "<EnumerationResults><Blobs><Blob><Properties><Content-Length>1</Content-Length></Properties>"
                          "</Blob></Blobs></EnumerationResults>",
                          "<EnumerationResults><Blobs><Blob><Name>a</Name><Properties><Content-Length>-1</Content-Length>"
                          "</Properties></Blob></Blobs></EnumerationResults>",
                          "<EnumerationResults><Blobs><Blob><Name>a</Name></Blob></Blobs></EnumerationResults>"}) {
    try {
      azure::parse_list_page(bad);
      ADD_FAILURE() << bad;
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kFormat) << bad;
      EXPECT_THAT(error.what(), HasSubstr("malformed List Blobs response")) << bad;
    }
  }
  auto error = azure::parse_error_body(
      "<?xml version=\"1.0\"?><Error><Code>BlobNotFound</Code><Message>The specified blob does not exist.\n"
      "RequestId:1\nTime:2\n</Message></Error>");
  EXPECT_EQ(error.code, "BlobNotFound");
  EXPECT_EQ(error.message, "The specified blob does not exist.");
  EXPECT_EQ(azure::parse_error_body("<html>").code, "");
  // A secret that straddles the cut is masked before it, not half shown after it.
  auto masked = azure::parse_error_body("<Error><Code>AuthenticationFailed</Code><Message>" + std::string(180, 'x') + kKey +
                                            "</Message></Error>",
                                        [](std::string text) { return storage::mask_secrets(std::move(text), {kKey}); });
  EXPECT_THAT(masked.message, AllOf(HasSubstr("<redacted>"), Not(HasSubstr(kKey.substr(0, 10)))));
}

TEST(AzureUri, ParsesBothFormsAndRefusesBadNames) {
  auto uri = parse_uri("az://myaccount/models/llama-8b/");
  EXPECT_EQ(uri.scheme, Uri::Scheme::kAzure);
  EXPECT_EQ(uri.account, "myaccount");
  EXPECT_EQ(uri.bucket, "models");
  EXPECT_EQ(uri.path, "llama-8b");
  EXPECT_TRUE(uri.endpoint.empty());
  auto https = parse_uri("https://myaccount.blob.core.windows.net/models/llama-8b/model.safetensors");
  EXPECT_EQ(https.scheme, Uri::Scheme::kAzure);
  EXPECT_EQ(https.account, "myaccount");
  EXPECT_EQ(https.bucket, "models");
  EXPECT_EQ(https.path, "llama-8b/model.safetensors");
  EXPECT_EQ(https.endpoint, "https://myaccount.blob.core.windows.net");
  EXPECT_EQ(parse_uri("az://myaccount/$root").bucket, "$root");
  EXPECT_EQ(parse_uri("https://example.com/x").scheme, Uri::Scheme::kHttp);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"az://", "Azure URI without an account"},
      {"az://myaccount", "Azure URI without a container"},
      {"az://myaccount/", "Azure URI without a container"},
      {"az://My_Account/models", "storage account name 'My_Account' is not valid"},
      {"az://ab/models", "storage account name 'ab' is not valid"},
      {"az://myaccount/Models", "container name 'Models' is not valid"},
      {"az://myaccount/a--b", "container name 'a--b' is not valid"},
      {"az://myaccount/-ab", "container name '-ab' is not valid"},
      {"https://myaccount.blob.core.windows.net", "Azure URI without a container"},
  };
  for (const auto& [text, expected] : cases) {
    try {
      parse_uri(text);
      ADD_FAILURE() << text;
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument) << text;
      EXPECT_THAT(error.what(), HasSubstr(expected)) << text;
    }
  }
  // A SAS URL pasted whole is refused without repeating its signature.
  try {
    parse_uri("https://myaccount.blob.core.windows.net/models/m?" + sas_token());
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(error.what(), HasSubstr("give the SAS token in AZURE_STORAGE_SAS_TOKEN"));
    expect_no_secret(error.what());
  }
}

TEST(AzureOptions, AzuresVariablesAreReadIntoOptions) {
  auto options = options_from_environment({{"AZURE_STORAGE_CONNECTION_STRING", "UseDevelopmentStorage=true"},
                                           {"AZURE_STORAGE_ACCOUNT", "myaccount"},
                                           {"AZURE_STORAGE_KEY", kKey},
                                           {"AZURE_STORAGE_SAS_TOKEN", sas_token()},
                                           {"IDENTITY_ENDPOINT", "http://127.0.0.1:41741/msi/token"},
                                           {"IDENTITY_HEADER", kIdentityHeader},
                                           {"AZURE_POD_IDENTITY_AUTHORITY_HOST", "http://127.0.0.1:9"},
                                           {"AZURE_CLIENT_ID", "client-1"},
                                           {"WEIGHTSTREAM_AZURE_ANONYMOUS", "yes"}});
  EXPECT_EQ(options.azure.connection_string, "UseDevelopmentStorage=true");
  EXPECT_EQ(options.azure.account, "myaccount");
  EXPECT_EQ(options.azure.account_key, kKey);
  EXPECT_EQ(options.azure.sas_token, sas_token());
  EXPECT_EQ(options.azure.identity_endpoint, "http://127.0.0.1:41741/msi/token");
  EXPECT_EQ(options.azure.identity_header, kIdentityHeader);
  EXPECT_EQ(options.azure.imds_host, "http://127.0.0.1:9");
  EXPECT_EQ(options.azure.client_id, "client-1");
  EXPECT_TRUE(options.azure.anonymous);
  auto defaults = options_from_environment({});
  EXPECT_EQ(defaults.azure.imds_host, "http://169.254.169.254");
  EXPECT_FALSE(defaults.azure.anonymous);
  try {
    options_from_environment({{"WEIGHTSTREAM_AZURE_ANONYMOUS", "maybe"}});
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kConfig);
    EXPECT_THAT(error.what(), HasSubstr("WEIGHTSTREAM_AZURE_ANONYMOUS='maybe'"));
  }
}

}  // namespace
}  // namespace weightstream
