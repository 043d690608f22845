#pragma once
// Test fixtures for the S3 backend: the S3-compatible server the run started (moto's, named
// by WS_TEST_S3_ENDPOINT), fresh buckets, uploads, and the fault-injecting proxy of
// tests/tools/fault_proxy.py placed in front of that server.

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "storage/s3_client.hpp"
#include "storage/http_client.hpp"
#include "weightstream/options.hpp"

extern char** environ;

namespace weightstream::testing {

/// The endpoint of the test S3 server, or nullopt when the run has none.
inline std::optional<std::string> s3_test_endpoint() {
  const char* endpoint = std::getenv("WS_TEST_S3_ENDPOINT");
  if (!endpoint || !*endpoint) return std::nullopt;
  return std::string(endpoint);
}

/// Skips the current test when no S3 server was started for the run.
#define WS_REQUIRE_S3_SERVER()                                                                              \
  do {                                                                                                      \
    if (!::weightstream::testing::s3_test_endpoint())                                                       \
      GTEST_SKIP() << "WS_TEST_S3_ENDPOINT is not set: no S3-compatible server for this run "              \
                      "(scripts/test.sh starts moto_server and sets it)";                                    \
  } while (0)

/// The secret the tests sign with; tests assert that it never appears in any message.
inline constexpr const char* kTestSecret = "wsTestSecretKey/DoNotPrint+0123456789abcdef";

/// S3Options for `endpoint` with test credentials, fast retries and short timeouts.
inline S3Options s3_test_options(const std::string& endpoint) {
  S3Options options;
  options.endpoint = endpoint;
  options.region = "us-east-1";
  options.access_key_id = "AKIAWSTESTEXAMPLE";
  options.secret_access_key = kTestSecret;
  options.credentials_file = "";
  options.addressing = S3Addressing::kPath;
  options.max_attempts = 5;
  options.retry_base_seconds = 0.01;
  options.timeout_seconds = 5;
  options.deadline_seconds = 60;
  options.max_connections = 8;
  return options;
}

/// A bucket name no other test uses.
inline std::string unique_bucket(const std::string& stem) {
  static std::mt19937_64 random{std::random_device{}()};
  return stem + "-" + std::to_string(random() % 1000000000);
}

/// Deterministic bytes of `size` for `seed`.
inline std::string pattern_bytes(size_t size, uint32_t seed) {
  std::string bytes(size, '\0');
  uint32_t state = seed * 2654435761u + 1;
  for (auto& byte : bytes) {
    state = state * 1664525u + 1013904223u;
    byte = static_cast<char>(state >> 24);
  }
  return bytes;
}

/// tests/tools/fault_proxy.py running in front of `upstream`, stopped on destruction.
class FaultProxy {
 public:
  /// `flavor` "gcs" answers its injected errors with the JSON API's documents, "s3" with S3's.
  explicit FaultProxy(const std::string& upstream, double stall_seconds = 3, const std::string& flavor = "s3") {
    int to_child[2], from_child[2];
    if (pipe(to_child) != 0 || pipe(from_child) != 0) throw std::runtime_error("pipe failed");
    const std::string script = std::string(WS_SOURCE_DIR) + "/tests/tools/fault_proxy.py";
    std::vector<std::string> arguments = {"python3", script, "--upstream", upstream, "--stall",
                                          std::to_string(stall_seconds), "--lifetime", "600", "--watch-stdin",
                                          "--flavor", flavor};
    std::vector<char*> argv;
    for (auto& argument : arguments) argv.push_back(argument.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, to_child[0], 0);
    posix_spawn_file_actions_adddup2(&actions, from_child[1], 1);
    posix_spawn_file_actions_addclose(&actions, to_child[1]);
    posix_spawn_file_actions_addclose(&actions, from_child[0]);
    int rc = posix_spawnp(&pid_, "python3", &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    close(to_child[0]);
    close(from_child[1]);
    if (rc != 0) throw std::runtime_error("cannot start python3 " + script);
    stdin_ = to_child[1];
    // The first line is "PORT <n>"; read it byte by byte (bounded).
    std::string line;
    char c = 0;
    while (line.size() < 64 && read(from_child[0], &c, 1) == 1 && c != '\n') line += c;
    close(from_child[0]);
    if (!line.starts_with("PORT ")) throw std::runtime_error("fault proxy did not start: '" + line + "'");
    port_ = std::stoi(line.substr(5));
    control_ = std::make_unique<storage::HttpClient>(storage::HttpSettings{true, "", 10, 2});
  }

  ~FaultProxy() {
    if (stdin_ >= 0) close(stdin_);
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      int status = 0;
      waitpid(pid_, &status, 0);
    }
  }

  FaultProxy(const FaultProxy&) = delete;
  FaultProxy& operator=(const FaultProxy&) = delete;

  /// The proxy's endpoint URL.
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }

  /// Arms `mode` for the next `count` requests with `method` (any method when empty) whose
  /// path holds `path_part` (any path when empty).
  void arm(const std::string& mode, int count, const std::string& method = "GET", const std::string& path_part = "") {
    std::string path = "/__fault__/plan?mode=" + mode + "&count=" + std::to_string(count);
    if (!method.empty()) path += "&method=" + method;
    if (!path_part.empty()) path += "&path=" + path_part;
    control(path);
  }
  /// Disarms and zeroes the counters.
  void clear() { control("/__fault__/clear"); }
  /// Requests forwarded since the last clear(), by method ("GET", "HEAD", ...).
  int requests(const std::string& method) {
    auto stats = nlohmann::json::parse(control("/__fault__/stats"));
    return stats["by_method"].value(method, 0);
  }
  int faults() { return nlohmann::json::parse(control("/__fault__/stats"))["faults"].get<int>(); }

 private:
  std::string control(const std::string& path) {
    storage::HttpRequest request;
    request.url = endpoint() + path;
    request.timeout_seconds = 10;
    auto response = control_->perform(request);
    if (response.transport_error != 0 || response.status != 200)
      throw std::runtime_error("fault proxy control " + path + " failed: " + response.transport_message);
    return response.body;
  }

  pid_t pid_ = -1;
  int stdin_ = -1;
  int port_ = 0;
  std::unique_ptr<storage::HttpClient> control_;
};

}  // namespace weightstream::testing
