// Parsing and validation of safetensors headers. The rules are those of the reference
// implementation (huggingface/safetensors, `Metadata::validate`): a JSON object of tensor
// entries and an optional `__metadata__` string map, each tensor's byte range exactly its
// dtype and shape, the ranges contiguous from 0 and ending at the end of the file.
//
// The header is untrusted and may be 100 MB, so it is read with a SAX handler that builds
// TensorInfo directly and checks types as it goes, rather than through a JSON tree that
// could take several times the header's size.

#include <cstdio>
#include <algorithm>
#include <cstring>
#include <limits>
#include <unordered_set>

#include "format/shared/json_text.hpp"
#include "weightstream/error.hpp"
#include "weightstream/format.hpp"

namespace weightstream {
namespace {

using Json = nlohmann::json;
using detail::quoted_name;

constexpr std::string_view kMetadataKey = "__metadata__";

std::string range_text(uint64_t begin, uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}

// Builds the tensors of a header from SAX events. Container depth 1 is the top-level
// object, depth 2 a tensor entry or `__metadata__`, depth 3 a shape or data_offsets array.
class HeaderReader {
 public:
  explicit HeaderReader(std::string_view object) : object_(object) {}

  SafetensorsHeader& header() { return header_; }

  bool null() { return scalar("null", Json::value_t::null); }
  bool boolean(bool) { return scalar("a boolean", Json::value_t::boolean); }
  bool number_integer(Json::number_integer_t value) {
    if (value >= 0) return number_unsigned(static_cast<uint64_t>(value));
    if (place_ == Place::kShape) fail_tensor("shape has a negative dimension " + std::to_string(value));
    if (place_ == Place::kOffsets) fail_tensor("data_offsets has a negative offset " + std::to_string(value));
    return scalar("a negative integer", Json::value_t::number_integer);
  }
  bool number_unsigned(Json::number_unsigned_t value) {
    if (place_ == Place::kShape) {
      if (value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        fail_tensor("shape has a dimension " + std::to_string(value) + " larger than 2^63 - 1");
      }
      if (entry_.shape.size() == kMaxTensorRank) {
        fail_tensor("shape has more than " + std::to_string(kMaxTensorRank) + " dimensions");
      }
      entry_.shape.push_back(static_cast<int64_t>(value));
      return true;
    }
    if (place_ == Place::kOffsets) {
      if (offsets_count_ == 2) fail_tensor("data_offsets has more than 2 values");
      (offsets_count_ == 0 ? entry_.data_begin : entry_.data_end) = value;
      ++offsets_count_;
      return true;
    }
    return scalar("an integer", Json::value_t::number_unsigned);
  }
  bool number_float(Json::number_float_t, const std::string& text) {
    // Integers beyond 64 bits also arrive here.
    if (place_ == Place::kShape) fail_tensor("shape has a dimension " + text + " that is not a non-negative integer");
    if (place_ == Place::kOffsets) fail_tensor("data_offsets has " + text + ", not a non-negative integer");
    return scalar("a floating-point number", Json::value_t::number_float);
  }
  bool string(std::string& value) {
    if (place_ == Place::kMetadata) {
      header_.metadata[metadata_key_] = std::move(value);
      return true;
    }
    if (place_ == Place::kEntry && field_ == Field::kDtype) {
      std::optional<Dtype> dtype = dtype_from_name(value);
      if (!dtype) fail_tensor("unknown dtype " + quoted_name(value));
      entry_.dtype = *dtype;
      return true;
    }
    return scalar("a string", Json::value_t::string);
  }
  bool binary(Json::binary_t&) { return scalar("binary", Json::value_t::binary); }

  bool key(std::string& key) {
    if (place_ == Place::kTop) {
      if (key == kMetadataKey) {
        if (seen_metadata_) fail("key '__metadata__' appears twice");
        seen_metadata_ = true;
        expect_metadata_ = true;
        return true;
      }
      expect_metadata_ = false;
      check_tensor_name(key);
      if (!names_.insert(key).second) fail("tensor " + quoted_name(key) + " appears twice in the header");
      entry_ = TensorInfo{};
      entry_.name = std::move(key);
      return true;
    }
    if (place_ == Place::kMetadata) {
      if (header_.metadata.count(key) != 0) fail("__metadata__ key " + quoted_name(key) + " appears twice");
      metadata_key_ = std::move(key);
      return true;
    }
    // place_ == kEntry
    Field field = key == "dtype" ? Field::kDtype
                  : key == "shape" ? Field::kShape
                  : key == "data_offsets" ? Field::kOffsets
                                          : Field::kNone;
    if (field == Field::kNone) {
      fail_tensor("unknown field " + quoted_name(key) + ": an entry holds exactly dtype, shape and data_offsets");
    }
    unsigned bit = 1u << static_cast<unsigned>(field);
    if (fields_seen_ & bit) fail_tensor("field " + quoted_name(key) + " appears twice");
    fields_seen_ |= bit;
    field_ = field;
    return true;
  }

  bool start_object(size_t) {
    switch (place_) {
      case Place::kStart:
        place_ = Place::kTop;
        return true;
      case Place::kTop:
        if (expect_metadata_) {
          place_ = Place::kMetadata;
        } else {
          place_ = Place::kEntry;
          fields_seen_ = 0;
          field_ = Field::kNone;
        }
        return true;
      default:
        return scalar("an object", Json::value_t::object);
    }
  }
  bool end_object() {
    if (place_ == Place::kMetadata) {
      place_ = Place::kTop;
    } else if (place_ == Place::kEntry) {
      finish_entry();
      place_ = Place::kTop;
    } else {
      place_ = Place::kEnd;
    }
    return true;
  }
  bool start_array(size_t) {
    if (place_ == Place::kEntry && field_ == Field::kShape) {
      place_ = Place::kShape;
      return true;
    }
    if (place_ == Place::kEntry && field_ == Field::kOffsets) {
      place_ = Place::kOffsets;
      offsets_count_ = 0;
      return true;
    }
    return scalar("an array", Json::value_t::array);
  }
  bool end_array() {
    if (place_ == Place::kOffsets && offsets_count_ != 2) {
      fail_tensor("data_offsets has " + std::to_string(offsets_count_) + " values, not 2");
    }
    place_ = Place::kEntry;
    return true;
  }

  bool parse_error(size_t position, const std::string&, const Json::exception& error) {
    fail("header is not valid JSON: " + detail::json_error_text(error));
  }

 private:
  enum class Place { kStart, kTop, kMetadata, kEntry, kShape, kOffsets, kEnd };
  enum class Field : unsigned { kDtype, kShape, kOffsets, kNone };

  [[noreturn]] void fail(const std::string& rule) const {
    WS_FAIL(ErrorCode::kFormat, std::string(object_) + ": " + rule);
  }
  void check_tensor_name(std::string_view key) const {
    if (auto fault = detail::tensor_name_fault(key)) {
      fail((key.empty() ? std::string("a tensor name") : "tensor " + quoted_name(key)) + " " + *fault +
           (key.empty() ? "" : " of its name") + "; " + std::string(detail::kTensorNameRule));
    }
  }

  [[noreturn]] void fail_tensor(const std::string& rule) const { fail("tensor " + quoted_name(entry_.name) + ": " + rule); }

  // A value that arrived where the format does not allow its type.
  bool scalar(std::string_view what, Json::value_t type) {
    switch (place_) {
      case Place::kStart:
        fail("header is " + std::string(what) + ", not a JSON object");
      case Place::kTop:
        if (expect_metadata_) {
          if (type == Json::value_t::null) return true;  // the reference reads null as "no metadata"
          fail("__metadata__ is " + std::string(what) + ", not an object of strings");
        }
        fail_tensor("entry is " + std::string(what) + ", not an object with dtype, shape and data_offsets");
      case Place::kMetadata:
        fail("__metadata__ value of " + quoted_name(metadata_key_) + " is " + std::string(what) + ", not a string");
      case Place::kEntry:
        if (field_ == Field::kDtype) fail_tensor("dtype is " + std::string(what) + ", not a string");
        if (field_ == Field::kShape) fail_tensor("shape is " + std::string(what) + ", not an array of integers");
        fail_tensor("data_offsets is " + std::string(what) + ", not an array of 2 integers");
      case Place::kShape:
        fail_tensor("shape has " + std::string(what) + ", not a non-negative integer");
      case Place::kOffsets:
        fail_tensor("data_offsets has " + std::string(what) + ", not a non-negative integer");
      case Place::kEnd:
        break;
    }
    fail("unexpected " + std::string(what) + " after the header object");
  }

  void finish_entry() {
    static constexpr std::string_view kFieldNames[] = {"dtype", "shape", "data_offsets"};
    for (unsigned field = 0; field < 3; ++field) {
      if (!(fields_seen_ & (1u << field))) fail_tensor("missing field " + std::string(kFieldNames[field]));
    }
    if (entry_.data_begin > entry_.data_end) {
      fail_tensor("data_offsets " + range_text(entry_.data_begin, entry_.data_end) + " begin after they end");
    }
    std::string_view dtype = dtype_name(entry_.dtype);
    std::optional<uint64_t> count = tensor_element_count(entry_.shape);
    if (!count) fail_tensor("shape " + shape_text(entry_.shape) + " has more than 2^64 elements");
    uint64_t bits = 0;
    if (__builtin_mul_overflow(*count, uint64_t{dtype_bits(entry_.dtype)}, &bits)) {
      fail_tensor(std::string(dtype) + " " + shape_text(entry_.shape) + " has more than 2^64 bits");
    }
    if (bits % 8 != 0) {
      fail_tensor(std::string(dtype) + " " + shape_text(entry_.shape) + " holds " + std::to_string(bits) +
                  " bits, not a whole number of bytes");
    }
    if (entry_.bytes() != bits / 8) {
      fail_tensor("data_offsets " + range_text(entry_.data_begin, entry_.data_end) + " hold " +
                  std::to_string(entry_.bytes()) + " bytes but " + std::string(dtype) + " " +
                  shape_text(entry_.shape) + " needs " + std::to_string(bits / 8));
    }
    header_.tensors.push_back(std::move(entry_));
  }

  std::string_view object_;
  SafetensorsHeader header_;
  Place place_ = Place::kStart;
  Field field_ = Field::kNone;
  unsigned fields_seen_ = 0;
  unsigned offsets_count_ = 0;
  bool expect_metadata_ = false;
  bool seen_metadata_ = false;
  std::string metadata_key_;
  TensorInfo entry_;
  std::unordered_set<std::string> names_;
};

}  // namespace

uint64_t parse_header_length(std::string_view object, std::span<const std::byte> prefix, uint64_t file_size) {
  std::string name(object);
  WS_EXPECT(file_size >= 8, ErrorCode::kFormat,
            name + ": file of " + std::to_string(file_size) +
                " bytes is too small for a safetensors file: the 8-byte header length is missing");
  WS_EXPECT(prefix.size() >= 8, ErrorCode::kFormat,
            name + ": " + std::to_string(prefix.size()) + " bytes given where the 8-byte header length is needed");
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | static_cast<uint8_t>(prefix[i]);
  WS_EXPECT(length <= kMaxHeaderLength, ErrorCode::kFormat,
            name + ": header length " + std::to_string(length) + " exceeds the limit of " +
                std::to_string(kMaxHeaderLength) + " bytes");
  WS_EXPECT(length <= file_size - 8, ErrorCode::kFormat,
            name + ": header length " + std::to_string(length) + " does not fit the file of " +
                std::to_string(file_size) + " bytes (8 + " + std::to_string(length) + " > " +
                std::to_string(file_size) + ")");
  return length;
}

SafetensorsHeader parse_safetensors_header(std::string_view object, std::string_view header_json, uint64_t file_size) {
  std::string name(object);
  uint64_t length = header_json.size();
  WS_EXPECT(length <= kMaxHeaderLength, ErrorCode::kFormat,
            name + ": header length " + std::to_string(length) + " exceeds the limit of " +
                std::to_string(kMaxHeaderLength) + " bytes");
  WS_EXPECT(file_size >= 8 && length <= file_size - 8, ErrorCode::kFormat,
            name + ": header length " + std::to_string(length) + " does not fit the file of " +
                std::to_string(file_size) + " bytes");
  if (auto bad = detail::invalid_utf8_offset(header_json)) {
    WS_FAIL(ErrorCode::kFormat, name + ": header is not valid UTF-8 at byte " + std::to_string(*bad));
  }

  // nlohmann's lexer takes a NUL byte for the end of its input and would accept "{}\0junk";
  // a raw NUL is never valid JSON, and the reference rejects NUL padding.
  if (size_t nul = header_json.find('\0'); nul != std::string_view::npos) {
    WS_FAIL(ErrorCode::kFormat, name + ": header is not valid JSON: NUL byte at byte " + std::to_string(nul));
  }
  HeaderReader reader(object);
  // strict: nothing but whitespace may follow the object (the reference writer pads with spaces).
  Json::sax_parse(header_json.begin(), header_json.end(), &reader, nlohmann::detail::input_format_t::json,
                  /*strict=*/true);
  SafetensorsHeader header = std::move(reader.header());
  header.header_length = length;

  // Order by range; a zero-byte tensor sorts before a tensor starting at the same offset.
  std::stable_sort(header.tensors.begin(), header.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.data_begin != b.data_begin ? a.data_begin < b.data_begin : a.data_end < b.data_end;
  });
  uint64_t expected_begin = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo& tensor : header.tensors) {
    if (tensor.data_begin != expected_begin) {
      std::string rule = "tensor " + quoted_name(tensor.name) + ": data_offsets " +
                         range_text(tensor.data_begin, tensor.data_end);
      if (previous == nullptr) {
        rule += " begin at " + std::to_string(tensor.data_begin) + ": the first tensor must begin at 0";
      } else if (tensor.data_begin > expected_begin) {
        rule += " leave a gap of " + std::to_string(tensor.data_begin - expected_begin) + " bytes after tensor " +
                quoted_name(previous->name) + " " + range_text(previous->data_begin, previous->data_end);
      } else {
        rule += " overlap tensor " + quoted_name(previous->name) + " " + range_text(previous->data_begin, previous->data_end);
      }
      WS_FAIL(ErrorCode::kFormat, name + ": " + rule);
    }
    expected_begin = tensor.data_end;
    previous = &tensor;
  }
  // A hostile header can put the data end near 2^64, where adding the header would wrap.
  uint64_t data_size = expected_begin;
  bool fits = data_size <= std::numeric_limits<uint64_t>::max() - header.data_offset();
  WS_EXPECT(fits && header.data_offset() + data_size == file_size, ErrorCode::kFormat,
            name + ": tensor data ends at byte " + (fits ? std::to_string(header.data_offset() + data_size) : "2^64+") +
                " (8 + header " + std::to_string(length) + " + data " + std::to_string(data_size) +
                ") but the file has " + std::to_string(file_size) + " bytes");
  return header;
}

SafetensorsHeader parse_safetensors_bytes(std::string_view object, std::span<const std::byte> file) {
  uint64_t length = parse_header_length(object, file.first(std::min<size_t>(file.size(), 8)), file.size());
  std::string_view json(reinterpret_cast<const char*>(file.data()) + 8, length);
  return parse_safetensors_header(object, json, file.size());
}

}  // namespace weightstream
