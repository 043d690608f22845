#include "model/layer_scopes.hpp"

namespace weightstream::model {
namespace {

/// The checkpoint prefix of a decoder layer's tensors, which Qwen3-Next's MTP layers swap
/// for kQwen3NextMtpLayerPrefix (counted from 0 there).
constexpr std::string_view kDecoderLayerPrefix = "model.layers.{layer}.";
constexpr std::string_view kQwen3NextMtpLayerPrefix = "mtp.layers.{layer}.";

}  // namespace

int64_t routed_experts(const ModelConfig& config) {
  return std::max({config.n_routed_experts, config.num_experts, config.num_local_experts});
}

std::string expand(std::string_view pattern, int64_t layer, int64_t expert) {
  std::string text(pattern);
  auto replace = [&](std::string_view key, int64_t value) {
    for (size_t at = text.find(key); at != std::string::npos; at = text.find(key, at)) {
      text.replace(at, key.size(), std::to_string(value));
    }
  };
  replace("{layer}", layer);
  replace("{expert}", expert);
  return text;
}

std::string scale_name(const std::string& parameter) {
  constexpr std::string_view kSuffix = ".weight";
  if (parameter.ends_with(kSuffix)) return parameter.substr(0, parameter.size() - kSuffix.size()) + ".weight_scale";
  return parameter + "_scale";
}

bool left_unquantized(const ModelConfig& config, std::string_view tensor) {
  std::string module(tensor);
  if (module.ends_with(".weight")) module.resize(module.size() - 7);
  std::string dotted = "." + module + ".";
  for (const std::string& entry : config.quantization.modules_to_not_convert) {
    if (!entry.empty() && dotted.find("." + entry + ".") != std::string::npos) return true;
  }
  return false;
}

bool LayerScopes::has_experts(int64_t layer) const {
  if (routed_experts(config_) == 0) return false;
  int64_t index = architecture_.mtp == MtpPlacement::kMtpModule && mtp(layer) ? layer - config_.num_hidden_layers : layer;
  switch (architecture_.experts) {
    case ExpertLayers::kNone: return false;
    case ExpertLayers::kEveryLayer: return true;
    case ExpertLayers::kFirstKDense:
      return index >= config_.first_k_dense_replace && index % std::max<int64_t>(config_.moe_layer_freq, 1) == 0;
    case ExpertLayers::kSparseStep: {
      bool dense = std::find(config_.mlp_only_layers.begin(), config_.mlp_only_layers.end(), index) !=
                   config_.mlp_only_layers.end();
      return !dense && (index + 1) % std::max<int64_t>(config_.decoder_sparse_step, 1) == 0;
    }
  }
  return false;
}

bool LayerScopes::has_full_attention(int64_t layer) const {
  if (!architecture_.linear_attention || mtp(layer)) return true;
  if (!config_.layer_types.empty()) return config_.layer_types[static_cast<size_t>(layer)] == "full_attention";
  int64_t interval = config_.full_attention_interval > 0 ? config_.full_attention_interval : 4;
  return (layer + 1) % interval == 0;
}

std::string LayerScopes::expand_name(std::string_view pattern, int64_t layer, int64_t expert) const {
  if (architecture_.mtp == MtpPlacement::kMtpModule && mtp(layer) && pattern.starts_with(kDecoderLayerPrefix)) {
    std::string renamed = std::string(kQwen3NextMtpLayerPrefix) + std::string(pattern.substr(kDecoderLayerPrefix.size()));
    return expand(renamed, layer - config_.num_hidden_layers, expert);
  }
  return expand(pattern, layer, expert);
}

}  // namespace weightstream::model
