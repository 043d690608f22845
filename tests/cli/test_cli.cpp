// The `weightstream` command as a user runs it: synth, inspect, load, digest, and the
// one-line errors for bad input.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <sstream>

#include "support/test_support.hpp"

namespace weightstream {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;
using testing::lines_of;
using testing::run_cli;
using testing::TempDir;

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
    for (auto field : {"tensors", "bytes", "seconds", "gbps", "peak_staging_bytes", "read_seconds", "deliver_seconds",
                       "staging_wait_seconds"}) {
      EXPECT_TRUE(json.contains(field)) << field;
    }
    EXPECT_GT(json["read_seconds"].get<double>(), 0.0);
    EXPECT_LE(json["staging_wait_seconds"].get<double>(), 4 * json["seconds"].get<double>() + 1e-3);
    auto inspect = nlohmann::json::parse(run_cli({"inspect", model(), "--json"}).out);
    EXPECT_EQ(json["tensors"], inspect["tensor_count"]);
    EXPECT_EQ(json["bytes"], inspect["bytes"]);
    EXPECT_LE(json["peak_staging_bytes"].get<uint64_t>(), 1024u * 1024u);
  }
}

TEST_F(CliCheckpoint, AHostLoadTakesTensorsInPlaceByDefaultAndSaysSo) {
  auto inspect = nlohmann::json::parse(run_cli({"inspect", model(), "--json"}).out);
  auto count = inspect["tensor_count"].get<uint64_t>();
  auto by_default = run_cli({"load", model(), "--no-progress"});
  ASSERT_EQ(by_default.exit_code, 0) << by_default.err;
  EXPECT_THAT(by_default.out, HasSubstr(std::to_string(count) + " of them in place: copy-on-write views of the page cache"));
  auto copied = run_cli({"load", model(), "--no-progress", "--io", "pread"});
  ASSERT_EQ(copied.exit_code, 0) << copied.err;
  EXPECT_THAT(copied.out, Not(HasSubstr("in place")));
  auto json = nlohmann::json::parse(run_cli({"load", model(), "--json"}).out);
  EXPECT_EQ(json["tensors_in_place"].get<uint64_t>(), count);
  json = nlohmann::json::parse(run_cli({"load", model(), "--json", "--io", "pread"}).out);
  EXPECT_EQ(json["tensors_in_place"].get<uint64_t>(), 0u);
}

TEST_F(CliCheckpoint, DigestIsOneJsonLinePerTensorAndStable) {
  auto first = run_cli({"digest", model(), "--json"});
  ASSERT_EQ(first.exit_code, 0) << first.err;
  auto lines = lines_of(first.out);
  auto inspect = nlohmann::json::parse(run_cli({"inspect", model(), "--json"}).out);
  // One object per tensor, then the content digest.
  ASSERT_EQ(lines.size(), inspect["tensor_count"].get<size_t>() + 1);
  for (size_t i = 0; i + 1 < lines.size(); ++i) {
    auto json = nlohmann::json::parse(lines[i]);
    EXPECT_EQ(json["sha256"].get<std::string>().size(), 64u);
    EXPECT_TRUE(json.contains("name"));
  }
  EXPECT_EQ(nlohmann::json::parse(lines.back())["content_digest"].get<std::string>().size(), 16u);
  auto second = run_cli({"digest", model(), "--json", "--memory-limit", "64KiB", "--concurrency", "3"});
  EXPECT_EQ(first.out, second.out);
  auto xxh = run_cli({"digest", model(), "--hash", "xxh64"});
  ASSERT_EQ(xxh.exit_code, 0);
  EXPECT_EQ(lines_of(xxh.out)[0].find("  "), 16u);
}

// Issue 45: the content digest `serve` publishes and --expect-digest takes, printed by
// digest (either hash, text and JSON) and inspect --content alike; one byte changes it.
TEST_F(CliCheckpoint, DigestAndInspectPrintOneContentDigest) {
  auto xxh = run_cli({"digest", model(), "--hash", "xxh64"});
  ASSERT_EQ(xxh.exit_code, 0) << xxh.err;
  const std::string last = lines_of(xxh.out).back();
  const std::string prefix = "content digest ";
  ASSERT_THAT(last, StartsWith(prefix));
  EXPECT_THAT(last, HasSubstr("(xxh64 over every tensor's name, dtype, shape and xxh64, in name order)"));
  const std::string root = last.substr(prefix.size(), 16);
  EXPECT_EQ(root.find_first_not_of("0123456789abcdef"), std::string::npos) << last;

  auto sha = run_cli({"digest", model(), "--hash", "sha256"});
  ASSERT_EQ(sha.exit_code, 0) << sha.err;
  EXPECT_EQ(lines_of(sha.out).back(), last);
  auto json = run_cli({"digest", model(), "--hash", "xxh64", "--json"});
  EXPECT_EQ(nlohmann::json::parse(lines_of(json.out).back())["content_digest"], root);

  auto inspect = run_cli({"inspect", model(), "--content"});
  ASSERT_EQ(inspect.exit_code, 0) << inspect.err;
  EXPECT_EQ(lines_of(inspect.out).back(), last);
  EXPECT_EQ(nlohmann::json::parse(run_cli({"inspect", model(), "--json", "--content"}).out)["content_digest"], root);
  EXPECT_FALSE(nlohmann::json::parse(run_cli({"inspect", model(), "--json"}).out).contains("content_digest"));
  EXPECT_THAT(run_cli({"inspect", "--help"}).out, HasSubstr("reads every byte of the checkpoint once"));

  // Another seed of the same config: the same names, dtypes and shapes, other bytes.
  TempDir other;
  ASSERT_EQ(run_cli({"synth", (other.path() / "llama").string(), "--arch", "llama", "--layers", "3", "--shards", "2",
                     "--seed", "6"})
                .exit_code,
            0);
  EXPECT_NE(lines_of(run_cli({"digest", (other.path() / "llama").string(), "--hash", "xxh64"}).out).back(), last);
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
  // under the limit plus 64 MiB for the program itself. (pread: the only file pages mapped
  // are the program's own.)
  EXPECT_LT(result.max_rss_kib, (64 + 64) * 1024) << "peak RSS " << result.max_rss_kib << " KiB";
  // Reads through a mapping drop each read's pages once copied (by the readers, or by
  // prefetchers where they run): the mapped pages held stay near the reads in flight, not the
  // 256 MiB checkpoint. Peak RSS counts those mapped pages of the page cache too, which lie
  // beside the limit (it bounds the staging and the prefetchers' lookahead): up to a chunk
  // for each read being copied and each one a prefetcher has yet to drop. At the defaults
  // (16 readers of 16 MiB) that part alone ranges over tens of MiB with the scheduling, and
  // once took the peak past this bound under a parallel ctest (132916 KiB). Four readers of
  // 1 MiB reads keep it to a few MiB, whatever the machine's load, while a process that kept
  // the checkpoint's pages would still hold 256 MiB of them.
  for (const char* prefetchers : {"0", "2"}) {
    auto mapped = run_cli({"digest", model, "--hash", "xxh64", "--memory-limit", "64MiB", "--io", "mmap",
                           "--chunk-size", "1MiB", "--concurrency", "4", "--prefetchers", prefetchers});
    ASSERT_EQ(mapped.exit_code, 0) << mapped.err;
    EXPECT_EQ(mapped.out, result.out);
    EXPECT_LT(mapped.max_rss_kib, (64 + 64) * 1024)
        << "peak RSS " << mapped.max_rss_kib << " KiB with --io mmap and " << prefetchers << " prefetchers";
  }
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

// ---- usage errors, help and the progress line --------------------------------------------

TEST(Cli, ParseErrorsAreOneLineWithTheUsageExitCode) {
  TempDir directory;
  for (std::vector<std::string> arguments :
       {std::vector<std::string>{"load", directory.path().string(), "--concurrency", "abc"},
        std::vector<std::string>{"load", directory.path().string(), "--no-such-flag"},
        std::vector<std::string>{"inspect"}, std::vector<std::string>{}}) {
    auto result = run_cli(arguments);
    EXPECT_EQ(result.exit_code, 2) << result.err;
    expect_one_line_error(result, "(see weightstream --help)");
  }
  EXPECT_THAT(run_cli({"load", directory.path().string(), "--concurrency", "abc"}).err, HasSubstr("--concurrency"));
  // A failure of the work itself keeps exit code 1.
  EXPECT_EQ(run_cli({"load", (directory.path() / "absent").string()}).exit_code, 1);
}

TEST(Cli, AnUnknownCommandIsNamedWithTheListOfCommands) {
  auto result = run_cli({"bogus", "x"});
  EXPECT_EQ(result.exit_code, 2);
  expect_one_line_error(result, "unknown command 'bogus' (commands: inspect, load, digest, synth, plan, export, audit");
  EXPECT_THAT(result.err, AllOf(HasSubstr("send"), HasSubstr("s3"), HasSubstr("resolve")));
}

TEST(Cli, HelpDescribesEveryCommandAndNamesTheVariables) {
  auto help = run_cli({"--help"});
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_THAT(help.out, HasSubstr("Push every tensor of a checkpoint to a running update receiver"));
  auto load = run_cli({"load", "--help"});
  EXPECT_EQ(load.exit_code, 0);
  EXPECT_THAT(load.out, AllOf(HasSubstr("WEIGHTSTREAM_LOCAL_IO"), HasSubstr("WEIGHTSTREAM_PROGRESS"),
                              HasSubstr("WEIGHTSTREAM_GPU_PATH"), HasSubstr("WEIGHTSTREAM_CONCURRENCY")));
  // --io takes one parser's words, and says so in one message.
  expect_one_line_error(run_cli({"load", "x", "--io", "splice"}), "--io='splice': expected auto, pread, direct, uring or mmap");
  EXPECT_THAT(load.out, HasSubstr("WEIGHTSTREAM_MAPPED_SHARE"));
  EXPECT_THAT(load.out, HasSubstr("WEIGHTSTREAM_PREFETCHERS"));
  expect_one_line_error(run_cli({"load", "x", "--gpu-path", "both", "--mapped-share", "2"}),
                        "--mapped-share='2': expected a fraction from 0 to 1, such as 0.4");
  expect_one_line_error(run_cli({"load", "x", "--gpu-path", "pinned"}),
                        "--gpu-path='pinned': expected auto, staged, mapped or both");
}

TEST(Cli, SynthHiddenHasOneRuleInHelpAndInItsError) {
  TempDir directory;
  auto help = run_cli({"synth", "--help"});
  EXPECT_THAT(help.out, HasSubstr("a multiple of 32 from 64 to 65536"));
  auto ok = run_cli({"synth", (directory.path() / "h96").string(), "--hidden", "96", "--layers", "1"});
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  for (std::string hidden : {"100", "32", "70000"}) {
    auto result = run_cli({"synth", (directory.path() / ("h" + hidden)).string(), "--hidden", hidden});
    expect_one_line_error(result, "synth: hidden " + hidden + " must be a multiple of 32 from 64 to 65536");
  }
}

TEST(Cli, SynthRefusesASizeBelowTheSmallestModel) {
  TempDir directory;
  auto out = directory.path() / "tiny";
  auto result = run_cli({"synth", out.string(), "--size", "1KiB"});
  expect_one_line_error(result, "synth: size 1.00 KiB is below the smallest llama checkpoint of hidden size 256: one layer is ");
  EXPECT_THAT(result.err, HasSubstr("ask for at least that, or a smaller hidden size"));
  EXPECT_FALSE(std::filesystem::exists(out));
  // The size it names is one that works.
  const std::string lead = "one layer is ";
  auto at = result.err.find(lead) + lead.size();
  std::string smallest = result.err.substr(at, result.err.find(" bytes", at) - at);
  auto retry = run_cli({"synth", out.string(), "--size", smallest, "--json"});
  ASSERT_EQ(retry.exit_code, 0) << retry.err;
  EXPECT_EQ(nlohmann::json::parse(retry.out)["layers"], 1);
}

TEST_F(CliCheckpoint, ProgressIntoAPipeIsPlainLinesWithoutCarriageReturns) {
  auto result = run_cli({"load", model(), "--progress"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_EQ(result.err.find('\r'), std::string::npos) << result.err;
  auto lines = lines_of(result.err);
  // A load this short: no frame every few seconds, only the line at the end.
  ASSERT_EQ(lines.size(), 1u) << result.err;
  EXPECT_THAT(lines[0], AllOf(HasSubstr(" / "), HasSubstr("GB/s"), HasSubstr("done in")));
  EXPECT_THAT(result.err, Not(HasSubstr("ETA 0.0")));
  // Without --progress, a pipe gets nothing.
  EXPECT_EQ(run_cli({"load", model()}).err, "");
}

TEST_F(CliCheckpoint, AnUnknownModelTypeNamesTheConfigItRead) {
  TempDir directory;
  auto copy = directory.path() / "gpt";
  std::filesystem::copy(model(), copy);
  std::string config = testing::read_file(copy / "config.json");
  auto at = config.find("\"llama\"");
  ASSERT_NE(at, std::string::npos);
  config.replace(at, 7, "\"gpt2\"");
  testing::write_file(copy / "config.json", config);
  auto result = run_cli({"load", copy.string(), "--tp-size", "1", "--tp-rank", "0"});
  expect_one_line_error(result, (copy / "config.json").string() + ": model_type 'gpt2' has no mapping table");
}

TEST(Cli, AnEndpointWithCredentialsInItIsNeverPrinted) {
  testing::ScopedEnv endpoint("AWS_ENDPOINT_URL", "http://alice:HUNTER2SECRET@127.0.0.1:9");
  testing::ScopedEnv key("AWS_ACCESS_KEY_ID", "AKIDTEST");
  testing::ScopedEnv secret("AWS_SECRET_ACCESS_KEY", "wsCliSecretDoNotPrint");
  auto result = run_cli({"inspect", "s3://bucket/model"});
  expect_one_line_error(result, "S3 endpoint 'http://<redacted>@127.0.0.1:9' has no usable host");
  EXPECT_THAT(result.out + result.err, AllOf(Not(HasSubstr("HUNTER2SECRET")), Not(HasSubstr("alice")),
                                             Not(HasSubstr("wsCliSecretDoNotPrint"))));
}

}  // namespace
}  // namespace weightstream
