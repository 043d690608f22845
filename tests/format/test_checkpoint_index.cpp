#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "format/format_test_files.hpp"

namespace weightstream {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::error_text;

std::string index_error(const std::string& json) {
  return error_text([&] { parse_checkpoint_index("/m/model.safetensors.index.json", json); });
}

std::string one_shard(const std::string& shard) {
  return R"({"weight_map": {"model.norm.weight": )" + nlohmann::json(shard).dump() + "}}";
}

TEST(CheckpointIndex, ParsesWeightMapShardsAndTotalSize) {
  auto index = parse_checkpoint_index("i", R"({
    "metadata": {"total_size": 1234, "format": "pt"},
    "weight_map": {
      "lm_head.weight": "model-00010-of-00010.safetensors",
      "model.embed_tokens.weight": "model-00002-of-00010.safetensors",
      "model.norm.weight": "model-00010-of-00010.safetensors",
      "model.layers.0.mlp.up_proj.weight": "model-00001-of-00010.safetensors"
    }})");
  EXPECT_EQ(index.total_size, 1234u);
  EXPECT_EQ(index.weight_map.size(), 4u);
  EXPECT_EQ(index.weight_map.at("model.norm.weight"), "model-00010-of-00010.safetensors");
  EXPECT_THAT(index.shards, ElementsAre("model-00001-of-00010.safetensors", "model-00002-of-00010.safetensors",
                                        "model-00010-of-00010.safetensors"));
}

TEST(CheckpointIndex, TotalSizeIsOptional) {
  EXPECT_EQ(parse_checkpoint_index("i", one_shard("a.safetensors")).total_size, std::nullopt);
  EXPECT_EQ(parse_checkpoint_index("i", R"({"metadata": {}, "weight_map": {}})").total_size, std::nullopt);
  // Some exporters write the total as a whole float.
  EXPECT_EQ(parse_checkpoint_index("i", R"({"metadata": {"total_size": 16.0}, "weight_map": {}})").total_size, 16u);
}

TEST(CheckpointIndex, RejectsABadTotalSize) {
  EXPECT_THAT(index_error(R"({"metadata": {"total_size": -5}, "weight_map": {}})"),
              HasSubstr("/m/model.safetensors.index.json: metadata.total_size = -5: must be a non-negative integer"));
  EXPECT_THAT(index_error(R"({"metadata": {"total_size": "5"}, "weight_map": {}})"),
              HasSubstr("metadata.total_size = \"5\": must be a non-negative integer"));
  EXPECT_THAT(index_error(R"({"metadata": {"total_size": 1.5}, "weight_map": {}})"),
              HasSubstr("metadata.total_size = 1.5: must be a non-negative integer"));
  EXPECT_THAT(index_error(R"({"metadata": 3, "weight_map": {}})"),
              HasSubstr("metadata is an integer, not an object"));
}

TEST(CheckpointIndex, RejectsInvalidJson) {
  EXPECT_THAT(index_error(R"({"weight_map": )"), HasSubstr("/m/model.safetensors.index.json: not valid JSON: "));
}

TEST(CheckpointIndex, RejectsARawNulByte) {
  EXPECT_THAT(index_error(std::string("{\"weight_map\": {}}\0x", 19)),
              HasSubstr("/m/model.safetensors.index.json: not valid JSON: NUL byte at byte 18"));
}

TEST(CheckpointIndex, RejectsANonObject) {
  EXPECT_THAT(index_error("[]"), HasSubstr("/m/model.safetensors.index.json: index is an array, not a JSON object"));
}

TEST(CheckpointIndex, RejectsAMissingWeightMap) {
  EXPECT_THAT(index_error(R"({"metadata": {}})"), HasSubstr("/m/model.safetensors.index.json: index has no weight_map"));
}

TEST(CheckpointIndex, RejectsAWeightMapThatIsNotAnObject) {
  EXPECT_THAT(index_error(R"({"weight_map": ["a.safetensors"]})"),
              HasSubstr("weight_map is an array, not an object of tensor names to shard files"));
}

TEST(CheckpointIndex, RejectsANonStringShard) {
  EXPECT_THAT(index_error(R"({"weight_map": {"w": 3}})"),
              HasSubstr("/m/model.safetensors.index.json: weight_map tensor 'w': shard is an integer, not a file name"));
}

TEST(CheckpointIndex, RejectsAnAbsoluteShardPath) {
  EXPECT_THAT(index_error(one_shard("/etc/passwd.safetensors")),
              HasSubstr("weight_map tensor 'model.norm.weight': shard '/etc/passwd.safetensors' is an absolute path"));
}

TEST(CheckpointIndex, RejectsAParentDirectoryShard) {
  EXPECT_THAT(index_error(one_shard("../other/model.safetensors")),
              HasSubstr("tensor 'model.norm.weight': shard '../other/model.safetensors' contains '/'"));
  EXPECT_THAT(index_error(one_shard("..")), HasSubstr("shard '..' is a directory reference"));
  EXPECT_THAT(index_error(one_shard(".")), HasSubstr("shard '.' is a directory reference"));
}

TEST(CheckpointIndex, RejectsAShardInASubdirectory) {
  EXPECT_THAT(index_error(one_shard("sub/model.safetensors")),
              HasSubstr("shard 'sub/model.safetensors' contains '/': shards must sit beside the index"));
}

TEST(CheckpointIndex, RejectsABackslashInAShard) {
  EXPECT_THAT(index_error(one_shard("..\\model.safetensors")), HasSubstr("contains '\\\\'"));
}

TEST(CheckpointIndex, RejectsAnEmptyShard) {
  EXPECT_THAT(index_error(one_shard("")), HasSubstr("tensor 'model.norm.weight': shard '' is empty"));
}

TEST(CheckpointIndex, RejectsANulInAShard) {
  EXPECT_THAT(index_error(one_shard(std::string("a\0b.safetensors", 15))), HasSubstr("contains a NUL byte"));
}

TEST(CheckpointIndex, RejectsAShardThatIsNotSafetensors) {
  EXPECT_THAT(index_error(one_shard("pytorch_model.bin")),
              HasSubstr("shard 'pytorch_model.bin' does not end in .safetensors"));
}

TEST(CheckpointIndex, RejectsATensorListedTwice) {
  EXPECT_THAT(index_error(R"({"weight_map": {"w": "a.safetensors", "w": "b.safetensors"}})"),
              HasSubstr("/m/model.safetensors.index.json: key 'w' appears twice in one object"));
}

TEST(CheckpointIndex, SerializesAndParsesBack) {
  CheckpointIndex index;
  index.weight_map = {{"a", "model-00002-of-00002.safetensors"}, {"b", "model-00001-of-00002.safetensors"}};
  index.shards = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
  index.total_size = 99;
  auto parsed = parse_checkpoint_index("i", index_json(index));
  EXPECT_EQ(parsed.weight_map, index.weight_map);
  EXPECT_EQ(parsed.shards, index.shards);
  EXPECT_EQ(parsed.total_size, 99u);
}

TEST(NaturalLess, ComparesDigitRunsByValue) {
  EXPECT_TRUE(natural_less("model-2", "model-10"));
  EXPECT_FALSE(natural_less("model-10", "model-2"));
  EXPECT_TRUE(natural_less("layers.9.w", "layers.10.w"));
  EXPECT_TRUE(natural_less("a", "b"));
  EXPECT_TRUE(natural_less("a", "a1"));
  EXPECT_FALSE(natural_less("a1", "a"));
  EXPECT_FALSE(natural_less("x", "x"));
  // Runs longer than 64 bits compare without overflow.
  EXPECT_TRUE(natural_less("s99999999999999999999999", "s100000000000000000000000"));
}

TEST(NaturalLess, IsAStrictOrderEvenForLeadingZeros) {
  EXPECT_NE(natural_less("a01", "a1"), natural_less("a1", "a01"));
  EXPECT_TRUE(natural_less("model-00001", "model-2"));
  std::vector<std::string> names = {"m-10", "m-1", "m-01", "m-2", "m-001", "m", "m-"};
  std::sort(names.begin(), names.end(), [](const std::string& a, const std::string& b) { return natural_less(a, b); });
  EXPECT_THAT(names, ElementsAre("m", "m-", "m-001", "m-01", "m-1", "m-2", "m-10"));
}

}  // namespace
}  // namespace weightstream
