// Qwen3 (Qwen3ForCausalLM) and Qwen3-MoE (Qwen3MoeForCausalLM): llama with per-head q/k norms.
#include "model/families/family_rules.hpp"

namespace weightstream::families {
namespace {

const std::vector<MappingRule> kQwen3LayerRules = {
    rule("model.layers.{layer}.self_attn.q_norm.weight", "model.layers.{layer}.self_attn.q_norm.weight", "", {"head_dim"}),
    rule("model.layers.{layer}.self_attn.k_norm.weight", "model.layers.{layer}.self_attn.k_norm.weight", "", {"head_dim"}),
};

}  // namespace

const std::vector<MappingRule>& qk_norm_rules() { return kQwen3LayerRules; }

std::vector<MappingRule> qwen3_rules(const ModelConfig& config) {
  std::vector<MappingRule> rules = llama_rules(config);
  append(rules, kQwen3LayerRules);
  return rules;
}

// Qwen3-MoE: Qwen3's attention, routed experts without a shared one, dense MLP in the layers
// of mlp_only_layers (vLLM's qwen3_moe.py).
std::vector<MappingRule> qwen3_moe_rules(const ModelConfig& config) {
  std::vector<MappingRule> rules = qwen3_rules(config);
  append(rules, moe_rules());
  return rules;
}

}  // namespace weightstream::families
