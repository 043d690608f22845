// Opening checkpoints: shard discovery, index agreement, and the errors for bad layouts.
#include <gmock/gmock.h>
#include <sys/stat.h>
#include <gtest/gtest.h>

#include "support/test_support.hpp"
#include "weightstream/error.hpp"
#include "weightstream/stream.hpp"

namespace weightstream {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;
using testing::write_file;

void write_shard(const std::filesystem::path& path, const std::vector<std::string>& names) {
  SafetensorsWriter writer;
  for (const auto& name : names) {
    std::vector<std::byte> bytes(8, std::byte{1});
    writer.add(name, Dtype::kF32, {2}, bytes);
  }
  writer.write(path);
}

std::string open_error(const std::filesystem::path& path) {
  try {
    Checkpoint::open(path.string(), Options{});
  } catch (const Error& error) {
    return error.what();
  }
  return "no error";
}

TEST(Checkpoint, ShardsWithoutIndexInNaturalOrder) {
  TempDir directory;
  write_shard(directory / "model-10.safetensors", {"c"});
  write_shard(directory / "model-2.safetensors", {"b"});
  write_shard(directory / "model-1.safetensors", {"a"});
  write_file(directory / "notes.txt", "ignored");
  auto checkpoint = Checkpoint::open(directory.path().string(), Options{});
  ASSERT_EQ(checkpoint.shards().size(), 3u);
  EXPECT_EQ(checkpoint.shards()[0].name, "model-1.safetensors");
  EXPECT_EQ(checkpoint.shards()[1].name, "model-2.safetensors");
  EXPECT_EQ(checkpoint.shards()[2].name, "model-10.safetensors");
  EXPECT_EQ(checkpoint.tensors()[2].name, "c");
  EXPECT_EQ(checkpoint.find("b"), std::optional<size_t>(1));
  EXPECT_FALSE(checkpoint.find("zzz"));
}

TEST(Checkpoint, SingleFileUriAndFileScheme) {
  TempDir directory;
  write_shard(directory / "one.safetensors", {"x", "y"});
  write_shard(directory / "two.safetensors", {"z"});
  auto checkpoint = Checkpoint::open("file://" + (directory / "one.safetensors").string(), Options{});
  EXPECT_EQ(checkpoint.tensors().size(), 2u);
  EXPECT_EQ(checkpoint.shards().size(), 1u);
}

TEST(Checkpoint, IndexSelectsShardsAndMustAgree) {
  TempDir directory;
  write_shard(directory / "a.safetensors", {"w1", "w2"});
  write_shard(directory / "b.safetensors", {"w3"});
  write_shard(directory / "consolidated.safetensors", {"w1"});  // not in the index: ignored
  write_file(directory / "model.safetensors.index.json",
             R"({"metadata": {"total_size": 24}, "weight_map": {"w1": "a.safetensors", "w2": "a.safetensors", "w3": "b.safetensors"}})");
  auto checkpoint = Checkpoint::open(directory.path().string(), Options{});
  EXPECT_EQ(checkpoint.tensors().size(), 3u);
  ASSERT_TRUE(checkpoint.index());
}

TEST(Checkpoint, IndexNamingMissingShard) {
  TempDir directory;
  write_shard(directory / "a.safetensors", {"w1"});
  write_file(directory / "model.safetensors.index.json", R"({"weight_map": {"w1": "a.safetensors", "w2": "gone.safetensors"}})");
  auto message = open_error(directory.path());
  EXPECT_THAT(message, HasSubstr("model.safetensors.index.json"));
  EXPECT_THAT(message, HasSubstr("'gone.safetensors', which does not exist"));
  try {
    Checkpoint::open(directory.path().string(), Options{});
    ADD_FAILURE() << "opened a checkpoint whose index names a missing shard";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kNotFound);  // missing, not malformed
  }
}

TEST(Checkpoint, AShardThatIsADirectoryOrAFifoIsReportedAsWhatItIs) {
  TempDir directory;
  write_shard(directory / "a.safetensors", {"w1"});
  write_file(directory / "model.safetensors.index.json", R"({"weight_map": {"w1": "a.safetensors", "w2": "b.safetensors"}})");
  std::filesystem::create_directory(directory / "b.safetensors");
  auto message = open_error(directory.path());
  EXPECT_THAT(message, HasSubstr((directory / "b.safetensors").string() + " is a directory, not a regular file"));
  EXPECT_THAT(message, ::testing::Not(HasSubstr("does not exist")));

  std::filesystem::remove(directory / "b.safetensors");
  ASSERT_EQ(::mkfifo((directory / "b.safetensors").c_str(), 0600), 0);
  // Opening a FIFO for reading would wait for a writer: the error must come at once.
  message = open_error(directory.path());
  EXPECT_THAT(message, HasSubstr((directory / "b.safetensors").string() + " is a FIFO (named pipe), not a regular file"));
  // Named directly, as a single-file checkpoint, too.
  message = open_error(directory / "b.safetensors");
  EXPECT_THAT(message, HasSubstr("is a FIFO (named pipe), not a regular file"));
}

TEST(Checkpoint, IndexAndShardDisagree) {
  TempDir directory;
  write_shard(directory / "a.safetensors", {"w1"});
  write_shard(directory / "b.safetensors", {"w2"});
  write_file(directory / "model.safetensors.index.json", R"({"weight_map": {"w1": "b.safetensors", "w2": "b.safetensors"}})");
  auto message = open_error(directory.path());
  EXPECT_THAT(message, HasSubstr("tensor 'w1'"));
  EXPECT_THAT(message, HasSubstr("has no such tensor"));
}

TEST(Checkpoint, ShardTensorMissingFromIndex) {
  TempDir directory;
  write_shard(directory / "a.safetensors", {"w1", "extra"});
  write_file(directory / "model.safetensors.index.json", R"({"weight_map": {"w1": "a.safetensors"}})");
  EXPECT_THAT(open_error(directory.path()), HasSubstr("does not list tensor 'extra'"));
}

TEST(Checkpoint, TensorInTwoShards) {
  TempDir directory;
  write_shard(directory / "a.safetensors", {"w1"});
  write_shard(directory / "b.safetensors", {"w1"});
  auto message = open_error(directory.path());
  EXPECT_THAT(message, HasSubstr("tensor 'w1' is in two shards"));
  EXPECT_THAT(message, HasSubstr("a.safetensors"));
  EXPECT_THAT(message, HasSubstr("b.safetensors"));
}

TEST(Checkpoint, NoSafetensorsFiles) {
  TempDir directory;
  write_file(directory / "config.json", "{}");
  EXPECT_THAT(open_error(directory.path()), HasSubstr("no *.safetensors files in"));
}

TEST(Checkpoint, MissingPath) {
  TempDir directory;
  EXPECT_THAT(open_error(directory / "nope"), HasSubstr("does not exist"));
}

TEST(Checkpoint, TruncatedShardNamesTheFile) {
  TempDir directory;
  write_shard(directory / "a.safetensors", {"w1", "w2"});
  auto bytes = testing::read_file(directory / "a.safetensors");
  write_file(directory / "a.safetensors", bytes.substr(0, bytes.size() - 3));
  auto message = open_error(directory.path());
  EXPECT_THAT(message, HasSubstr("a.safetensors"));
}

TEST(Uri, Schemes) {
  EXPECT_EQ(parse_uri("/models/x").scheme, Uri::Scheme::kFile);
  EXPECT_EQ(parse_uri("file:///models/x").path, "/models/x");
  auto s3 = parse_uri("s3://my-bucket/models/llama/");
  EXPECT_EQ(s3.scheme, Uri::Scheme::kS3);
  EXPECT_EQ(s3.bucket, "my-bucket");
  EXPECT_EQ(s3.path, "models/llama");
  auto expect_error = [](std::string_view text, std::string_view needle) {
    try {
      parse_uri(text);
      ADD_FAILURE() << "no error for " << text;
    } catch (const Error& error) {
      EXPECT_THAT(error.what(), HasSubstr(std::string(needle)));
    }
  };
  expect_error("", "empty checkpoint URI");
  expect_error("s3:///key", "without a bucket");
  expect_error("s3://Bad_Bucket/key", "is not valid");
  expect_error("ftp://bucket/key", "unsupported scheme 'ftp://' (supported: file://, s3://, gs://, az://, plain paths)");
  expect_error("gs://Bad_Bucket/key", "is not valid");
}

}  // namespace
}  // namespace weightstream
