// What a new user and a fault probe hit through the `weightstream` command (issue 33): exit
// codes (3 for an audit that is not clean, 2 for every malformed, out-of-range or
// conflicting flag), flags that act or are refused by name, short errors with advice that
// applies, our own writers never changing a file under a process that maps it, and the
// summaries of `load` and `send`.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <sstream>
#include <thread>

#include "support/test_support.hpp"
#include "weightstream/format.hpp"
#include "weightstream/load.hpp"
#include "weightstream/model.hpp"
#include "weightstream/synth.hpp"
#include "weightstream/options.hpp"
#include "weightstream/transfer.hpp"

namespace weightstream {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;
using testing::lines_of;
using testing::run_cli;
using testing::TempDir;

/// Exit 2, one line on stderr naming `needle`, ending with the pointer to --help.
void expect_usage_error(const testing::CommandResult& result, const std::string& needle) {
  EXPECT_EQ(result.exit_code, 2) << result.err;
  auto lines = lines_of(result.err);
  ASSERT_EQ(lines.size(), 1u) << result.err;
  EXPECT_THAT(lines[0], StartsWith("weightstream: error: "));
  EXPECT_THAT(lines[0], HasSubstr(needle));
  EXPECT_THAT(lines[0], HasSubstr("(see weightstream --help)"));
}

std::string synth(const TempDir& directory, const std::string& name, int64_t layers, int64_t hidden, uint64_t seed,
                  int64_t shards = 2) {
  SynthOptions options;
  options.layers = layers;
  options.hidden = hidden;
  options.seed = seed;
  options.shards = shards;
  synthesize_checkpoint(directory / name, options);
  return (directory / name).string();
}

std::vector<std::string> safetensors_files(const std::filesystem::path& directory) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(directory)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// ---- item 1: audit's "not clean" is exit 3, with its report and no error line -----------

TEST(AuditExitCode, NotCleanExitsThreeWithoutAnErrorLine) {
  TempDir directory;
  std::string two_layers = synth(directory, "a", 2, 256, 1);
  std::string one_layer = synth(directory, "b", 1, 256, 2);
  // The reload from a one-layer checkpoint leaves layer 1 as the cold load wrote it.
  auto text = run_cli({"audit", two_layers, "--reload", one_layer, "--no-progress"});
  EXPECT_EQ(text.exit_code, 3) << text.err;
  EXPECT_THAT(text.out, HasSubstr("NOT CLEAN"));
  EXPECT_EQ(text.err, "");
  auto json = run_cli({"audit", two_layers, "--reload", one_layer, "--json", "--no-progress"});
  EXPECT_EQ(json.exit_code, 3) << json.err;
  EXPECT_EQ(json.err, "");
  auto report = nlohmann::json::parse(json.out);
  EXPECT_EQ(report["clean"], false);
  EXPECT_GT(report["mismatched"].get<uint64_t>(), 0u);
}

// ---- item 10: an error of many misfits names two and a count ------------------------------

TEST(AuditExitCode, MisfitsAreTwoAndACountOnOneShortLine) {
  TempDir directory;
  std::string narrow = synth(directory, "a", 2, 256, 1);
  std::string wide = synth(directory, "b", 2, 512, 2);
  auto result = run_cli({"audit", narrow, "--reload", wide, "--no-progress"});
  EXPECT_EQ(result.exit_code, 1);
  auto lines = lines_of(result.err);
  ASSERT_EQ(lines.size(), 1u) << result.err;
  EXPECT_LT(lines[0].size(), 800u) << lines[0];
  EXPECT_THAT(lines[0], AllOf(HasSubstr("21 tensors of " + wide + " do not fit llama tp 1 rank 0: "),
                              HasSubstr("model.embed_tokens.weight has shape [4096, 512]"), HasSubstr("and 19 more")));
}

// ---- item 2: audit --via refuses what its sender would, before starting it -----------------

TEST(AuditVia, ABucketTooSmallIsRefusedBeforeASenderStarts) {
  TempDir directory;
  std::string checkpoint = synth(directory, "a", 1, 64, 1);
  for (const char* via : {"shm", "tcp"}) {
    auto started = std::chrono::steady_clock::now();
    auto result = run_cli({"audit", checkpoint, "--via", via, "--bucket-size", "1KiB", "--no-progress"});
    expect_usage_error(result, "--bucket-size 1KiB (1024 bytes) is too small: at least 4KiB");
    // Refused before any process or wait: far from the receiver's 5-minute accept timeout.
    EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(60)) << via;
  }
  expect_usage_error(run_cli({"audit", checkpoint, "--bucket-size", "0", "--no-progress"}),
                     "--bucket-size requires --via");
}

// ---- issue 45: no listener starts without a token unless asked to ---------------------------
TEST(ListenerToken, ServeAndAwaitSenderRefuseToStartWithoutAToken) {
  TempDir directory;
  std::string checkpoint = synth(directory, "a", 1, 64, 1);
  testing::ScopedEnv no_token("WEIGHTSTREAM_PEER_TOKEN", std::nullopt);
  // No token anywhere: refused before the load, naming what to give.
  auto serve = run_cli({"serve", checkpoint, "--listen", "127.0.0.1:0", "--no-progress"});
  EXPECT_NE(serve.exit_code, 0);
  EXPECT_THAT(serve.err, HasSubstr("serve --listen 127.0.0.1:0 refuses to start without a token"));
  EXPECT_THAT(serve.err, HasSubstr("--open-without-token"));
  EXPECT_EQ(serve.out, "");  // never served
  // --token-stdin with stdin at its end (run_cli's stdin is /dev/null).
  for (const std::vector<std::string>& arguments :
       {std::vector<std::string>{"serve", checkpoint, "--token-stdin", "--no-progress"},
        std::vector<std::string>{"audit", checkpoint, "--via", "tcp", "--await-sender", "--token-stdin", "--no-progress"},
        std::vector<std::string>{"send", checkpoint, "--to", "127.0.0.1:9", "--token-stdin", "--no-progress"},
        std::vector<std::string>{"export", "peer://127.0.0.1:9", (directory / "out.safetensors").string(),
                                 "--token-stdin", "--no-progress"}}) {
    auto result = run_cli(arguments);
    EXPECT_NE(result.exit_code, 0) << arguments[0];
    EXPECT_THAT(result.err, HasSubstr("the token read from stdin is empty")) << arguments[0];
  }
  auto await = run_cli({"audit", checkpoint, "--via", "tcp", "--await-sender", "--no-progress"});
  EXPECT_NE(await.exit_code, 0);
  EXPECT_THAT(await.err, HasSubstr("--await-sender needs --token-stdin (the token the sender must prove), or "
                                   "--open-without-token to accept any sender"));
  auto both = run_cli({"serve", checkpoint, "--token-stdin", "--open-without-token", "--no-progress"});
  EXPECT_NE(both.exit_code, 0);
  EXPECT_THAT(both.err, HasSubstr("--token-stdin excludes --open-without-token"));
}

// ---- item 6: malformed and out-of-range flag values are usage errors ------------------------

TEST(UsageExitCode, MalformedAndOutOfRangeValuesExitTwo) {
  TempDir directory;
  std::string checkpoint = synth(directory, "a", 1, 64, 1);
  struct Case {
    std::vector<std::string> arguments;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {{"load", checkpoint, "--memory-limit", "lots"}, "--memory-limit='lots'"},
      {{"load", checkpoint, "--memory-limit", "0"}, "--memory-limit 0 bytes is too small: at least 4KiB"},
      {{"load", checkpoint, "--io", "bogus"}, "--io='bogus': expected auto, pread, direct, uring or mmap"},
      {{"load", checkpoint, "--mapped-share", "2"}, "--mapped-share='2': expected a fraction from 0 to 1"},
      {{"load", checkpoint, "--device", "gpu"}, "gpu"},
      {{"load", checkpoint, "--tp-rank", "2", "--tp-size", "2"}, "--tp-rank 2 must be below --tp-size 2"},
      {{"plan", checkpoint, "--tp-rank", "3", "--tp-size", "2"}, "--tp-rank 3 must be below --tp-size 2"},
      {{"s3", "presign", "s3://bucket/key", "--expires", "8d"}, "--expires='8d'"},
      {{"s3", "presign", "s3://bucket/key", "--expires", "604801"}, "expected whole seconds from 1 s to 7 days"},
      {{"resolve"}, "resolve: nothing to resolve: give --model or --model-weights, or set WEIGHTSTREAM_MODEL_URI"},
      {{"synth", (directory / "tiny").string(), "--size", "1KiB"}, "synth: size 1.00 KiB is below the smallest"},
  };
  testing::ScopedEnv no_uri("WEIGHTSTREAM_MODEL_URI", std::nullopt);
  testing::ScopedEnv no_alias("MX_MODEL_URI", std::nullopt);
  testing::ScopedEnv key("AWS_ACCESS_KEY_ID", "AKIAIOSFODNN7EXAMPLE");
  testing::ScopedEnv secret("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY");
  for (const Case& c : cases) {
    SCOPED_TRACE(c.arguments[0] + " " + c.needle);
    expect_usage_error(run_cli(c.arguments), c.needle);
  }
  // The work failing is still 1: a checkpoint that is not there, a variable that is malformed.
  EXPECT_EQ(run_cli({"load", (directory / "absent").string()}).exit_code, 1);
  testing::ScopedEnv bad("WEIGHTSTREAM_CONCURRENCY", "abc");
  auto variable = run_cli({"load", checkpoint, "--concurrency", "4"});
  EXPECT_EQ(variable.exit_code, 1);
  EXPECT_THAT(variable.err, HasSubstr("WEIGHTSTREAM_CONCURRENCY='abc'"));
}

// ---- item 7: flags that do not combine are refused by name; the others act ------------------

TEST(FlagConflicts, AreRefusedNamingBothFlags) {
  TempDir directory;
  std::string checkpoint = synth(directory, "a", 1, 64, 1);
  expect_usage_error(run_cli({"load", checkpoint, "--raw", "--quantize", "fp8"}), "--raw");
  EXPECT_THAT(run_cli({"load", checkpoint, "--raw", "--quantize", "fp8"}).err, HasSubstr("--quantize"));
  expect_usage_error(run_cli({"load", checkpoint, "--raw", "--tp-size", "2"}), "--tp-size");
  expect_usage_error(run_cli({"load", checkpoint, "--raw", "--speculative", "mtp"}), "--speculative");
  expect_usage_error(run_cli({"load", checkpoint, "--progress", "--no-progress"}), "--progress excludes --no-progress");
  auto sized = run_cli({"synth", (directory / "b").string(), "--size", "2GiB", "--layers", "3"});
  expect_usage_error(sized, "--size");
  EXPECT_THAT(sized.err, HasSubstr("--layers"));
  EXPECT_FALSE(std::filesystem::exists(directory / "b"));
}

TEST(FlagConflicts, QuantizeAloneLoadsThroughTheQuantizedLayout) {
  TempDir directory;
  std::string checkpoint = synth(directory, "a", 1, 64, 1);
  auto plain = run_cli({"load", checkpoint, "--json", "--no-progress"});
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  auto quantized = run_cli({"load", checkpoint, "--quantize", "fp8", "--json", "--no-progress"});
  ASSERT_EQ(quantized.exit_code, 0) << quantized.err;
  auto json = nlohmann::json::parse(quantized.out);
  EXPECT_THAT(json["layout"].get<std::string>(), HasSubstr("llama"));
  EXPECT_EQ(json["session"]["model_hook_runs"], 1);
  // The readers' time, as a plain load --json reports it.
  for (const char* field : {"read_seconds", "deliver_seconds", "staging_wait_seconds", "reads"}) {
    EXPECT_TRUE(json.contains(field)) << field;
  }
  // FP8 linear weights: a byte an element where the checkpoint has two.
  EXPECT_LT(json["parameter_bytes"].get<uint64_t>(), nlohmann::json::parse(plain.out)["bytes"].get<uint64_t>());
}

TEST(FlagConflicts, AChunkSizeAboveTheTensorsStagesOnlyWhatIsRead) {
  TempDir directory;
  std::string checkpoint = synth(directory, "a", 2, 256, 1);
  uint64_t bytes = Checkpoint::open(checkpoint, Options{}).tensor_bytes();
  auto result = run_cli({"digest", checkpoint, "--chunk-size", "1TB", "--summary", "--io", "pread"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  auto summary = nlohmann::json::parse(lines_of(result.err).back());
  // Staging buffers sized by the largest read (here a shard: two reads of about half the
  // bytes each), not by the 1 TB chunk cut to a quarter of the limit (2 x 256 MiB before).
  EXPECT_LE(summary["peak_staging_bytes"].get<uint64_t>(), 2 * bytes) << result.err;
  EXPECT_GT(summary["peak_staging_bytes"].get<uint64_t>(), 0u);
}

// ---- item 11: empty tensors are counted ---------------------------------------------------

TEST(LoadSummary, CountsEmptyTensors) {
  TempDir directory;
  SafetensorsWriter writer;
  for (int i = 0; i < 8; ++i) writer.add("t" + std::to_string(i), Dtype::kF32, {4}, std::vector<std::byte>(16, std::byte(i)));
  writer.add("empty", Dtype::kF32, {0, 4}, {});
  auto path = directory / "e.safetensors";
  writer.write(path);
  for (const char* io : {"auto", "pread"}) {
    auto text = run_cli({"load", path.string(), "--io", io, "--no-progress"});
    ASSERT_EQ(text.exit_code, 0) << text.err;
    EXPECT_THAT(text.out, StartsWith("loaded 9 tensors")) << io;
    auto json = run_cli({"load", path.string(), "--io", io, "--json", "--no-progress"});
    EXPECT_EQ(nlohmann::json::parse(json.out)["tensors"], 9) << io;
  }
  EXPECT_THAT(run_cli({"inspect", path.string()}).out, HasSubstr("9 tensors, 128 B (128 bytes) in 1 shard\n"));
}

// ---- item 12: advice that applies -----------------------------------------------------------

TEST(Advice, AFolderWithoutConfigGetsNoAdviceToUseRawWhereRawIsRefused) {
  TempDir directory;
  std::string checkpoint = synth(directory, "a", 1, 64, 1);
  std::filesystem::remove(std::filesystem::path(checkpoint) / "config.json");
  for (std::vector<std::string> arguments : {std::vector<std::string>{"plan", checkpoint},
                                             std::vector<std::string>{"audit", checkpoint, "--no-progress"},
                                             std::vector<std::string>{"export", checkpoint,
                                                                      (directory / "o.safetensors").string()}}) {
    auto result = run_cli(arguments);
    EXPECT_EQ(result.exit_code, 1) << arguments[0];
    EXPECT_THAT(result.err, HasSubstr("has no config.json beside its shards: it is needed to build the model layout"));
    EXPECT_THAT(result.err, Not(HasSubstr("--raw"))) << arguments[0];
  }
  auto load = run_cli({"load", checkpoint, "--tp-size", "2", "--no-progress"});
  EXPECT_EQ(load.exit_code, 1);
  EXPECT_THAT(load.err, AllOf(HasSubstr("--tp-size, --tp-rank, --ep-size, --ep-rank and --quantize need it"),
                              HasSubstr("without them, load reads every tensor as it is")));
}

// ---- item 14: English and columns ---------------------------------------------------------

TEST(Summaries, SayOneOfAThingInTheSingular) {
  TempDir directory;
  auto synth_one = run_cli({"synth", (directory / "a").string(), "--layers", "1", "--hidden", "64", "--shards", "1"});
  ASSERT_EQ(synth_one.exit_code, 0) << synth_one.err;
  EXPECT_THAT(synth_one.out, AllOf(HasSubstr(", 1 layer, "), Not(HasSubstr("1 layers")), Not(HasSubstr("(s)"))));
  EXPECT_THAT(run_cli({"inspect", (directory / "a").string()}).out, HasSubstr(" in 1 shard\n"));
  auto load = run_cli({"load", (directory / "a").string(), "--tp-size", "1", "--no-progress"});
  ASSERT_EQ(load.exit_code, 0) << load.err;
  EXPECT_THAT(load.out, AllOf(HasSubstr("; 1 model hook run\n"), Not(HasSubstr("1 model hook runs"))));
}

TEST(Summaries, InspectAlignsColumnsOfWideCharacters) {
  TempDir directory;
  SafetensorsWriter writer;
  writer.add("a", Dtype::kU8, {1}, std::vector<std::byte>(1));
  writer.add("層.重み", Dtype::kU8, {2}, std::vector<std::byte>(2));  // 4 characters, 3 of them 2 columns wide
  writer.add("layer.weight", Dtype::kU8, {3}, std::vector<std::byte>(3));
  auto path = directory / "w.safetensors";
  writer.write(path);
  auto result = run_cli({"inspect", path.string()});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  // Every row's dtype column starts at the same display column: 12 (the widest name) + 2.
  for (const std::string& line : lines_of(result.out)) {
    if (line.empty() || line.find("U8") == std::string::npos) continue;
    std::string before = line.substr(0, line.find("U8"));
    size_t columns = 0;
    for (unsigned char c : before) columns += (c & 0xC0) != 0x80;  // code points...
    if (before.find("層") != std::string::npos) columns += 3;          // ...plus the wide ones' second column
    EXPECT_EQ(columns, 14u) << line;
  }
}

// ---- item 3: our writers put a file in place whole; a process mapping the old one keeps it --

/// The bytes of every tensor of a load, copied out.
std::vector<std::string> tensor_bytes(const LoadedCheckpoint& loaded) {
  std::vector<std::string> bytes;
  for (const LoadedTensor& tensor : loaded.tensors) {
    bytes.emplace_back(reinterpret_cast<const char*>(tensor.data), tensor.bytes);
  }
  return bytes;
}

TEST(Writers, ExportOverAFileLoadedInPlaceLeavesItsTensorsAsTheyWere) {
  TempDir directory;
  std::string checkpoint = synth(directory, "a", 1, 64, 1);
  std::string other = synth(directory, "b", 1, 64, 2);
  auto target = directory / "s.safetensors";
  ASSERT_EQ(run_cli({"export", checkpoint, target.string(), "--no-progress"}).exit_code, 0);
  Checkpoint opened = Checkpoint::open(target.string(), Options{});
  LoadedCheckpoint loaded = load_checkpoint(opened, Device{}, StreamOptions{});
  ASSERT_GT(std::count_if(loaded.tensors.begin(), loaded.tensors.end(), [](const auto& t) { return t.in_place; }), 0);
  std::vector<std::string> before = tensor_bytes(loaded);
  // Same layout, other values: same size, so an in-place write would change the tensors
  // silently; a smaller file (--tp-size 2) would end this process with SIGBUS.
  for (std::vector<std::string> arguments :
       {std::vector<std::string>{"export", other, target.string(), "--no-progress"},
        std::vector<std::string>{"export", other, target.string(), "--tp-size", "2", "--no-progress"}}) {
    auto result = run_cli(arguments);
    ASSERT_EQ(result.exit_code, 0) << result.err;
    EXPECT_EQ(tensor_bytes(loaded), before);
  }
  EXPECT_EQ(safetensors_files(directory.path()), (std::vector<std::string>{"a", "b", "s.safetensors"}));
  auto written = nlohmann::json::parse(run_cli({"inspect", target.string(), "--json"}).out);
  EXPECT_EQ(written["metadata"]["tp_size"], "2");
}

TEST(Writers, SynthRefusesAFolderWithACheckpointUnlessForced) {
  TempDir directory;
  auto folder = directory / "ck";
  ASSERT_EQ(run_cli({"synth", folder.string(), "--layers", "2", "--hidden", "64", "--shards", "3"}).exit_code, 0);
  Checkpoint opened = Checkpoint::open(folder.string(), Options{});
  LoadedCheckpoint loaded = load_checkpoint(opened, Device{}, StreamOptions{});
  std::vector<std::string> before = tensor_bytes(loaded);

  auto refused = run_cli({"synth", folder.string(), "--layers", "2", "--hidden", "64", "--shards", "2", "--seed", "9"});
  expect_usage_error(refused, "synth: " + folder.string() + " holds a checkpoint already (config.json, "
                              "model.safetensors.index.json and 3 .safetensors files)");
  EXPECT_THAT(refused.err, HasSubstr("synth --force"));
  EXPECT_EQ(safetensors_files(folder).size(), 5u);

  auto forced = run_cli({"synth", folder.string(), "--layers", "2", "--hidden", "64", "--shards", "2", "--seed", "9",
                         "--force"});
  ASSERT_EQ(forced.exit_code, 0) << forced.err;
  // The old shards are gone, not left beside the new ones; no temporary file stays.
  EXPECT_EQ(safetensors_files(folder),
            (std::vector<std::string>{"config.json", "model-00001-of-00002.safetensors",
                                      "model-00002-of-00002.safetensors", "model.safetensors.index.json"}));
  auto load = run_cli({"load", folder.string(), "--json", "--no-progress"});
  ASSERT_EQ(load.exit_code, 0) << load.err;
  EXPECT_EQ(nlohmann::json::parse(load.out)["shards"], 2);
  // This process's in-place tensors of the old shards kept their bytes.
  EXPECT_EQ(tensor_bytes(loaded), before);
}

// ---- item 9: send says what it sent; audit --progress shows progress ------------------------

TEST(SendSummary, PrintsWhatWasSentAndTheJsonReport) {
  TempDir directory;
  std::string checkpoint = synth(directory, "a", 1, 64, 1);
  Checkpoint opened = Checkpoint::open(checkpoint, Options{});
  ModelLayout layout = identity_layout(opened);
  layout.allocate(Device{});
  load_layout(layout, opened, LoadMode::kCold, StreamOptions{});
  const uint64_t tensors = opened.tensors().size();
  for (bool json : {false, true}) {
    // No token: run_cli's stdin is /dev/null, so the loopback receiver is open, asked for.
    ReceiverOptions open;
    open.open_without_token = true;
    UpdateReceiver receiver(layout, open);
    std::exception_ptr failure;
    std::thread receiving([&] {
      try {
        receiver.receive(std::chrono::minutes(2));
      } catch (...) {
        failure = std::current_exception();
      }
    });
    std::vector<std::string> arguments = {"send",          checkpoint, "--to",          receiver.address(),
                                          "--via",         "tcp",      "--bucket-size", "64KiB",
                                          "--no-progress"};
    if (json) arguments.push_back("--json");
    auto result = run_cli(arguments);
    if (result.exit_code != 0) receiver.cancel();  // the receiver would wait for a sender that is gone
    receiving.join();
    ASSERT_EQ(result.exit_code, 0) << result.err;
    ASSERT_FALSE(failure);
    if (json) {
      auto report = nlohmann::json::parse(result.out);
      EXPECT_EQ(report["tensors"], tensors);
      EXPECT_GE(report["bytes"].get<uint64_t>(), opened.tensor_bytes());  // bucket bytes, with their alignment
      EXPECT_EQ(report["via"], "tcp");
      EXPECT_EQ(report["model_hook_runs"], 0);
      EXPECT_GT(report["buckets"].get<uint64_t>(), 1u);
    } else {
      EXPECT_THAT(result.out, AllOf(StartsWith("sent " + std::to_string(tensors) + " tensors, "),
                                    HasSubstr(" buckets to " + receiver.address() + " via tcp; applied in ")));
    }
  }
}

TEST(SendSummary, RepeatSendsEachUpdateOverOneConnectionAndListsThem) {
  TempDir directory;
  std::string checkpoint = synth(directory, "a", 1, 64, 1);
  Checkpoint opened = Checkpoint::open(checkpoint, Options{});
  ModelLayout layout = identity_layout(opened);
  layout.allocate(Device{});
  load_layout(layout, opened, LoadMode::kCold, StreamOptions{});
  ReceiverOptions open;  // the sender below runs without --token-stdin
  open.open_without_token = true;
  UpdateReceiver receiver(layout, open);
  std::vector<UpdateReport> reports;
  std::exception_ptr failure;
  std::thread receiving([&] {
    try {
      for (int update = 0; update < 3; ++update) reports.push_back(receiver.receive(std::chrono::minutes(2)));
    } catch (...) {
      failure = std::current_exception();
    }
  });
  auto result = run_cli({"send", checkpoint, "--to", receiver.address(), "--via", "tcp", "--bucket-size", "64KiB",
                         "--repeat", "3", "--no-progress", "--json"});
  if (result.exit_code != 0) receiver.cancel();
  receiving.join();
  ASSERT_EQ(result.exit_code, 0) << result.err;
  ASSERT_FALSE(failure);
  ASSERT_EQ(reports.size(), 3u);
  for (const UpdateReport& report : reports) EXPECT_EQ(report.tensors, opened.tensors().size());
  auto report = nlohmann::json::parse(result.out);
  ASSERT_EQ(report["updates"].size(), 3u);
  for (const auto& update : report["updates"]) EXPECT_GT(update["seconds"].get<double>(), 0.0);
  EXPECT_EQ(report["tensors"], opened.tensors().size());
}

TEST(SendSummary, RepeatBelowOneIsRefused) {
  auto result = run_cli({"send", "/nonexistent", "--to", "127.0.0.1:1", "--repeat", "0"});
  EXPECT_NE(result.exit_code, 0);
  EXPECT_THAT(result.err, HasSubstr("--repeat"));
}

TEST(AuditProgress, ForcedIntoAPipeItEndsWithOneDoneLine) {
  TempDir directory;
  std::string checkpoint = synth(directory, "a", 1, 64, 1);
  auto result = run_cli({"audit", checkpoint, "--progress"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  auto lines = lines_of(result.err);
  ASSERT_FALSE(lines.empty());
  EXPECT_THAT(lines.back(), AllOf(HasSubstr(" / "), HasSubstr("GB/s"), HasSubstr("done in")));
  EXPECT_EQ(result.err.find('\r'), std::string::npos);
  EXPECT_THAT(result.out, HasSubstr(": clean"));
  EXPECT_EQ(run_cli({"audit", checkpoint}).err, "");  // a pipe without --progress: nothing
}

}  // namespace
}  // namespace weightstream
