// Every rule of the safetensors header, each with the error text it produces.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "format/format_test_files.hpp"

namespace weightstream {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using testing::as_bytes;
using testing::error_text;
using testing::header_error;
using testing::parse_header;
using testing::safetensors_file;

std::string entry(const std::string& name, const std::string& dtype, const std::string& shape, uint64_t begin,
                  uint64_t end) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":[" +
         std::to_string(begin) + "," + std::to_string(end) + "]}";
}

TEST(SafetensorsHeaderLength, RejectsAFileTooSmallForTheLength) {
  std::string file = "abc";
  EXPECT_THAT(error_text([&] { parse_header_length("/m/a.safetensors", as_bytes(file), file.size()); }),
              HasSubstr("/m/a.safetensors: file of 3 bytes is too small for a safetensors file"));
}

TEST(SafetensorsHeaderLength, RejectsALengthOverTheLimit) {
  std::string prefix = safetensors_file(std::string()).substr(0, 8);
  uint64_t length = kMaxHeaderLength + 1;
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  EXPECT_THAT(error_text([&] { parse_header_length("/m/a.safetensors", as_bytes(prefix), uint64_t{1} << 40); }),
              HasSubstr("/m/a.safetensors: header length 100000001 exceeds the limit of 100000000 bytes"));
}

TEST(SafetensorsHeaderLength, RejectsALengthBeyondTheFile) {
  std::string file = safetensors_file("{}");
  EXPECT_THAT(error_text([&] { parse_header_length("/m/a.safetensors", as_bytes(file), 9); }),
              HasSubstr("/m/a.safetensors: header length 2 does not fit the file of 9 bytes"));
}

TEST(SafetensorsHeaderLength, ReadsLittleEndian) {
  std::string file = safetensors_file(std::string(0x0102, ' '));
  EXPECT_EQ(parse_header_length("a", as_bytes(file), file.size()), 0x0102u);
}

TEST(SafetensorsHeader, RejectsInvalidUtf8) {
  EXPECT_THAT(header_error("{\"a\xff\":{}}"), HasSubstr("/m/model.safetensors: header is not valid UTF-8 at byte 3"));
  // An overlong encoding of '/' and a UTF-16 surrogate are not UTF-8 either.
  EXPECT_THAT(header_error("{\"\xc0\xaf\":1}"), HasSubstr("not valid UTF-8 at byte 2"));
  EXPECT_THAT(header_error("{\"\xed\xa0\x80\":1}"), HasSubstr("not valid UTF-8 at byte 2"));
}

TEST(SafetensorsHeader, RejectsInvalidJson) {
  EXPECT_THAT(header_error("{\"a\":"), HasSubstr("/m/model.safetensors: header is not valid JSON: "));
}

TEST(SafetensorsHeader, RejectsAnythingButAnObject) {
  EXPECT_THAT(header_error("[1, 2]"), HasSubstr("/m/model.safetensors: header is an array, not a JSON object"));
  EXPECT_THAT(header_error("7"), HasSubstr("header is an integer, not a JSON object"));
}

TEST(SafetensorsHeader, RejectsBytesAfterTheObject) {
  EXPECT_THAT(header_error("{}  x"), HasSubstr("header is not valid JSON"));
  EXPECT_THAT(header_error(std::string("{}\0\0", 4)), HasSubstr("header is not valid JSON"));
}

TEST(SafetensorsHeader, AcceptsTrailingWhitespacePadding) {
  auto header = parse_header("{" + entry("a", "U8", "[2]", 0, 2) + "}   \t\n  ", 2);
  ASSERT_EQ(header.tensors.size(), 1u);
  EXPECT_EQ(header.header_length, header.data_offset() - 8);
}

TEST(SafetensorsHeader, RejectsMetadataThatIsNotAnObject) {
  EXPECT_THAT(header_error("{\"__metadata__\":[\"a\"]}"),
              HasSubstr("/m/model.safetensors: __metadata__ is an array, not an object of strings"));
}

TEST(SafetensorsHeader, RejectsAMetadataValueThatIsNotAString) {
  EXPECT_THAT(header_error("{\"__metadata__\":{\"format\":\"pt\",\"step\":1}}"),
              HasSubstr("/m/model.safetensors: __metadata__ value of 'step' is an integer, not a string"));
  EXPECT_THAT(header_error("{\"__metadata__\":{\"x\":{}}}"), HasSubstr("__metadata__ value of 'x' is an object"));
}

TEST(SafetensorsHeader, RejectsARepeatedMetadataKey) {
  EXPECT_THAT(header_error("{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}"),
              HasSubstr("__metadata__ key 'k' appears twice"));
  EXPECT_THAT(header_error("{\"__metadata__\":{},\"__metadata__\":{}}"),
              HasSubstr("key '__metadata__' appears twice"));
}

TEST(SafetensorsHeader, ReadsMetadataAndNullMetadata) {
  auto header = parse_header("{\"__metadata__\":{\"format\":\"pt\"}," + entry("a", "U8", "[1]", 0, 1) + "}", 1);
  EXPECT_EQ(header.metadata.at("format"), "pt");
  // The reference implementation reads a null __metadata__ as none.
  EXPECT_TRUE(parse_header("{\"__metadata__\":null}").metadata.empty());
}

TEST(SafetensorsHeader, RejectsADuplicateTensorName) {
  std::string json = "{" + entry("w", "U8", "[2]", 0, 2) + "," + entry("w", "U8", "[2]", 2, 4) + "}";
  EXPECT_THAT(header_error(json, 4), HasSubstr("/m/model.safetensors: tensor 'w' appears twice in the header"));
}

TEST(SafetensorsHeader, RejectsAnEmptyTensorName) {
  std::string json = "{" + entry("", "U8", "[2]", 0, 2) + "}";
  EXPECT_THAT(header_error(json, 2),
              HasSubstr("/m/model.safetensors: a tensor name is empty; tensor names must be non-empty and hold no "
                        "control characters (U+0000 to U+001F, U+007F)"));
}

TEST(SafetensorsHeader, RejectsNulAndControlCharactersInTensorNames) {
  // JSON escapes decode to the raw characters: "a\u0000b" is the name a, NUL, b.
  EXPECT_THAT(header_error("{" + entry("a\\u0000b", "U8", "[2]", 0, 2) + "}", 2),
              HasSubstr("/m/model.safetensors: tensor 'a\\x00b' has the control character U+0000 at byte 1 of its name; "
                        "tensor names must be non-empty and hold no control characters"));
  EXPECT_THAT(header_error("{" + entry("w\\u001b[2J", "U8", "[2]", 0, 2) + "}", 2),
              HasSubstr("tensor 'w\\x1b[2J' has the control character U+001B at byte 1"));
  EXPECT_THAT(header_error("{" + entry("w\\t", "U8", "[2]", 0, 2) + "}", 2), HasSubstr("U+0009 at byte 1"));
  EXPECT_THAT(header_error("{" + entry("w\\u007f", "U8", "[2]", 0, 2) + "}", 2), HasSubstr("U+007F at byte 1"));
  // Other non-ASCII text is a legal name.
  EXPECT_EQ(parse_header("{" + entry("gewicht\\u00e4", "U8", "[2]", 0, 2) + "}", 2).tensors.at(0).name,
            "gewicht\xc3\xa4");
}

TEST(SafetensorsHeader, RejectsAnEntryThatIsNotAnObject) {
  EXPECT_THAT(header_error("{\"w\":[1]}"),
              HasSubstr("/m/model.safetensors: tensor 'w': entry is an array, not an object with dtype, shape and "
                        "data_offsets"));
}

TEST(SafetensorsHeader, RejectsAMissingField) {
  EXPECT_THAT(header_error("{\"w\":{\"dtype\":\"U8\",\"data_offsets\":[0,0]}}"),
              HasSubstr("/m/model.safetensors: tensor 'w': missing field shape"));
  EXPECT_THAT(header_error("{\"w\":{\"shape\":[],\"data_offsets\":[0,1]}}", 1), HasSubstr("missing field dtype"));
  EXPECT_THAT(header_error("{\"w\":{\"dtype\":\"U8\",\"shape\":[]}}"), HasSubstr("missing field data_offsets"));
}

TEST(SafetensorsHeader, RejectsAnUnknownField) {
  EXPECT_THAT(header_error("{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"crc\":5}}", 1),
              HasSubstr("tensor 'w': unknown field 'crc': an entry holds exactly dtype, shape and data_offsets"));
}

TEST(SafetensorsHeader, RejectsARepeatedField) {
  EXPECT_THAT(header_error("{\"w\":{\"dtype\":\"U8\",\"dtype\":\"I8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1),
              HasSubstr("tensor 'w': field 'dtype' appears twice"));
}

TEST(SafetensorsHeader, RejectsADtypeThatIsNotAString) {
  EXPECT_THAT(header_error("{\"w\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,1]}}", 1),
              HasSubstr("tensor 'w': dtype is an integer, not a string"));
}

TEST(SafetensorsHeader, RejectsAnUnknownDtype) {
  EXPECT_THAT(header_error("{" + entry("w", "BF32", "[1]", 0, 4) + "}", 4),
              HasSubstr("/m/model.safetensors: tensor 'w': unknown dtype 'BF32'"));
}

TEST(SafetensorsHeader, RejectsAShapeThatIsNotAnArray) {
  EXPECT_THAT(header_error("{" + entry("w", "U8", "4", 0, 4) + "}", 4),
              HasSubstr("tensor 'w': shape is an integer, not an array of integers"));
}

TEST(SafetensorsHeader, RejectsANegativeDimension) {
  EXPECT_THAT(header_error("{" + entry("w", "U8", "[2, -3]", 0, 4) + "}", 4),
              HasSubstr("/m/model.safetensors: tensor 'w': shape has a negative dimension -3"));
}

TEST(SafetensorsHeader, RejectsAFloatDimension) {
  EXPECT_THAT(header_error("{" + entry("w", "U8", "[2.0]", 0, 2) + "}", 2),
              HasSubstr("tensor 'w': shape has a dimension 2.0 that is not a non-negative integer"));
  // Beyond 64 bits an integer can only be read as a float: still not a dimension.
  EXPECT_THAT(header_error("{" + entry("w", "U8", "[18446744073709551616]", 0, 2) + "}", 2),
              HasSubstr("shape has a dimension 18446744073709551616 that is not a non-negative integer"));
}

TEST(SafetensorsHeader, RejectsADimensionThatIsNotANumber) {
  EXPECT_THAT(header_error("{" + entry("w", "U8", "[\"2\"]", 0, 2) + "}", 2),
              HasSubstr("tensor 'w': shape has a string, not a non-negative integer"));
  EXPECT_THAT(header_error("{" + entry("w", "U8", "[[2]]", 0, 2) + "}", 2),
              HasSubstr("tensor 'w': shape has an array, not a non-negative integer"));
}

TEST(SafetensorsHeader, RejectsADimensionAbove2To63) {
  EXPECT_THAT(header_error("{" + entry("w", "U8", "[9223372036854775808]", 0, 2) + "}", 2),
              HasSubstr("shape has a dimension 9223372036854775808 larger than 2^63 - 1"));
}

TEST(SafetensorsHeader, RejectsMoreThanMaxRankDimensions) {
  std::string shape = "[1";
  for (size_t i = 1; i <= kMaxTensorRank; ++i) shape += ",1";
  shape += "]";
  EXPECT_THAT(header_error("{" + entry("w", "U8", shape, 0, 1) + "}", 1),
              HasSubstr("tensor 'w': shape has more than 64 dimensions"));
}

TEST(SafetensorsHeader, RejectsOffsetsThatAreNotTwoIntegers) {
  EXPECT_THAT(header_error("{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0]}}", 1),
              HasSubstr("tensor 'w': data_offsets has 1 values, not 2"));
  EXPECT_THAT(header_error("{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1,2]}}", 1),
              HasSubstr("tensor 'w': data_offsets has more than 2 values"));
  EXPECT_THAT(header_error("{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":{}}}", 1),
              HasSubstr("tensor 'w': data_offsets is an object, not an array of 2 integers"));
  EXPECT_THAT(header_error("{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1.5]}}", 1),
              HasSubstr("tensor 'w': data_offsets has 1.5, not a non-negative integer"));
}

TEST(SafetensorsHeader, RejectsANegativeOffset) {
  EXPECT_THAT(header_error("{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[-1,0]}}", 1),
              HasSubstr("tensor 'w': data_offsets has a negative offset -1"));
}

TEST(SafetensorsHeader, RejectsOffsetsThatBeginAfterTheyEnd) {
  EXPECT_THAT(header_error("{" + entry("w", "U8", "[0]", 4, 2) + "}", 4),
              HasSubstr("/m/model.safetensors: tensor 'w': data_offsets [4, 2) begin after they end"));
}

TEST(SafetensorsHeader, RejectsARangeOfTheWrongSize) {
  EXPECT_THAT(header_error("{" + entry("model.embed_tokens.weight", "BF16", "[10, 10]", 0, 100) + "}", 100),
              HasSubstr("/m/model.safetensors: tensor 'model.embed_tokens.weight': data_offsets [0, 100) hold 100 "
                        "bytes but BF16 [10, 10] needs 200"));
}

TEST(SafetensorsHeader, RejectsAnElementCountOver64Bits) {
  EXPECT_THAT(header_error("{" + entry("w", "U8", "[4294967296, 4294967296]", 0, 0) + "}"),
              HasSubstr("tensor 'w': shape [4294967296, 4294967296] has more than 2^64 elements"));
}

TEST(SafetensorsHeader, RejectsABitCountOver64Bits) {
  EXPECT_THAT(header_error("{" + entry("w", "F64", "[4294967296, 268435456]", 0, 0) + "}"),
              HasSubstr("tensor 'w': F64 [4294967296, 268435456] has more than 2^64 bits"));
}

TEST(SafetensorsHeader, RejectsASubByteTensorThatEndsMidByte) {
  EXPECT_THAT(header_error("{" + entry("w", "F4", "[3]", 0, 2) + "}", 2),
              HasSubstr("tensor 'w': F4 [3] holds 12 bits, not a whole number of bytes"));
  EXPECT_THAT(header_error("{" + entry("w", "F6_E2M3", "[5]", 0, 4) + "}", 4),
              HasSubstr("tensor 'w': F6_E2M3 [5] holds 30 bits, not a whole number of bytes"));
}

TEST(SafetensorsHeader, RejectsAFirstTensorThatDoesNotBeginAtZero) {
  EXPECT_THAT(header_error("{" + entry("w", "U8", "[2]", 4, 6) + "}", 6),
              HasSubstr("/m/model.safetensors: tensor 'w': data_offsets [4, 6) begin at 4: the first tensor must "
                        "begin at 0"));
}

TEST(SafetensorsHeader, RejectsAGapBetweenTensors) {
  std::string json = "{" + entry("a", "U8", "[4]", 0, 4) + "," + entry("b", "U8", "[2]", 6, 8) + "}";
  EXPECT_THAT(header_error(json, 8),
              HasSubstr("/m/model.safetensors: tensor 'b': data_offsets [6, 8) leave a gap of 2 bytes after tensor "
                        "'a' [0, 4)"));
}

TEST(SafetensorsHeader, RejectsOverlappingTensors) {
  std::string json = "{" + entry("a", "U8", "[4]", 0, 4) + "," + entry("b", "U8", "[4]", 2, 6) + "}";
  EXPECT_THAT(header_error(json, 6),
              HasSubstr("/m/model.safetensors: tensor 'b': data_offsets [2, 6) overlap tensor 'a' [0, 4)"));
}

TEST(SafetensorsHeader, RejectsDataThatDoesNotEndAtTheEndOfTheFile) {
  std::string json = "{" + entry("a", "U8", "[4]", 0, 4) + "}";
  EXPECT_THAT(header_error(json, 5), HasSubstr("/m/model.safetensors: tensor data ends at byte " +
                                               std::to_string(8 + json.size() + 4) + " (8 + header " +
                                               std::to_string(json.size()) + " + data 4) but the file has " +
                                               std::to_string(8 + json.size() + 5) + " bytes"));
  EXPECT_THAT(header_error(json, 3), HasSubstr("but the file has " + std::to_string(8 + json.size() + 3) + " bytes"));
}

TEST(SafetensorsHeader, RejectsOffsetsNear2To64WithoutWrapping) {
  // Sixteen contiguous tensors of about 2^60 bytes end at 2^64 - 1: adding the header wraps.
  constexpr uint64_t kPiece = uint64_t{1} << 60;
  std::string json = "{";
  for (uint64_t i = 0; i < 16; ++i) {
    uint64_t size = i == 15 ? kPiece - 1 : kPiece;
    if (i > 0) json += ",";
    json += entry("t" + std::to_string(i), "U8", "[" + std::to_string(size) + "]", i * kPiece, i * kPiece + size);
  }
  json += "}";
  EXPECT_THAT(header_error(json, 4), HasSubstr("tensor data ends at byte 2^64+ (8 + header"));
}

TEST(SafetensorsHeader, MessagesNameTheFileForHeaderLengthChecksToo) {
  EXPECT_THAT(error_text([] { parse_safetensors_header("s3://b/k.safetensors", "{}", 4); }),
              StartsWith("s3://b/k.safetensors: header length 2 does not fit the file of 4 bytes"));
}

TEST(SafetensorsHeader, QuotesHostileNamesOnOneLine) {
  std::string json = "{" + entry("a\\nb", "U8", "[2]", 0, 1) + "}";
  EXPECT_THAT(header_error(json, 1), HasSubstr("tensor 'a\\x0ab'"));
}

TEST(SafetensorsHeader, AcceptsAnEmptyCheckpoint) {
  auto header = parse_header("{}");
  EXPECT_TRUE(header.tensors.empty());
  EXPECT_EQ(header.data_offset(), 10u);
  EXPECT_THAT(header_error("{}", 1), HasSubstr("tensor data ends at byte 10"));
}

TEST(SafetensorsHeader, SortsTensorsByOffsetAndKeepsZeroSizedOnes) {
  std::string json = "{" + entry("c", "F32", "[2]", 4, 12) + "," + entry("empty", "F32", "[0, 5]", 4, 4) + "," +
                     entry("a", "BF16", "[2]", 0, 4) + "," + entry("scalar", "I64", "[]", 12, 20) + "}";
  auto header = parse_header(json, 20);
  ASSERT_EQ(header.tensors.size(), 4u);
  EXPECT_EQ(header.tensors[0].name, "a");
  EXPECT_EQ(header.tensors[1].name, "empty");
  EXPECT_EQ(header.tensors[2].name, "c");
  EXPECT_EQ(header.tensors[3].name, "scalar");
  EXPECT_EQ(header.tensors[2].dtype, Dtype::kF32);
  EXPECT_EQ(header.tensors[2].shape, (std::vector<int64_t>{2}));
  EXPECT_EQ(header.tensors[3].bytes(), 8u);
  EXPECT_TRUE(header.tensors[3].shape.empty());
}

TEST(SafetensorsHeader, AcceptsEveryDtype) {
  struct Case {
    const char* name;
    const char* shape;
    uint64_t bytes;
  };
  const Case cases[] = {{"BOOL", "[3]", 3},   {"U8", "[3]", 3},          {"I8", "[3]", 3},
                        {"I16", "[3]", 6},    {"U16", "[3]", 6},         {"F16", "[3]", 6},
                        {"BF16", "[3]", 6},   {"I32", "[3]", 12},        {"U32", "[3]", 12},
                        {"F32", "[3]", 12},   {"F64", "[3]", 24},        {"I64", "[3]", 24},
                        {"U64", "[3]", 24},   {"C64", "[3]", 24},        {"F8_E4M3", "[3]", 3},
                        {"F8_E5M2", "[3]", 3}, {"F8_E8M0", "[3]", 3},    {"F8_E4M3FNUZ", "[3]", 3},
                        {"F8_E5M2FNUZ", "[3]", 3}, {"F4", "[2, 3]", 3},  {"F6_E2M3", "[4]", 3},
                        {"F6_E3M2", "[8]", 6}};
  for (const Case& c : cases) {
    auto header = parse_header("{" + entry("t", c.name, c.shape, 0, c.bytes) + "}", c.bytes);
    ASSERT_EQ(header.tensors.size(), 1u) << c.name;
    EXPECT_EQ(dtype_name(header.tensors[0].dtype), c.name);
  }
}

}  // namespace
}  // namespace weightstream
