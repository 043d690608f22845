// model.safetensors.index.json: which shard holds each tensor. Shard names come from an
// untrusted file and are joined to a directory or URI prefix by the callers, so anything
// but a plain file name is rejected here.

#include "format/shared/json_text.hpp"
#include "weightstream/error.hpp"
#include "weightstream/format.hpp"

#include <algorithm>
#include <cmath>
#include <set>

namespace weightstream {
namespace {

using Json = nlohmann::json;
using detail::quoted_name;

constexpr std::string_view kShardSuffix = ".safetensors";

// Why `shard` is not a plain shard file name, or empty when it is one.
std::string shard_name_problem(std::string_view shard) {
  if (shard.empty()) return "is empty";
  if (shard.find('\0') != std::string_view::npos) return "contains a NUL byte";
  if (shard.front() == '/') return "is an absolute path";
  if (shard.find('/') != std::string_view::npos) return "contains '/': shards must sit beside the index";
  if (shard.find('\\') != std::string_view::npos) return "contains '\\\\': shards must sit beside the index";
  if (shard == "." || shard == "..") return "is a directory reference";
  if (shard.size() <= kShardSuffix.size() || !shard.ends_with(kShardSuffix)) return "does not end in .safetensors";
  return {};
}

}  // namespace

CheckpointIndex parse_checkpoint_index(std::string_view object, std::string_view json) {
  std::string name(object);
  Json document = detail::parse_json_strictly(object, json);
  WS_EXPECT(document.is_object(), ErrorCode::kFormat,
            name + ": index is " + std::string(detail::json_type_text(document.type())) + ", not a JSON object");
  auto weight_map = document.find("weight_map");
  WS_EXPECT(weight_map != document.end(), ErrorCode::kFormat, name + ": index has no weight_map");
  WS_EXPECT(weight_map->is_object(), ErrorCode::kFormat,
            name + ": weight_map is " + std::string(detail::json_type_text(weight_map->type())) +
                ", not an object of tensor names to shard files");

  CheckpointIndex index;
  std::set<std::string, decltype([](const std::string& a, const std::string& b) { return natural_less(a, b); })>
      shards;
  for (auto& [tensor, shard] : weight_map->items()) {
    WS_EXPECT(shard.is_string(), ErrorCode::kFormat,
              name + ": weight_map tensor " + quoted_name(tensor) + ": shard is " +
                  std::string(detail::json_type_text(shard.type())) + ", not a file name");
    const auto& shard_name = shard.get_ref<const std::string&>();
    std::string problem = shard_name_problem(shard_name);
    WS_EXPECT(problem.empty(), ErrorCode::kFormat,
              name + ": weight_map tensor " + quoted_name(tensor) + ": shard " + quoted_name(shard_name) + " " + problem);
    shards.insert(shard_name);
    index.weight_map.emplace(tensor, shard_name);
  }
  index.shards.assign(shards.begin(), shards.end());

  auto metadata = document.find("metadata");
  if (metadata != document.end() && !metadata->is_null()) {
    WS_EXPECT(metadata->is_object(), ErrorCode::kFormat,
              name + ": metadata is " + std::string(detail::json_type_text(metadata->type())) + ", not an object");
    auto total = metadata->find("total_size");
    if (total != metadata->end() && !total->is_null()) {
      if (total->is_number_unsigned()) {
        index.total_size = total->get<uint64_t>();
      } else if (total->is_number_float() && total->get<double>() >= 0 && total->get<double>() < 0x1p63 &&
                 std::floor(total->get<double>()) == total->get<double>()) {
        // Some exporters write the total as a float (16060522496.0); a whole value is accepted.
        index.total_size = static_cast<uint64_t>(total->get<double>());
      } else {
        WS_FAIL(ErrorCode::kFormat, name + ": metadata.total_size = " + total->dump() +
                                        ": must be a non-negative integer");
      }
    }
  }
  return index;
}

std::string index_json(const CheckpointIndex& index) {
  Json document = Json::object();
  Json metadata = Json::object();
  if (index.total_size) metadata["total_size"] = *index.total_size;
  document["metadata"] = std::move(metadata);
  document["weight_map"] = Json(index.weight_map);
  return document.dump(2) + "\n";
}

bool natural_less(std::string_view a, std::string_view b) noexcept {
  auto is_digit = [](char c) { return c >= '0' && c <= '9'; };
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (is_digit(a[i]) && is_digit(b[j])) {
      // Compare digit runs by value: skip leading zeros, then the longer run is larger,
      // and runs of one length compare digit by digit. No conversion, so no overflow.
      size_t a_start = i, b_start = j;
      while (a_start < a.size() && a[a_start] == '0') ++a_start;
      while (b_start < b.size() && b[b_start] == '0') ++b_start;
      size_t a_end = a_start, b_end = b_start;
      while (a_end < a.size() && is_digit(a[a_end])) ++a_end;
      while (b_end < b.size() && is_digit(b[b_end])) ++b_end;
      size_t a_length = a_end - a_start, b_length = b_end - b_start;
      if (a_length != b_length) return a_length < b_length;
      int order = a.substr(a_start, a_length).compare(b.substr(b_start, b_length));
      if (order != 0) return order < 0;
      i = a_end;
      j = b_end;
      continue;
    }
    if (a[i] != b[j]) return static_cast<unsigned char>(a[i]) < static_cast<unsigned char>(b[j]);
    ++i;
    ++j;
  }
  if (i != a.size() || j != b.size()) return a.size() - i < b.size() - j;
  // Equal in natural order ("a01" and "a1"): fall back to bytes so the order stays strict.
  return a < b;
}

}  // namespace weightstream
