// The tensors of a checkpoint of a supported architecture, expanded from its family's
// mapping table in the order the releases write them (synth writes them; tests list them).
#include "model/checkpoint_tensors.hpp"

#include "format/shared/json_text.hpp"
#include "model/layer_scopes.hpp"
#include "weightstream/error.hpp"

namespace weightstream {

using model::block_scale_name;
using model::ceil_div;
using model::left_unquantized;
using model::routed_experts;

namespace detail {

std::vector<CheckpointTensor> checkpoint_tensors(const ModelConfig& config, Dtype dtype) {
  const Architecture* architecture = find_architecture(config.model_type);
  WS_EXPECT(architecture != nullptr, ErrorCode::kInvalidArgument,
            "no tensor list for model_type " + detail::quoted_name(config.model_type) + ": " + supported_model_types());
  bool quantized = fp8_block_quantized(config);
  std::map<std::string, int64_t, std::less<>> dimensions = model_dimensions(config);
  model::LayerScopes scopes(*architecture, config);
  // File order as the releases write it: the embedding, the decoder layers, the final norm
  // and lm_head, then the MTP layers.
  std::vector<CheckpointTensor> first, layers, globals, mtp;
  scopes.for_each(architecture->rules(config), routed_experts(config),
                  [&](const MappingRule& rule, int64_t layer, int64_t expert) {
    std::vector<CheckpointTensor>& list = layer < 0 ? (rule.tensor == "model.embed_tokens.weight" ? first : globals)
                                          : scopes.mtp(layer) ? mtp
                                                              : layers;
    CheckpointTensor tensor;
    tensor.spec.name = scopes.expand_name(rule.tensor, layer, expert);
    tensor.spec.dtype = rule.dtype.value_or(dtype);
    for (const std::string& dimension : rule.shape) {
      auto it = dimensions.find(dimension);
      WS_EXPECT(it != dimensions.end() && it->second > 0, ErrorCode::kInvalidArgument,
                config.model_type + " rule " + rule.tensor + ": dimension '" + dimension + "' is missing or zero");
      tensor.spec.shape.push_back(it->second);
    }
    if (!quantized || !rule.linear || left_unquantized(config, tensor.spec.name)) {
      list.push_back(std::move(tensor));
      return;
    }
    tensor.values = CheckpointTensor::Values::kFp8Codes;
    tensor.spec.dtype = Dtype::kF8E4M3;
    tensor.source = tensor.spec.name;
    tensor.rows = tensor.spec.shape[0];
    tensor.columns = 1;
    for (size_t i = 1; i < tensor.spec.shape.size(); ++i) tensor.columns *= tensor.spec.shape[i];
    tensor.block_n = config.quantization.weight_block_size[0];
    tensor.block_k = config.quantization.weight_block_size[1];
    CheckpointTensor scale = tensor;
    scale.values = CheckpointTensor::Values::kFp8Scales;
    scale.spec.name = block_scale_name(tensor.spec.name);
    scale.spec.dtype = Dtype::kF32;
    scale.spec.shape = {ceil_div(tensor.rows, tensor.block_n), ceil_div(tensor.columns, tensor.block_k)};
    list.push_back(std::move(tensor));
    list.push_back(std::move(scale));
  });
  for (auto* more : {&layers, &globals, &mtp}) {
    for (CheckpointTensor& tensor : *more) first.push_back(std::move(tensor));
  }
  return first;
}

}  // namespace detail

std::vector<TensorSpec> checkpoint_tensor_specs(const ModelConfig& config, Dtype dtype) {
  std::vector<TensorSpec> specs;
  for (detail::CheckpointTensor& tensor : detail::checkpoint_tensors(config, dtype)) specs.push_back(std::move(tensor.spec));
  return specs;
}

}  // namespace weightstream
