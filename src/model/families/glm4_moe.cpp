// GLM-4.5 (Glm4MoeForCausalLM): llama attention with biases, DeepSeek-V3's MoE and MTP layers.
#include "model/families/family_rules.hpp"

namespace weightstream::families {
namespace {

// GLM-4.5 (Glm4MoeForCausalLM): llama attention with q/k/v biases (attention_bias) and,
// with use_qk_norm, per-head q_norm and k_norm; vLLM fuses the biases as qkv_proj.bias.
const std::vector<MappingRule> kAttentionBiasRules = {
    rule("model.layers.{layer}.self_attn.q_proj.bias", "model.layers.{layer}.self_attn.qkv_proj.bias", "q", {"q_rows"},
     Split::kColumn),
    rule("model.layers.{layer}.self_attn.k_proj.bias", "model.layers.{layer}.self_attn.qkv_proj.bias", "k", {"kv_rows"},
     Split::kKvHeads),
    rule("model.layers.{layer}.self_attn.v_proj.bias", "model.layers.{layer}.self_attn.qkv_proj.bias", "v", {"kv_rows"},
     Split::kKvHeads),
};

}  // namespace

// GLM-4.5: llama attention (with biases, optional q/k norms), DeepSeek-V3's MoE (router
// bias, shared experts, first_k_dense_replace dense layers) and MTP layers (vLLM's
// glm4_moe.py and glm4_moe_mtp.py).
std::vector<MappingRule> glm4_moe_rules(const ModelConfig& config) {
  std::vector<MappingRule> rules = llama_global_rules();
  append(rules, llama_layer_rules());
  if (config.attention_bias) append(rules, kAttentionBiasRules);
  if (config.use_qk_norm) append(rules, qk_norm_rules());
  append(rules, moe_rules());
  rules.push_back(moe_score_bias_rule());
  if (config.n_shared_experts > 0) append(rules, shared_expert_rules());
  append(rules, decoder_mtp_rules());
  return rules;
}

}  // namespace weightstream::families
