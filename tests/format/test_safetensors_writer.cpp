#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "format/format_test_files.hpp"
#include "support/test_support.hpp"

namespace weightstream {
namespace {

using ::testing::HasSubstr;
using testing::as_bytes;
using testing::error_text;

std::vector<std::byte> pattern(size_t size, uint8_t start) {
  std::vector<std::byte> bytes(size);
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<std::byte>(start + i * 7);
  return bytes;
}

TEST(SafetensorsWriter, RoundTripsThroughTheParser) {
  testing::TempDir dir;
  SafetensorsWriter writer;
  auto a = pattern(2 * 3 * 2, 1);
  auto b = pattern(4 * 4, 9);
  auto c = pattern(3, 5);
  writer.add("model.layers.0.mlp.up_proj.weight", Dtype::kBF16, {2, 3}, a);
  writer.add("scale", Dtype::kF32, {4}, b);
  writer.add("packed", Dtype::kF4, {6}, c);
  writer.add("empty", Dtype::kI64, {0, 3}, {});
  writer.set_metadata("format", "pt");
  writer.write(dir / "m.safetensors");

  std::string file = testing::read_file(dir / "m.safetensors");
  EXPECT_EQ(file.size(), writer.file_size());
  auto header = parse_safetensors_bytes("m.safetensors", as_bytes(file));
  EXPECT_EQ(header.metadata.at("format"), "pt");
  EXPECT_EQ(header.data_offset() % 8, 0u) << "the reference writer pads the header to a multiple of 8";
  EXPECT_EQ(header.header_length + 8, writer.header_bytes().size());
  ASSERT_EQ(header.tensors.size(), 4u);
  const TensorInfo& first = header.tensors[0];
  EXPECT_EQ(first.name, "model.layers.0.mlp.up_proj.weight");
  EXPECT_EQ(first.dtype, Dtype::kBF16);
  EXPECT_EQ(first.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(std::memcmp(file.data() + header.data_offset() + first.data_begin, a.data(), a.size()), 0);
  const TensorInfo& second = header.tensors[1];
  EXPECT_EQ(second.name, "scale");
  EXPECT_EQ(std::memcmp(file.data() + header.data_offset() + second.data_begin, b.data(), b.size()), 0);
  EXPECT_EQ(header.tensors[2].name, "packed");
  EXPECT_EQ(header.tensors[2].bytes(), 3u);
}

TEST(SafetensorsWriter, PadsTheHeaderWithSpaces) {
  SafetensorsWriter writer;
  writer.add("x", Dtype::kU8, {1}, pattern(1, 0));
  std::string header = writer.header_bytes();
  EXPECT_EQ(header.size() % 8, 0u);
  std::string json = header.substr(8);
  EXPECT_EQ(json.front(), '{');
  size_t close = json.rfind('}');
  EXPECT_EQ(json.find_first_not_of(' ', close + 1), std::string::npos);
  EXPECT_LT(json.size() - close - 1, 8u);
}

TEST(SafetensorsWriter, WritesAnEmptyCheckpoint) {
  SafetensorsWriter writer;
  std::string header = writer.header_bytes();
  auto parsed = parse_safetensors_bytes("empty", as_bytes(header));
  EXPECT_TRUE(parsed.tensors.empty());
}

TEST(SafetensorsWriter, EscapesNames) {
  SafetensorsWriter writer;
  writer.add("quote\"and\\slash", Dtype::kU8, {1}, pattern(1, 0));
  std::string file = writer.header_bytes() + "x";
  auto parsed = parse_safetensors_bytes("f", as_bytes(file));
  EXPECT_EQ(parsed.tensors.at(0).name, "quote\"and\\slash");
}

TEST(SafetensorsWriter, RefusesNamesTheReaderWouldRefuse) {
  // One rule for both sides: the writer never writes a header its own parser rejects.
  for (std::string name : {std::string("line\nbreak"), std::string("a\0b", 3), std::string()}) {
    SafetensorsWriter writer;
    writer.add(name, Dtype::kU8, {1}, pattern(1, 0));
    EXPECT_THAT(error_text([&] { writer.header_bytes(); }, ErrorCode::kInvalidArgument),
                HasSubstr("tensor names must be non-empty and hold no control characters"));
  }
}

TEST(SafetensorsWriter, RejectsDataOfTheWrongSize) {
  SafetensorsWriter writer;
  auto data = pattern(5, 0);
  EXPECT_THAT(error_text([&] { writer.add("w", Dtype::kBF16, {2}, data); }, ErrorCode::kInvalidArgument),
              HasSubstr("tensor 'w': 5 bytes given but BF16 [2] needs 4"));
}

TEST(SafetensorsWriter, RejectsADuplicateName) {
  SafetensorsWriter writer;
  writer.add("w", Dtype::kU8, {1}, pattern(1, 0));
  EXPECT_THAT(error_text([&] { writer.add("w", Dtype::kU8, {1}, pattern(1, 0)); }, ErrorCode::kInvalidArgument),
              HasSubstr("tensor 'w' is added twice"));
}

TEST(SafetensorsWriter, RejectsTheReservedName) {
  std::vector<TensorSpec> specs = {{"__metadata__", Dtype::kU8, {1}}};
  EXPECT_THAT(error_text([&] { safetensors_header_bytes(specs); }, ErrorCode::kInvalidArgument),
              HasSubstr("'__metadata__' is reserved"));
}

TEST(SafetensorsWriter, RejectsASubByteTensorEndingMidByte) {
  std::vector<TensorSpec> specs = {{"w", Dtype::kF4, {3}}};
  EXPECT_THAT(error_text([&] { safetensors_header_bytes(specs); }, ErrorCode::kInvalidArgument),
              HasSubstr("tensor 'w': F4 [3]"));
}

TEST(SafetensorsWriter, ReportsTheErrnoOfAFailedWrite) {
  testing::TempDir dir;
  SafetensorsWriter writer;
  auto path = dir / "missing" / "m.safetensors";
  std::string message = error_text([&] { writer.write(path); }, ErrorCode::kIo);
  EXPECT_THAT(message, HasSubstr("cannot create " + path.string()));
  EXPECT_THAT(message, HasSubstr("(errno 2)"));
}

/// Names in `directory`, sorted.
std::vector<std::string> names_in(const std::filesystem::path& directory) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(directory)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

TEST(SafetensorsWriter, ReplacesAFileWholeAndAMappingOfTheOldOneKeepsItsBytes) {
  // A process holding tensors of the old file in place (a mapping of it) must neither see
  // them change nor die of SIGBUS when the file is written again, bigger or smaller.
  testing::TempDir dir;
  auto path = dir / "m.safetensors";
  SafetensorsWriter old_writer;
  old_writer.add("w", Dtype::kU8, {4096}, pattern(4096, 1));
  old_writer.write(path);
  std::string old_bytes = testing::read_file(path);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  void* mapping = ::mmap(nullptr, old_bytes.size(), PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  ASSERT_NE(mapping, MAP_FAILED);
  for (size_t size : {4096, 16}) {
    SafetensorsWriter writer;
    writer.add("w", Dtype::kU8, {static_cast<int64_t>(size)}, pattern(size, 2));
    writer.write(path);
    EXPECT_EQ(std::string(static_cast<const char*>(mapping), old_bytes.size()), old_bytes) << size;
    EXPECT_EQ(testing::read_file(path).size(), writer.file_size());
  }
  ::munmap(mapping, old_bytes.size());
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"m.safetensors"});  // no temporary file left
}

TEST(SafetensorsWriter, AWriteThatFailsLeavesTheOldFileAndNoTemporaryFile) {
  testing::TempDir dir;
  auto path = dir / "m.safetensors";
  SafetensorsWriter writer;
  writer.add("w", Dtype::kU8, {3}, pattern(3, 1));
  writer.write(path);
  std::string before = testing::read_file(path);
  std::vector<TensorSpec> specs = {{"a", Dtype::kU8, {8}}, {"b", Dtype::kU8, {8}}};
  EXPECT_THROW(SafetensorsWriter::write_streaming(path, specs,
                                                  [](size_t index, uint64_t, std::span<std::byte> out) {
                                                    if (index == 1) throw Error(ErrorCode::kIo, "source went away");
                                                    std::memset(out.data(), 1, out.size());
                                                  }),
               Error);
  EXPECT_EQ(testing::read_file(path), before);
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"m.safetensors"});
}

TEST(SafetensorsWriter, StreamsTensorsInChunks) {
  testing::TempDir dir;
  // One tensor spans three chunks, so the fill sees consecutive offsets.
  const int64_t big = static_cast<int64_t>(SafetensorsWriter::kStreamChunkBytes * 2 + 1000) / 4;
  std::vector<TensorSpec> specs = {{"small", Dtype::kU8, {3}}, {"big", Dtype::kF32, {big}}, {"none", Dtype::kU8, {0}}};
  std::vector<std::pair<size_t, uint64_t>> calls;
  SafetensorsWriter::write_streaming(
      dir / "s.safetensors", specs,
      [&](size_t index, uint64_t offset, std::span<std::byte> out) {
        calls.emplace_back(index, offset);
        for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<std::byte>((offset + i) * 31 + index);
      },
      {{"format", "pt"}});
  ASSERT_EQ(calls.size(), 4u);
  EXPECT_EQ(calls[0], (std::pair<size_t, uint64_t>{0, 0}));
  EXPECT_EQ(calls[1], (std::pair<size_t, uint64_t>{1, 0}));
  EXPECT_EQ(calls[2], (std::pair<size_t, uint64_t>{1, SafetensorsWriter::kStreamChunkBytes}));
  EXPECT_EQ(calls[3], (std::pair<size_t, uint64_t>{1, 2 * SafetensorsWriter::kStreamChunkBytes}));

  std::string file = testing::read_file(dir / "s.safetensors");
  auto header = parse_safetensors_bytes("s", as_bytes(file));
  ASSERT_EQ(header.tensors.size(), 3u);
  EXPECT_EQ(header.metadata.at("format"), "pt");
  const TensorInfo& tensor = header.tensors[1];
  EXPECT_EQ(tensor.name, "big");
  bool same = true;
  for (uint64_t i = 0; i < tensor.bytes(); ++i) {
    auto expected = static_cast<char>(static_cast<std::byte>(i * 31 + 1));
    same = same && file[header.data_offset() + tensor.data_begin + i] == expected;
  }
  EXPECT_TRUE(same);
  EXPECT_EQ(file.substr(header.data_offset() + 1, 1), std::string(1, static_cast<char>(31)));
}

}  // namespace
}  // namespace weightstream
