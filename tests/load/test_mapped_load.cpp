// load_checkpoint onto the host with LocalIo::kAuto (the default) and kMmap: tensors of local
// shards are copy-on-write views of a private mapping of their shard (seen in
// /proc/self/maps), misaligned ones load through the arena, a write into a loaded tensor
// reaches neither the file nor another load, the mapping lives as long as a copy of
// LoadedCheckpoint::mappings, and a shard whose size changed since the checkpoint was opened
// (or that shrinks while its pages are mapped) is refused by name; shards on S3 load into the
// arena; kPread copies every tensor.
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <sys/stat.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "storage/local_io.hpp"
#include "storage/test_s3_fixture.hpp"
#include "support/test_support.hpp"
#include "weightstream/error.hpp"
#include "weightstream/format.hpp"
#include "weightstream/load.hpp"

namespace weightstream {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;

constexpr const char* kFirstShard = "model-00001-of-00002.safetensors";
constexpr const char* kSecondShard = "model-00002-of-00002.safetensors";

/// One line of /proc/self/maps.
struct MappedRange {
  uintptr_t begin = 0;
  uintptr_t end = 0;
  std::string permissions;  ///< "rw-p", "r--s", ...
  std::string path;
};

/// The ranges of this process mapped from `path`.
std::vector<MappedRange> ranges_mapped_from(const std::filesystem::path& path) {
  std::vector<MappedRange> ranges;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  std::string wanted = std::filesystem::canonical(path).string();
  while (std::getline(maps, line)) {
    std::istringstream fields(line);
    std::string span, permissions, offset, device, inode, file;
    fields >> span >> permissions >> offset >> device >> inode;
    std::getline(fields >> std::ws, file);
    if (file != wanted) continue;
    MappedRange range;
    range.begin = std::stoull(span.substr(0, span.find('-')), nullptr, 16);
    range.end = std::stoull(span.substr(span.find('-') + 1), nullptr, 16);
    range.permissions = permissions;
    range.path = file;
    ranges.push_back(range);
  }
  return ranges;
}

/// The permissions of the mapping of `path` that holds [data, data + bytes), or "" when none does.
std::string mapping_holding(const std::filesystem::path& path, const std::byte* data, uint64_t bytes) {
  auto begin = reinterpret_cast<uintptr_t>(data);
  for (const MappedRange& range : ranges_mapped_from(path)) {
    if (range.begin <= begin && begin + bytes <= range.end) return range.permissions;
  }
  return "";
}

bool privately_writable(const std::string& permissions) {
  return permissions.size() == 4 && permissions[0] == 'r' && permissions[1] == 'w' && permissions[3] == 'p';
}

std::vector<std::byte> counting_bytes(size_t count, unsigned start) {
  std::vector<std::byte> bytes(count);
  for (size_t i = 0; i < count; ++i) bytes[i] = static_cast<std::byte>((start + i * 37) & 0xff);
  return bytes;
}

/// Two shards. In the first, `b` (3 bytes) leaves `c` (F32) and `e` (BF16) at offsets that
/// are no multiple of their element size; the others are aligned, and `empty` has no bytes.
struct MappedCheckpoint {
  TempDir directory;
  Checkpoint checkpoint;
  std::map<std::string, bool, std::less<>> expect_in_place;

  MappedCheckpoint() {
    SafetensorsWriter first;
    first.add("a", Dtype::kF32, {4, 4}, counting_bytes(64, 1));
    first.add("b", Dtype::kU8, {3}, counting_bytes(3, 2));
    first.add("c", Dtype::kF32, {5}, counting_bytes(20, 3));
    first.add("e", Dtype::kBF16, {2}, counting_bytes(4, 4));
    first.write(directory / kFirstShard);
    SafetensorsWriter second;
    second.add("x", Dtype::kI64, {3}, counting_bytes(24, 5));
    second.add("y", Dtype::kF16, {4}, counting_bytes(8, 6));
    second.add("empty", Dtype::kF32, {0}, {});
    second.write(directory / kSecondShard);
    checkpoint = Checkpoint::open(directory.path().string(), Options{});
    expect_in_place = {{"a", true}, {"b", true}, {"c", false}, {"e", false},
                       {"x", true}, {"y", true}, {"empty", false}};
  }

  std::filesystem::path shard_path(uint32_t shard) const { return directory / checkpoint.shards()[shard].name; }

  /// The tensor's bytes as the file holds them now.
  std::string file_bytes(const CheckpointTensor& tensor) const {
    return testing::read_file(shard_path(tensor.shard)).substr(tensor.offset, tensor.bytes);
  }
};

StreamOptions with_io(LocalIo io) {
  StreamOptions options;
  options.local_io = io;
  return options;
}

StreamOptions mmap_io() { return with_io(LocalIo::kMmap); }
StreamOptions pread_io() { return with_io(LocalIo::kPread); }

std::string loaded_bytes(const LoadedTensor& tensor) {
  return std::string(reinterpret_cast<const char*>(tensor.data), tensor.bytes);
}

TEST(MappedHostLoad, AlignedTensorsAreCopyOnWriteViewsOfTheirShardAndTheRestLoadIntoTheArena) {
  MappedCheckpoint disk;
  const auto& tensors = disk.checkpoint.tensors();
  // The premise: the writer put c and e at offsets their element size does not divide.
  EXPECT_NE(tensors[*disk.checkpoint.find("c")].offset % 4, 0u);
  EXPECT_NE(tensors[*disk.checkpoint.find("e")].offset % 2, 0u);

  LoadedCheckpoint loaded = load_checkpoint(disk.checkpoint, Device{}, mmap_io());
  ASSERT_EQ(loaded.tensors.size(), tensors.size());
  ASSERT_NE(loaded.mappings, nullptr);
  for (const LoadedTensor& tensor : loaded.tensors) {
    const CheckpointTensor& info = tensors[tensor.tensor];
    SCOPED_TRACE(info.name);
    EXPECT_EQ(loaded_bytes(tensor), disk.file_bytes(info));
    EXPECT_EQ(tensor.in_place, disk.expect_in_place.at(info.name));
    std::string permissions = mapping_holding(disk.shard_path(info.shard), tensor.data, std::max<uint64_t>(tensor.bytes, 1));
    if (tensor.in_place) {
      EXPECT_TRUE(privately_writable(permissions)) << "mapped " << permissions;
    } else {
      EXPECT_EQ(permissions, "") << "an arena tensor lies in a mapping of its shard";
    }
  }
  // Both in-place tensors of a shard lie in one mapping, at their file offsets.
  const LoadedTensor& a = loaded.tensors[*disk.checkpoint.find("a")];
  const LoadedTensor& b = loaded.tensors[*disk.checkpoint.find("b")];
  EXPECT_EQ(b.data - a.data, static_cast<ptrdiff_t>(tensors[b.tensor].offset - tensors[a.tensor].offset));

  // The counters cover the whole load, as a copying load counts it.
  LoadedCheckpoint copied = load_checkpoint(disk.checkpoint, Device{}, pread_io());
  EXPECT_EQ(loaded.stats.tensors, copied.stats.tensors);
  EXPECT_EQ(loaded.stats.bytes, copied.stats.bytes);
  EXPECT_EQ(loaded.stats.bytes, disk.checkpoint.tensor_bytes());
  EXPECT_EQ(loaded.stats.shards_read, 2u);
  EXPECT_GT(loaded.stats.seconds, 0.0);
}

TEST(MappedHostLoad, TheDefaultIoTakesTheSameTensorsInPlaceAsMmap) {
  MappedCheckpoint disk;
  ASSERT_EQ(StreamOptions{}.local_io, LocalIo::kAuto);
  LoadedCheckpoint loaded = load_checkpoint(disk.checkpoint, Device{}, StreamOptions{});
  ASSERT_NE(loaded.mappings, nullptr);
  for (const LoadedTensor& tensor : loaded.tensors) {
    const CheckpointTensor& info = disk.checkpoint.tensors()[tensor.tensor];
    SCOPED_TRACE(info.name);
    EXPECT_EQ(tensor.in_place, disk.expect_in_place.at(info.name));
    EXPECT_EQ(loaded_bytes(tensor), disk.file_bytes(info));
  }
  EXPECT_EQ(loaded.stats.bytes, disk.checkpoint.tensor_bytes());
}

TEST(MappedHostLoad, PreadCopiesEveryTensor) {
  MappedCheckpoint disk;
  LoadedCheckpoint loaded = load_checkpoint(disk.checkpoint, Device{}, pread_io());
  EXPECT_EQ(loaded.mappings, nullptr);
  for (const LoadedTensor& tensor : loaded.tensors) {
    const CheckpointTensor& info = disk.checkpoint.tensors()[tensor.tensor];
    EXPECT_FALSE(tensor.in_place) << info.name;
    EXPECT_EQ(loaded_bytes(tensor), disk.file_bytes(info)) << info.name;
    EXPECT_EQ(mapping_holding(disk.shard_path(info.shard), tensor.data, 1), "") << info.name;
  }
}

TEST(MappedHostLoad, WritesIntoLoadedTensorsReachNeitherTheFileNorAnotherLoad) {
  MappedCheckpoint disk;
  const auto& tensors = disk.checkpoint.tensors();
  std::string first_file = testing::read_file(disk.shard_path(0));
  std::string second_file = testing::read_file(disk.shard_path(1));
  LoadedCheckpoint loaded = load_checkpoint(disk.checkpoint, Device{}, mmap_io());
  for (const LoadedTensor& tensor : loaded.tensors) std::memset(tensor.data, 0xA5, tensor.bytes);

  EXPECT_EQ(testing::read_file(disk.shard_path(0)), first_file);
  EXPECT_EQ(testing::read_file(disk.shard_path(1)), second_file);
  LoadedCheckpoint again = load_checkpoint(disk.checkpoint, Device{}, mmap_io());
  LoadedCheckpoint copied = load_checkpoint(disk.checkpoint, Device{}, pread_io());
  for (size_t i = 0; i < tensors.size(); ++i) {
    SCOPED_TRACE(tensors[i].name);
    EXPECT_EQ(loaded_bytes(loaded.tensors[i]), std::string(tensors[i].bytes, '\xA5'));
    EXPECT_EQ(loaded_bytes(again.tensors[i]), disk.file_bytes(tensors[i]));
    EXPECT_EQ(loaded_bytes(copied.tensors[i]), disk.file_bytes(tensors[i]));
  }
}

TEST(MappedHostLoad, TheMappingLivesAsLongAsACopyOfItsKeeper) {
  MappedCheckpoint disk;
  size_t index = *disk.checkpoint.find("x");
  const CheckpointTensor& info = disk.checkpoint.tensors()[index];
  std::shared_ptr<const void> keeper;
  LoadedTensor x;
  {
    LoadedCheckpoint loaded = load_checkpoint(disk.checkpoint, Device{}, mmap_io());
    x = loaded.tensors[index];
    keeper = loaded.mappings;
  }
  ASSERT_TRUE(x.in_place);
  EXPECT_TRUE(privately_writable(mapping_holding(disk.shard_path(info.shard), x.data, x.bytes)));
  EXPECT_EQ(loaded_bytes(x), disk.file_bytes(info));
  keeper.reset();
  for (const MappedRange& range : ranges_mapped_from(disk.shard_path(info.shard))) {
    EXPECT_FALSE(privately_writable(range.permissions)) << "still mapped after the last keeper went: " << range.permissions;
  }
}

TEST(MappedHostLoad, AShardWhoseSizeChangedSinceOpenIsRefusedByName) {
  MappedCheckpoint disk;
  std::filesystem::path shard = disk.shard_path(1);
  uint64_t recorded = disk.checkpoint.shards()[1].size;
  std::filesystem::resize_file(shard, recorded - 8);
  try {
    load_checkpoint(disk.checkpoint, Device{}, mmap_io());
    FAIL() << "a shortened shard was mapped";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kIo);
    EXPECT_THAT(error.what(), HasSubstr(shard.string()));
    EXPECT_THAT(error.what(), HasSubstr(std::to_string(recorded)));
    EXPECT_THAT(error.what(), HasSubstr(std::to_string(recorded - 8)));
    EXPECT_THAT(error.what(), HasSubstr("changed since it was opened"));
  }
}

TEST(MappedHostLoad, AShardThatShrinksAfterItWasMappedIsRefusedByNameNotFaulted) {
  TempDir directory;
  std::filesystem::path shard = directory.path() / "big.safetensors";
  uint64_t size = 4 * local_io::page_size();
  testing::write_file(shard, std::string(size, 'w'));
  auto mapping = local_io::FileMapping::open(shard.string(), size, local_io::MappingKind::kPrivateWritable);
  std::filesystem::resize_file(shard, local_io::page_size() / 2);
  // The first page is still in the file; the rest is not, and touching it would raise SIGBUS.
  EXPECT_NO_THROW(local_io::populate_range(mapping.data(), shard.string(), 0, local_io::page_size() / 2));
  try {
    local_io::populate_range(mapping.data(), shard.string(), 0, size);
    FAIL() << "pages past the end of a shrunk file were mapped";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kIo);
    EXPECT_THAT(error.what(), HasSubstr(shard.string()));
    EXPECT_THAT(error.what(), HasSubstr("the file shrank since it was opened"));
  }
}

TEST(MappedHostLoad, AFileThatCannotBeMappedIsUnsupportedNotAnIoError) {
  // A directory stands in for a file system without mmap (the kernel answers ENODEV for
  // both): the error code is what lets --io auto leave such a shard to the arena.
  TempDir directory;
  struct stat status {};
  ASSERT_EQ(::stat(directory.path().c_str(), &status), 0);
  auto size = static_cast<uint64_t>(status.st_size);
  ASSERT_GT(size, 0u);
  for (auto kind : {local_io::MappingKind::kPrivateWritable, local_io::MappingKind::kSharedRead}) {
    try {
      local_io::FileMapping::open(directory.path().string(), size, kind);
      FAIL() << "a directory was mapped";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kUnsupported);
      EXPECT_THAT(error.what(), HasSubstr(directory.path().string()));
      EXPECT_THAT(error.what(), HasSubstr("its file system cannot map files: use --io pread"));
    }
  }
}

TEST(MappedHostLoad, ShardsOnObjectStorageLoadIntoTheArena) {
  WS_REQUIRE_S3_SERVER();
  MappedCheckpoint disk;
  Options options;
  options.s3 = testing::s3_test_options(*testing::s3_test_endpoint());
  std::string bucket = testing::unique_bucket("mapped-load");
  s3::S3Client client(options.s3);
  client.create_bucket(bucket);
  for (uint32_t shard = 0; shard < 2; ++shard) {
    client.put_object(bucket, "model/" + disk.checkpoint.shards()[shard].name, testing::read_file(disk.shard_path(shard)));
  }
  Checkpoint remote = Checkpoint::open("s3://" + bucket + "/model", options);
  LoadedCheckpoint loaded = load_checkpoint(remote, Device{}, mmap_io());
  EXPECT_EQ(loaded.mappings, nullptr);
  EXPECT_EQ(loaded.stats.bytes, remote.tensor_bytes());
  for (const LoadedTensor& tensor : loaded.tensors) {
    const CheckpointTensor& info = remote.tensors()[tensor.tensor];
    EXPECT_FALSE(tensor.in_place) << info.name;
    EXPECT_EQ(loaded_bytes(tensor), disk.file_bytes(disk.checkpoint.tensors()[*disk.checkpoint.find(info.name)])) << info.name;
  }
}

}  // namespace
}  // namespace weightstream
