#pragma once
// Test fixtures for the GCS backend: the emulator the run started (fake-gcs-server, named by
// WS_TEST_GCS_ENDPOINT; scripts/fake-gcs-server.sh), options that reach it, fresh buckets.

#include <cstdlib>
#include <optional>
#include <string>

#include <gtest/gtest.h>

#include "storage/test_s3_fixture.hpp"
#include "weightstream/options.hpp"

namespace weightstream::testing {

/// The URL of the test GCS emulator, or nullopt when the run has none.
inline std::optional<std::string> gcs_test_endpoint() {
  const char* endpoint = std::getenv("WS_TEST_GCS_ENDPOINT");
  if (!endpoint || !*endpoint) return std::nullopt;
  return std::string(endpoint);
}

/// Skips the current test when no GCS emulator was started for the run.
#define WS_REQUIRE_GCS_SERVER()                                                                             \
  do {                                                                                                      \
    if (!::weightstream::testing::gcs_test_endpoint())                                                      \
      GTEST_SKIP() << "WS_TEST_GCS_ENDPOINT is not set: no GCS emulator for this run (scripts/test.sh "     \
                      "starts fake-gcs-server, which scripts/install-deps.sh installs)";                     \
  } while (0)

/// Options that reach the emulator at `endpoint` (as STORAGE_EMULATOR_HOST would), with fast
/// retries and short timeouts: the transfer fields of s3_test_options.
inline Options gcs_test_options(const std::string& endpoint) {
  Options options;
  options.s3 = s3_test_options("http://127.0.0.1:9");
  options.gcs.emulator_host = endpoint;
  return options;
}

}  // namespace weightstream::testing
