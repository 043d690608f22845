#pragma once
// Test fixtures for the Azure Blob backend: the emulator a run started, named by
// WS_TEST_AZURE_CONNECTION_STRING (a connection string with its BlobEndpoint; scripts/azurite.sh
// sets it where azurite-blob is installed), options that reach it, fresh containers. No Blob
// emulator installs from PyPI or Debian (docs/AZURE.md), so on these machines the tests that
// need one skip, saying so.

#include <cstdlib>
#include <optional>
#include <string>

#include <gtest/gtest.h>

#include "storage/test_s3_fixture.hpp"
#include "weightstream/options.hpp"

namespace weightstream::testing {

/// The connection string of the test Blob emulator, or nullopt when the run has none.
inline std::optional<std::string> azure_test_connection_string() {
  const char* text = std::getenv("WS_TEST_AZURE_CONNECTION_STRING");
  if (!text || !*text) return std::nullopt;
  return std::string(text);
}

/// Skips the current test when no Blob emulator was started for the run.
#define WS_REQUIRE_AZURE_SERVER()                                                                          \
  do {                                                                                                     \
    if (!::weightstream::testing::azure_test_connection_string())                                          \
      GTEST_SKIP() << "WS_TEST_AZURE_CONNECTION_STRING is not set: no Azure Blob emulator for this run "   \
                      "(Azurite needs npm; scripts/azurite.sh starts azurite-blob where it is installed)";  \
  } while (0)

/// Options that reach the emulator through `connection_string`, with fast retries and short
/// timeouts: the transfer fields of s3_test_options. IMDS is pointed at a closed loopback
/// port, so that no test ever asks the real one.
inline Options azure_test_options(const std::string& connection_string) {
  Options options;
  options.s3 = s3_test_options("http://127.0.0.1:9");
  options.azure.connection_string = connection_string;
  options.azure.imds_host = "http://127.0.0.1:9";
  return options;
}

/// `connection_string` with its BlobEndpoint's scheme, host and port replaced by `endpoint`
/// (a fault proxy in front of the emulator), its path kept.
inline std::string azure_connection_string_via(const std::string& connection_string, const std::string& endpoint) {
  const std::string marker = "BlobEndpoint=";
  const size_t start = connection_string.find(marker);
  if (start == std::string::npos) return connection_string;
  const size_t value = start + marker.size();
  const size_t authority = connection_string.find("://", value) + 3;
  size_t path = connection_string.find_first_of("/;", authority);
  if (path == std::string::npos) path = connection_string.size();
  return connection_string.substr(0, value) + endpoint + connection_string.substr(path);
}

/// A fresh container name (Azure's rules: lowercase, digits, single dashes).
inline std::string unique_container(const std::string& stem) { return unique_bucket(stem); }

}  // namespace weightstream::testing
