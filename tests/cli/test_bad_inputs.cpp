// Hostile and malformed checkpoints through the `weightstream` command (issue 7): each must
// end with a non-zero exit, no signal, and exactly one line on stderr,
// `weightstream: error: …`, that names the file and the rule broken. Every command runs
// under a small address-space limit, so a parser that sized an allocation from a hostile
// field fails the test instead of the machine.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "support/test_support.hpp"
#include "weightstream/model.hpp"
#include "weightstream/synth.hpp"
#include "weightstream/format.hpp"
#include "weightstream/options.hpp"

namespace weightstream {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using testing::lines_of;
using testing::run_cli;
using testing::RunLimits;
using testing::TempDir;

/// The address-space limit of every command here. The CLI itself needs well under this;
/// a hostile file that made it allocate gigabytes gets std::bad_alloc instead. Sanitized
/// builds run without it (see sanitized_build()).
RunLimits bounded() {
  if (testing::sanitized_build()) return {};
  return {.address_space_bytes = 512 * kMiB};
}

/// A safetensors file: 8-byte little-endian `declared_length` (the JSON's length when
/// absent), the JSON header as given, then `data`.
std::string safetensors_file(const std::string& header_json, const std::string& data = {},
                             std::optional<uint64_t> declared_length = std::nullopt) {
  uint64_t length = declared_length.value_or(header_json.size());
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  return file + header_json + data;
}

/// One tensor entry of a header.
std::string tensor_entry(const std::string& name, const std::string& dtype, const std::string& shape, uint64_t begin,
                         uint64_t end) {
  return "\"" + name + "\": {\"dtype\": \"" + dtype + "\", \"shape\": " + shape + ", \"data_offsets\": [" +
         std::to_string(begin) + ", " + std::to_string(end) + "]}";
}

/// The contract of every case: failed cleanly (no signal, no internal error), one line,
/// naming `object` and `rule`.
void expect_rejected(const testing::CommandResult& result, const std::string& object, const std::string& rule) {
  EXPECT_NE(result.exit_code, 0) << result.out;
  EXPECT_LT(result.exit_code, 128) << "killed by signal " << result.exit_code - 128 << ": " << result.err;
  auto lines = lines_of(result.err);
  ASSERT_EQ(lines.size(), 1u) << result.err;
  EXPECT_THAT(lines[0], StartsWith("weightstream: error: "));
  EXPECT_THAT(lines[0], HasSubstr(object));
  EXPECT_THAT(lines[0], HasSubstr(rule));
}

/// A malformed single-file checkpoint and the rule its error must name.
struct BadFile {
  std::string name;  ///< test name and file stem
  std::string bytes;
  std::string rule;  ///< substring of the error
};

std::vector<BadFile> bad_files() {
  const std::string u8x1 = tensor_entry("a", "U8", "[1]", 0, 1);
  return {
      {"Truncated", std::string("\x10\x00\x00", 3), "too short for a safetensors header"},
      {"HeaderLengthPastEnd", safetensors_file("{}", "", 1000), "does not fit the file"},
      {"HeaderOver100MB", safetensors_file("{}", "", 200'000'000), "exceeds the limit of 100000000 bytes"},
      {"HeaderLengthMaximal", safetensors_file("{}", "", UINT64_MAX), "exceeds the limit"},
      {"InvalidUtf8", safetensors_file("{\"a\xff\xfe\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [0, 1]}}", "x"),
       "not valid UTF-8"},
      {"InvalidJson", safetensors_file("{" + u8x1, "x"), "not valid JSON"},
      {"NotAnObject", safetensors_file("[1, 2, 3]", ""), "not a JSON object"},
      {"DuplicateNames", safetensors_file("{" + u8x1 + ", " + tensor_entry("a", "U8", "[1]", 1, 2) + "}", "xx"),
       "'a' appears twice"},
      {"OverlappingOffsets",
       safetensors_file("{" + tensor_entry("a", "U8", "[2]", 0, 2) + ", " + tensor_entry("b", "U8", "[2]", 1, 3) + "}",
                        "xxx"),
       "overlap"},
      {"GappedOffsets",
       safetensors_file("{" + tensor_entry("a", "U8", "[2]", 0, 2) + ", " + tensor_entry("b", "U8", "[2]", 3, 5) + "}",
                        "xxxxx"),
       "gap"},
      {"OffsetsPastTheFile", safetensors_file("{" + tensor_entry("a", "U8", "[1099511627776]", 0, 1099511627776) + "}", "x"),
       "but the file has"},
      {"ReversedOffsets", safetensors_file("{" + tensor_entry("a", "U8", "[0]", 1, 0) + "}", "x"), "begin after they end"},
      {"ByteSizeNotDtypeTimesShape", safetensors_file("{" + tensor_entry("a", "F32", "[2]", 0, 4) + "}", "xxxx"),
       "F32 [2] needs 8"},
      {"ShapeProductOverflows",
       safetensors_file("{" + tensor_entry("a", "U8", "[4294967296, 4294967296]", 0, 4) + "}", "xxxx"),
       "more than 2^64 elements"},
      {"NegativeDimension", safetensors_file("{" + tensor_entry("a", "U8", "[-1]", 0, 0) + "}", ""),
       "negative dimension"},
      {"NonIntegerDimension", safetensors_file("{" + tensor_entry("a", "U8", "[1.5]", 0, 1) + "}", "x"),
       "not a non-negative integer"},
      {"UnknownDtype", safetensors_file("{" + tensor_entry("a", "Q9", "[1]", 0, 1) + "}", "x"), "unknown dtype 'Q9'"},
      {"MetadataNonString", safetensors_file("{\"__metadata__\": {\"k\": 1}, " + u8x1 + "}", "x"),
       "__metadata__ value of 'k'"},
  };
}

class BadSafetensorsFile : public ::testing::TestWithParam<BadFile> {};

TEST_P(BadSafetensorsFile, InspectFailsWithOneLineNamingFileAndRule) {
  TempDir directory;
  auto path = directory / (GetParam().name + ".safetensors");
  testing::write_file(path, GetParam().bytes);
  auto result = run_cli({"inspect", path.string()}, bounded());
  expect_rejected(result, GetParam().name + ".safetensors", GetParam().rule);
}

TEST_P(BadSafetensorsFile, LoadFailsTheSameWay) {
  TempDir directory;
  auto path = directory / (GetParam().name + ".safetensors");
  testing::write_file(path, GetParam().bytes);
  auto result = run_cli({"load", path.string(), "--no-progress"}, bounded());
  expect_rejected(result, GetParam().name + ".safetensors", GetParam().rule);
}

INSTANTIATE_TEST_SUITE_P(Malformed, BadSafetensorsFile, ::testing::ValuesIn(bad_files()),
                         [](const auto& info) { return info.param.name; });

/// A small sharded llama checkpoint, whose index and config the tests below spoil.
class BadShardedCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    SynthOptions options;
    options.arch = "llama";
    options.layers = 1;
    options.hidden = 64;
    options.vocab = 256;
    options.shards = 2;
    options.seed = 7;
    synthesize_checkpoint(model_, options);
    index_ = nlohmann::json::parse(testing::read_file(model_ / std::string(kIndexFileName)));
    config_ = nlohmann::json::parse(testing::read_file(model_ / "config.json"));
  }
  void write_index() { testing::write_file(model_ / std::string(kIndexFileName), index_.dump()); }
  void write_config() { testing::write_file(model_ / "config.json", config_.dump()); }
  /// The shard that `tensor` is not in.
  std::string other_shard(const std::string& tensor) {
    std::string own = index_["weight_map"][tensor];
    for (const auto& [name, shard] : index_["weight_map"].items()) {
      if (shard != own) return shard;
    }
    return own;
  }

  TempDir directory_;
  std::filesystem::path model_ = directory_ / "model";
  nlohmann::json index_;
  nlohmann::json config_;
};

TEST_F(BadShardedCheckpoint, IndexNamingAMissingShard) {
  index_["weight_map"]["lm_head.weight"] = "model-00009-of-00009.safetensors";
  write_index();
  expect_rejected(run_cli({"inspect", model_.string()}, bounded()), std::string(kIndexFileName),
                  "'model-00009-of-00009.safetensors', which does not exist");
}

TEST_F(BadShardedCheckpoint, IndexNamingAnAbsolutePath) {
  index_["weight_map"]["lm_head.weight"] = "/etc/shadow.safetensors";
  write_index();
  expect_rejected(run_cli({"inspect", model_.string()}, bounded()), std::string(kIndexFileName),
                  "is an absolute path");
}

TEST_F(BadShardedCheckpoint, IndexNamingAParentDirectory) {
  index_["weight_map"]["lm_head.weight"] = "../model/model-00001-of-00002.safetensors";
  write_index();
  expect_rejected(run_cli({"inspect", model_.string()}, bounded()), std::string(kIndexFileName),
                  "shards must sit beside the index");
}

TEST_F(BadShardedCheckpoint, IndexNamingDotDotItself) {
  index_["weight_map"]["lm_head.weight"] = "..";
  write_index();
  expect_rejected(run_cli({"inspect", model_.string()}, bounded()), std::string(kIndexFileName), "is a directory reference");
}

TEST_F(BadShardedCheckpoint, IndexAndShardDisagreeOnATensorsShard) {
  index_["weight_map"]["lm_head.weight"] = other_shard("lm_head.weight");
  write_index();
  expect_rejected(run_cli({"inspect", model_.string()}, bounded()), std::string(kIndexFileName),
                  "maps tensor 'lm_head.weight' to shard");
}

TEST_F(BadShardedCheckpoint, IndexNamingATensorNoShardHolds) {
  index_["weight_map"]["ghost.weight"] = other_shard("lm_head.weight");
  write_index();
  expect_rejected(run_cli({"inspect", model_.string()}, bounded()), std::string(kIndexFileName),
                  "has no such tensor");
}

TEST_F(BadShardedCheckpoint, IndexThatIsNotJson) {
  testing::write_file(model_ / std::string(kIndexFileName), "{\"weight_map\": {");
  expect_rejected(run_cli({"inspect", model_.string()}, bounded()), std::string(kIndexFileName), "JSON");
}

/// config.json fields out of range, read by `weightstream plan` (which builds a layout from them).
struct AbsurdConfig {
  std::string name;
  std::string field;
  nlohmann::json value;
  std::string rule;
};

class AbsurdConfigValue : public BadShardedCheckpoint, public ::testing::WithParamInterface<AbsurdConfig> {};

TEST_P(AbsurdConfigValue, PlanFailsWithOneLineNamingTheField) {
  config_[GetParam().field] = GetParam().value;
  write_config();
  auto result = run_cli({"plan", model_.string()}, bounded());
  expect_rejected(result, "config.json", GetParam().field);
  EXPECT_THAT(result.err, HasSubstr(GetParam().rule));
}

INSTANTIATE_TEST_SUITE_P(
    Malformed, AbsurdConfigValue,
    ::testing::Values(AbsurdConfig{"HugeHidden", "hidden_size", int64_t{1} << 40, "must be from 1 to 1048576"},
                      AbsurdConfig{"BillionLayers", "num_hidden_layers", 1'000'000'000, "must be from 1 to 65536"},
                      AbsurdConfig{"NegativeVocab", "vocab_size", -5, "must be from 1 to"},
                      AbsurdConfig{"ZeroHeads", "num_attention_heads", 0, "must be from 1 to"},
                      AbsurdConfig{"FloatingIntermediate", "intermediate_size", 1e300, "must be an integer"},
                      AbsurdConfig{"StringLayers", "num_hidden_layers", "many", "must be an integer, not a string"}),
    [](const auto& info) { return info.param.name; });

// num_hidden_layers at its documented maximum (2^16) passes the config parser, but this
// checkpoint holds one layer. A layout of 65536 layers (393219 parameters) took 1.7 GB and
// 73 s in `plan`, and ended in "internal error: std::bad_alloc" under the limit in `load`
// and `audit` (issue 7): the layer count is now checked against the checkpoint first.
TEST_F(BadShardedCheckpoint, MaximumLayerCountIsRefusedInBoundedMemory) {
  config_["num_hidden_layers"] = 1 << 16;
  write_config();
  const std::string model = model_.string();
  for (const std::vector<std::string>& arguments :
       {std::vector<std::string>{"plan", model}, {"load", model, "--tp-size", "1", "--no-progress"},
        {"audit", model, "--no-progress"}}) {
    SCOPED_TRACE(arguments[0]);
    auto result = run_cli(arguments, bounded());
    expect_rejected(result, (model_ / "config.json").string(),
                    "num_hidden_layers = 65536, but the checkpoint holds 1 layer (tensors model.layers.{layer}.*)");
  }
}

}  // namespace
}  // namespace weightstream
