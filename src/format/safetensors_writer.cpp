// Writing safetensors files that the reference implementation reads: the 8-byte
// little-endian header length, the JSON header padded with spaces to a multiple of 8
// (as the reference writer pads, so the data section stays 8-byte aligned), then the
// tensors' bytes in header order.

#include <set>

#include "format/shared/json_text.hpp"
#include "format/shared/output_file.hpp"
#include "weightstream/error.hpp"
#include "weightstream/format.hpp"

namespace weightstream {
namespace {

uint64_t spec_byte_size(const TensorSpec& spec) {
  std::optional<uint64_t> bytes = tensor_byte_size(spec.dtype, spec.shape);
  WS_EXPECT(bytes.has_value(), ErrorCode::kInvalidArgument,
            "tensor " + detail::quoted_name(spec.name) + ": " + std::string(dtype_name(spec.dtype)) + " " +
                shape_text(spec.shape) +
                " has a negative dimension, overflows 64 bits or is not a whole number of bytes");
  return *bytes;
}

}  // namespace

std::string safetensors_header_bytes(std::span<const TensorSpec> specs,
                                     const std::map<std::string, std::string>& metadata) {
  std::string json = "{";
  auto expect_utf8 = [](const std::string& text, std::string_view what) {
    WS_EXPECT(!detail::invalid_utf8_offset(text), ErrorCode::kInvalidArgument,
              std::string(what) + " " + detail::quoted_name(text) + " is not valid UTF-8");
  };
  for (const auto& [key, value] : metadata) {
    expect_utf8(key, "__metadata__ key");
    expect_utf8(value, "__metadata__ value");
  }
  if (!metadata.empty()) json += "\"__metadata__\":" + nlohmann::json(metadata).dump() + ",";
  std::set<std::string_view> names;
  uint64_t offset = 0;
  for (const TensorSpec& spec : specs) {
    WS_EXPECT(spec.name != "__metadata__", ErrorCode::kInvalidArgument,
              "tensor name '__metadata__' is reserved by the safetensors format");
    expect_utf8(spec.name, "tensor name");
    if (auto fault = detail::tensor_name_fault(spec.name)) {
      WS_FAIL(ErrorCode::kInvalidArgument, (spec.name.empty() ? std::string("a tensor name") : "tensor " +
                                            detail::quoted_name(spec.name)) + " " + *fault + "; " +
                                               std::string(detail::kTensorNameRule));
    }
    WS_EXPECT(names.insert(spec.name).second, ErrorCode::kInvalidArgument,
              "tensor " + detail::quoted_name(spec.name) + " is added twice");
    WS_EXPECT(spec.shape.size() <= kMaxTensorRank, ErrorCode::kInvalidArgument,
              "tensor " + detail::quoted_name(spec.name) + ": more than " + std::to_string(kMaxTensorRank) + " dimensions");
    uint64_t begin = offset;
    offset += spec_byte_size(spec);
    json += nlohmann::json(spec.name).dump();
    json += ":{\"dtype\":\"";
    json += dtype_name(spec.dtype);
    json += "\",\"shape\":[";
    for (size_t i = 0; i < spec.shape.size(); ++i) {
      if (i > 0) json += ',';
      json += std::to_string(spec.shape[i]);
    }
    json += "],\"data_offsets\":[" + std::to_string(begin) + "," + std::to_string(offset) + "]},";
  }
  if (json.back() == ',') json.pop_back();
  json += "}";
  json.resize((json.size() + 7) / 8 * 8, ' ');
  WS_EXPECT(json.size() <= kMaxHeaderLength, ErrorCode::kInvalidArgument,
            "header of " + std::to_string(json.size()) + " bytes exceeds the limit of " +
                std::to_string(kMaxHeaderLength));
  std::string bytes(8, '\0');
  uint64_t length = json.size();
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  return bytes + json;
}

void SafetensorsWriter::add(std::string name, Dtype dtype, std::vector<int64_t> shape,
                            std::span<const std::byte> data) {
  uint64_t expected = spec_byte_size(TensorSpec{name, dtype, shape});
  WS_EXPECT(data.size() == expected, ErrorCode::kInvalidArgument,
            "tensor " + detail::quoted_name(name) + ": " + std::to_string(data.size()) + " bytes given but " +
                std::string(dtype_name(dtype)) + " " + shape_text(shape) + " needs " + std::to_string(expected));
  WS_EXPECT(!names_.contains(name), ErrorCode::kInvalidArgument,
            "tensor " + detail::quoted_name(name) + " is added twice");
  names_.insert(name);
  entries_.push_back(Entry{std::move(name), dtype, std::move(shape), {data.begin(), data.end()}});
}

void SafetensorsWriter::set_metadata(std::string key, std::string value) {
  metadata_[std::move(key)] = std::move(value);
}

std::string SafetensorsWriter::header_bytes() const {
  std::vector<TensorSpec> specs;
  specs.reserve(entries_.size());
  for (const Entry& entry : entries_) specs.push_back(TensorSpec{entry.name, entry.dtype, entry.shape});
  return safetensors_header_bytes(specs, metadata_);
}

uint64_t SafetensorsWriter::file_size() const {
  uint64_t size = header_bytes().size();
  for (const Entry& entry : entries_) size += entry.data.size();
  return size;
}

void SafetensorsWriter::write(const std::filesystem::path& path) const {
  std::string header = header_bytes();
  detail::OutputFile file(path);
  file.write(header.data(), header.size());
  for (const Entry& entry : entries_) file.write(entry.data.data(), entry.data.size());
  file.close();
}

void SafetensorsWriter::write_streaming(const std::filesystem::path& path, std::span<const TensorSpec> specs,
                                        const TensorFill& fill, const std::map<std::string, std::string>& metadata) {
  std::string header = safetensors_header_bytes(specs, metadata);
  detail::OutputFile file(path);
  file.write(header.data(), header.size());
  std::vector<std::byte> chunk;
  for (size_t index = 0; index < specs.size(); ++index) {
    uint64_t size = spec_byte_size(specs[index]);
    for (uint64_t offset = 0; offset < size; offset += kStreamChunkBytes) {
      size_t length = static_cast<size_t>(std::min<uint64_t>(kStreamChunkBytes, size - offset));
      if (chunk.size() < length) chunk.resize(kStreamChunkBytes);
      std::span<std::byte> out(chunk.data(), length);
      fill(index, offset, out);
      file.write(out.data(), out.size());
    }
  }
  file.close();
}

}  // namespace weightstream
