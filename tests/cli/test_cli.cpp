// The `weightstream` command as a user runs it: synth, inspect, load, digest, and the
// one-line errors for bad input.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sstream>

#include "support/test_support.hpp"

namespace weightstream {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using testing::run_cli;
using testing::TempDir;

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream stream(text);
  for (std::string line; std::getline(stream, line);) lines.push_back(line);
  return lines;
}

void expect_one_line_error(const testing::CommandResult& result, std::string_view needle) {
  EXPECT_NE(result.exit_code, 0);
  auto lines = lines_of(result.err);
  ASSERT_EQ(lines.size(), 1u) << result.err;
  EXPECT_THAT(lines[0], StartsWith("weightstream: error: "));
  EXPECT_THAT(lines[0], HasSubstr(std::string(needle)));
}

class CliCheckpoint : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    directory_ = new TempDir();
    auto result = run_cli({"synth", (directory_->path() / "llama").string(), "--arch", "llama", "--layers", "3", "--shards",
                           "2", "--seed", "5"});
    ASSERT_EQ(result.exit_code, 0) << result.err;
  }
  static void TearDownTestSuite() { delete directory_; }
  static std::string model() { return (directory_->path() / "llama").string(); }
  static TempDir* directory_;
};
TempDir* CliCheckpoint::directory_ = nullptr;

TEST_F(CliCheckpoint, InspectJsonListsEveryTensor) {
  auto result = run_cli({"inspect", model(), "--json"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  auto json = nlohmann::json::parse(result.out);
  EXPECT_EQ(json["shards"].size(), 2u);
  EXPECT_EQ(json["tensors"].size(), json["tensor_count"].get<size_t>());
  bool found = false;
  for (const auto& tensor : json["tensors"]) {
    if (tensor["name"] == "model.layers.0.self_attn.q_proj.weight") {
      found = true;
      EXPECT_EQ(tensor["dtype"], "BF16");
      EXPECT_EQ(tensor["shape"].size(), 2u);
    }
  }
  EXPECT_TRUE(found);
}

TEST_F(CliCheckpoint, LoadReportsTheDocumentedFields) {
  for (std::string io : {"pread", "uring"}) {
    auto result = run_cli({"load", model(), "--json", "--io", io, "--memory-limit", "1MiB", "--concurrency", "4"});
    ASSERT_EQ(result.exit_code, 0) << result.err;
    auto json = nlohmann::json::parse(result.out);
    for (auto field : {"tensors", "bytes", "seconds", "gbps", "peak_staging_bytes"}) EXPECT_TRUE(json.contains(field)) << field;
    auto inspect = nlohmann::json::parse(run_cli({"inspect", model(), "--json"}).out);
    EXPECT_EQ(json["tensors"], inspect["tensor_count"]);
    EXPECT_EQ(json["bytes"], inspect["bytes"]);
    EXPECT_LE(json["peak_staging_bytes"].get<uint64_t>(), 1024u * 1024u);
  }
}

TEST_F(CliCheckpoint, DigestIsOneJsonLinePerTensorAndStable) {
  auto first = run_cli({"digest", model(), "--json"});
  ASSERT_EQ(first.exit_code, 0) << first.err;
  auto lines = lines_of(first.out);
  auto inspect = nlohmann::json::parse(run_cli({"inspect", model(), "--json"}).out);
  ASSERT_EQ(lines.size(), inspect["tensor_count"].get<size_t>());
  for (const auto& line : lines) {
    auto json = nlohmann::json::parse(line);
    EXPECT_EQ(json["sha256"].get<std::string>().size(), 64u);
    EXPECT_TRUE(json.contains("name"));
  }
  auto second = run_cli({"digest", model(), "--json", "--memory-limit", "64KiB", "--concurrency", "3"});
  EXPECT_EQ(first.out, second.out);
  auto xxh = run_cli({"digest", model(), "--hash", "xxh64"});
  ASSERT_EQ(xxh.exit_code, 0);
  EXPECT_EQ(lines_of(xxh.out)[0].find("  "), 16u);
}

TEST(Cli, DigestResidentMemoryStaysUnderTheLimit) {
  // Sanitizer runtimes keep shadow memory and quarantines of their own.
  if (testing::sanitized_build()) GTEST_SKIP() << "resident memory is not meaningful under a sanitizer";
  TempDir directory;
  auto model = (directory.path() / "big").string();
  auto synth = run_cli({"synth", model, "--arch", "llama", "--size", "256MiB", "--shards", "4", "--hidden", "1024"});
  ASSERT_EQ(synth.exit_code, 0) << synth.err;
  auto result = run_cli({"digest", model, "--hash", "xxh64", "--memory-limit", "64MiB"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  // The checkpoint is four times the limit; digest keeps no tensor, so the process stays
  // under the limit plus 64 MiB for the program itself.
  EXPECT_LT(result.max_rss_kib, (64 + 64) * 1024) << "peak RSS " << result.max_rss_kib << " KiB";
}

TEST(Cli, MissingCheckpoint) {
  TempDir directory;
  expect_one_line_error(run_cli({"load", (directory.path() / "absent").string()}), "does not exist");
}

TEST(Cli, BadSizeArgument) {
  TempDir directory;
  expect_one_line_error(run_cli({"load", directory.path().string(), "--memory-limit", "12XB"}), "--memory-limit='12XB'");
}

TEST(Cli, CorruptHeaderNamesFileAndRule) {
  TempDir directory;
  auto path = directory.path() / "bad.safetensors";
  std::string bytes(8, '\0');
  bytes[0] = 20;
  bytes += "{\"a\": {\"dtype\": 1}}";
  testing::write_file(path, bytes);
  auto result = run_cli({"inspect", path.string()});
  expect_one_line_error(result, "bad.safetensors");
}

TEST(Cli, UnknownEnvironmentVariableIsAnError) {
  TempDir directory;
  testing::ScopedEnv env("WEIGHTSTREAM_CONCURENCY", "4");
  expect_one_line_error(run_cli({"inspect", directory.path().string()}), "unknown environment variable WEIGHTSTREAM_CONCURENCY");
}

}  // namespace
}  // namespace weightstream
