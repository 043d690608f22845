// The layers a checkpoint holds, checked against config.json before a layout is built from
// it. config.json is untrusted and build_model_layout allocates per layer (thousands of
// bytes per parameter, several parameters per layer): issue 7 was 65536 layers over a
// one-layer checkpoint, 393219 parameters and std::bad_alloc under a 512 MiB limit.
#include <charconv>
#include <set>

#include "weightstream/error.hpp"
#include "weightstream/model.hpp"

namespace weightstream {
namespace {

constexpr std::string_view kLayerPlaceholder = "{layer}";

// What per-layer tensor names start with: the text before {layer} in the mapping rules.
std::set<std::string, std::less<>> layer_prefixes(const ModelConfig& config) {
  std::set<std::string, std::less<>> prefixes;
  for (const MappingRule& rule : mapping_rules(config)) {
    if (size_t at = rule.tensor.find(kLayerPlaceholder); at != std::string::npos) {
      prefixes.insert(rule.tensor.substr(0, at));
    }
  }
  return prefixes;
}

// The index in `name` = prefix + digits + "." + rest, or nullopt.
std::optional<int64_t> layer_index(std::string_view name, std::string_view prefix) {
  if (!name.starts_with(prefix)) return std::nullopt;
  std::string_view rest = name.substr(prefix.size());
  int64_t index = -1;
  auto [end, error] = std::from_chars(rest.data(), rest.data() + rest.size(), index);
  if (error != std::errc() || index < 0 || end == rest.data() + rest.size() || *end != '.') return std::nullopt;
  return index;
}

}  // namespace

int64_t checkpoint_layer_count(const ModelConfig& config, std::span<const std::string_view> tensor_names) {
  std::set<std::string, std::less<>> prefixes = layer_prefixes(config);
  std::set<int64_t> layers;
  for (std::string_view name : tensor_names) {
    for (const std::string& prefix : prefixes) {
      if (auto index = layer_index(name, prefix)) layers.insert(*index);
    }
  }
  return static_cast<int64_t>(layers.size());
}

void check_checkpoint_layers(const ModelConfig& config, std::string_view config_object,
                             std::span<const std::string_view> tensor_names) {
  int64_t held = checkpoint_layer_count(config, tensor_names);
  if (held >= config.num_hidden_layers) return;
  std::string patterns;
  for (const std::string& prefix : layer_prefixes(config)) {
    patterns += (patterns.empty() ? "" : ", ") + prefix + std::string(kLayerPlaceholder) + ".*";
  }
  WS_FAIL(ErrorCode::kModel, std::string(config_object) + ": num_hidden_layers = " +
                                 std::to_string(config.num_hidden_layers) + ", but the checkpoint holds " +
                                 std::to_string(held) + (held == 1 ? " layer" : " layers") + " (tensors " + patterns +
                                 "): a cold load needs all " + std::to_string(config.num_hidden_layers));
}

}  // namespace weightstream
