// The one layout of a model for a rank, with the model hooks an engine registers: the
// command, the Python package and the engine plugins all build it here, so one checkpoint
// gives one layout everywhere.
#include "weightstream/error.hpp"
#include "weightstream/load.hpp"

namespace weightstream {
namespace {

/// Whether a parameter named by `pattern` for its layer has a part `id`.
bool has_layer_part(const ModelLayout& layout, std::string_view pattern, std::string_view id) {
  constexpr std::string_view kLayer = "{layer}";
  for (const Parameter& parameter : layout.parameters()) {
    std::string name(pattern);
    if (size_t at = name.find(kLayer); at != std::string::npos) name.replace(at, kLayer.size(), std::to_string(parameter.layer));
    if (parameter.name != name) continue;
    for (const ParameterPart& part : parameter.parts) {
      if (part.id == id) return true;
    }
  }
  return false;
}

}  // namespace

std::vector<std::unique_ptr<ModelHook>> engine_hooks(const ModelLayout& layout, const ModelConfig& config) {
  std::vector<std::unique_ptr<ModelHook>> hooks;
  if (config.tie_word_embeddings && layout.find("lm_head.weight") && layout.find("model.embed_tokens.weight")) {
    hooks.push_back(make_tied_lm_head_hook());
  }
  // The fused K/V buffer an engine derives: K and V rows of qkv_proj, or MLA's latent kv_a.
  constexpr std::string_view kQkv = "model.layers.{layer}.self_attn.qkv_proj.weight";
  constexpr std::string_view kLatent = "model.layers.{layer}.self_attn.fused_qkv_a_proj.weight";
  if (has_layer_part(layout, kQkv, "k")) hooks.push_back(make_fused_kv_hook(std::string(kQkv)));
  if (has_layer_part(layout, kLatent, "kv_a")) hooks.push_back(make_fused_kv_hook(std::string(kLatent), {"kv_a"}));
  return hooks;
}

ModelLayout engine_layout(ModelConfig config, std::string_view config_object,
                          std::span<const std::string_view> tensor_names, const EngineLayoutOptions& options) {
  LayoutOptions layout_options = options.layout;
  if (!tensor_names.empty()) {
    check_checkpoint_layers(config, config_object, tensor_names);
    layout_options.max_tensors = layout_tensor_bound(tensor_names.size());
  }
  if (options.held_as) {
    config.torch_dtype = options.held_as->torch_dtype;
    config.quantization = options.held_as->quantization;
  }
  ModelLayout layout = build_model_layout(config, layout_options);
  if (!options.device) return layout;
  layout.allocate(*options.device);
  if (options.hooks) {
    for (auto& hook : engine_hooks(layout, config)) layout.add_hook(std::move(hook));
  }
  return layout;
}

namespace {

std::vector<std::string_view> tensor_names(const Checkpoint& checkpoint) {
  std::vector<std::string_view> names;
  names.reserve(checkpoint.tensors().size());
  for (const CheckpointTensor& tensor : checkpoint.tensors()) names.push_back(tensor.name);
  return names;
}

}  // namespace

ModelConfig checkpoint_layout_config(const Checkpoint& checkpoint) {
  ModelConfig config = checkpoint_model_config(checkpoint);
  check_checkpoint_layers(config, checkpoint.uri() + "/config.json", tensor_names(checkpoint));
  return config;
}

ModelLayout engine_layout(const Checkpoint& checkpoint, const EngineLayoutOptions& options) {
  return engine_layout(checkpoint_model_config(checkpoint), checkpoint.uri() + "/config.json", tensor_names(checkpoint),
                       options);
}

}  // namespace weightstream
