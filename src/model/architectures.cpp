// The supported architectures: the list that names each family's facts and its mapping
// table (src/model/families/), the named dimensions the tables refer to, and the checks of a
// config's quantization. Adding an architecture means adding a table and a row here, not code
// in the builder (layout_builder.cpp).
#include <algorithm>

#include "model/families/family_rules.hpp"
#include "model/layer_scopes.hpp"
#include "weightstream/error.hpp"
#include "weightstream/model.hpp"

namespace weightstream {
namespace {

using model::routed_experts;

// The four first supported come first, so that messages listing them read as they did.
const Architecture kArchitectures[] = {
    {"llama", "LlamaForCausalLM", ExpertLayers::kNone, MtpPlacement::kNone, false, false, families::llama_rules},
    {"qwen3", "Qwen3ForCausalLM", ExpertLayers::kNone, MtpPlacement::kNone, false, false, families::qwen3_rules},
    {"deepseek_v3", "DeepseekV3ForCausalLM", ExpertLayers::kFirstKDense, MtpPlacement::kDecoderLayers, false, true,
     families::deepseek_v3_rules},
    {"qwen3_next", "Qwen3NextForCausalLM", ExpertLayers::kSparseStep, MtpPlacement::kMtpModule, true, false,
     families::qwen3_next_rules},
    {"qwen3_moe", "Qwen3MoeForCausalLM", ExpertLayers::kSparseStep, MtpPlacement::kNone, false, false, families::qwen3_moe_rules},
    {"mixtral", "MixtralForCausalLM", ExpertLayers::kEveryLayer, MtpPlacement::kNone, false, false, families::mixtral_rules},
    // Kimi-K2 ships DeepSeek-V3's architecture and names under its own model_type.
    {"kimi_k2", "DeepseekV3ForCausalLM", ExpertLayers::kFirstKDense, MtpPlacement::kDecoderLayers, false, true,
     families::deepseek_v3_rules},
    {"glm4_moe", "Glm4MoeForCausalLM", ExpertLayers::kFirstKDense, MtpPlacement::kDecoderLayers, false, false,
     families::glm4_moe_rules},
};

}  // namespace

std::map<std::string, int64_t, std::less<>> model_dimensions(const ModelConfig& config) {
  int64_t head_dim = config.head_dim > 0                  ? config.head_dim
                     : config.num_attention_heads > 0 ? config.hidden_size / config.num_attention_heads
                                                          : 0;
  int64_t kv_heads = config.num_key_value_heads > 0 ? config.num_key_value_heads : config.num_attention_heads;
  int64_t heads = config.num_attention_heads;
  int64_t qk_head = config.qk_nope_head_dim + config.qk_rope_head_dim;
  int64_t linear_key_dim = config.linear_num_key_heads * config.linear_key_head_dim;
  int64_t linear_value_dim = config.linear_num_value_heads * config.linear_value_head_dim;
  return {
      {"hidden", config.hidden_size},
      {"hidden2", 2 * config.hidden_size},
      {"vocab", config.vocab_size},
      {"intermediate", config.intermediate_size},
      {"heads", heads},
      {"kv_heads", kv_heads},
      {"head_dim", head_dim},
      {"q_rows", heads * head_dim},
      {"kv_rows", kv_heads * head_dim},
      {"q_lora_rank", config.q_lora_rank},
      {"kv_lora_rank", config.kv_lora_rank},
      {"kv_a_rows", config.kv_lora_rank + config.qk_rope_head_dim},
      {"mla_q_rows", heads * qk_head},
      {"kv_b_rows", heads * (config.qk_nope_head_dim + config.v_head_dim)},
      {"mla_o_columns", heads * config.v_head_dim},
      {"routed_experts", routed_experts(config)},
      {"moe_intermediate", config.moe_intermediate_size},
      {"shared_intermediate", config.moe_intermediate_size * config.n_shared_experts},
      {"one", 1},
      // Qwen3-Next: a gated query (query and output gate per head), Gated DeltaNet layers
      // (in_proj_qkvz holds q, k, v and z; conv1d runs over q, k and v), one shared expert.
      {"q_gate_rows", 2 * heads * head_dim},
      {"linear_qkvz_rows", 2 * linear_key_dim + 2 * linear_value_dim},
      {"linear_ba_rows", 2 * config.linear_num_value_heads},
      {"linear_conv_rows", 2 * linear_key_dim + linear_value_dim},
      {"linear_conv_kernel", config.linear_conv_kernel_dim},
      {"linear_key_dim", linear_key_dim},
      {"linear_v_heads", config.linear_num_value_heads},
      {"linear_v_head_dim", config.linear_value_head_dim},
      {"linear_value_dim", linear_value_dim},
      {"shared_expert_intermediate", config.shared_expert_intermediate_size},
  };
}

std::span<const Architecture> architectures() noexcept { return kArchitectures; }

const Architecture* find_architecture(std::string_view model_type) noexcept {
  for (const Architecture& architecture : kArchitectures) {
    if (architecture.model_type == model_type) return &architecture;
  }
  return nullptr;
}

std::string supported_model_types() {
  std::string text;
  for (const Architecture& architecture : kArchitectures) {
    text += (text.empty() ? "" : ", ") + std::string(architecture.model_type);
  }
  return text;
}

const Architecture& architecture_of(const ModelConfig& config) {
  const Architecture* architecture = find_architecture(config.model_type);
  WS_EXPECT(architecture != nullptr, ErrorCode::kModel,
            (config.source.empty() ? std::string() : config.source + ": ") + "model_type '" + config.model_type +
                "' has no mapping table (supported: " + supported_model_types() +
                "); build a ModelLayout through the API instead");
  return *architecture;
}

bool fp8_block_quantized(const ModelConfig& config) {
  const ModelConfig::Quantization& q = config.quantization;
  if (q.quant_method.empty()) return false;
  std::string what = config.model_type + ": quantization_config quant_method '" + q.quant_method + "'";
  WS_EXPECT(q.quant_method == "fp8", ErrorCode::kModel,
            what + " is not supported (weightstream loads FP8 block-scaled checkpoints: quant_method fp8 with "
                   "weight_block_size)");
  WS_EXPECT(!q.weight_block_size.empty(), ErrorCode::kModel,
            what + " without weight_block_size (one scale per tensor) is not supported; FP8 block-scaled "
                   "checkpoints give weight_block_size [block_n, block_k]");
  WS_EXPECT(q.fmt.empty() || q.fmt == "e4m3", ErrorCode::kModel,
            what + " with fmt '" + q.fmt + "' is not supported: only e4m3 (F8_E4M3 weights)");
  WS_EXPECT(q.activation_scheme.empty() || q.activation_scheme == "dynamic", ErrorCode::kModel,
            what + " with activation_scheme '" + q.activation_scheme +
                "' is not supported with weight_block_size: block-scaled checkpoints quantize activations dynamically");
  return true;
}

std::vector<MappingRule> mapping_rules(const ModelConfig& config) { return architecture_of(config).rules(config); }

int64_t mtp_layer_count(const ModelConfig& config) {
  const Architecture* architecture = find_architecture(config.model_type);
  return architecture != nullptr && architecture->mtp != MtpPlacement::kNone ? config.num_nextn_predict_layers : 0;
}

std::vector<std::string> ignore_rules(const ModelConfig& /*config*/) {
  // Rotary tables are recomputed by every engine; older checkpoints still ship them.
  return {"*.rotary_emb.inv_freq"};
}

}  // namespace weightstream
