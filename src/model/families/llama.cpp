// Llama (LlamaForCausalLM): the blocks most families start from.
#include "model/families/family_rules.hpp"

namespace weightstream::families {
namespace {

// Names and shapes follow the Hugging Face checkpoints; parameter names follow vLLM's
// fused modules (qkv_proj, gate_up_proj, fused_qkv_a_proj, experts.w13_weight/w2_weight).
const std::vector<MappingRule> kLlamaGlobalRules = {
    rule("model.embed_tokens.weight", "model.embed_tokens.weight", "", {"vocab", "hidden"}, Split::kVocab, LayerScope::kGlobal),
    rule("model.norm.weight", "model.norm.weight", "", {"hidden"}, Split::kReplicated, LayerScope::kGlobal),
    rule("lm_head.weight", "lm_head.weight", "", {"vocab", "hidden"}, Split::kVocab, LayerScope::kGlobal),
};

const std::vector<MappingRule> kLlamaLayerRules = {
    rule("model.layers.{layer}.input_layernorm.weight", "model.layers.{layer}.input_layernorm.weight", "", {"hidden"}),
    rule("model.layers.{layer}.self_attn.q_proj.weight", "model.layers.{layer}.self_attn.qkv_proj.weight", "q",
     {"q_rows", "hidden"}, Split::kColumn, LayerScope::kLayer, true),
    rule("model.layers.{layer}.self_attn.k_proj.weight", "model.layers.{layer}.self_attn.qkv_proj.weight", "k",
     {"kv_rows", "hidden"}, Split::kKvHeads, LayerScope::kLayer, true),
    rule("model.layers.{layer}.self_attn.v_proj.weight", "model.layers.{layer}.self_attn.qkv_proj.weight", "v",
     {"kv_rows", "hidden"}, Split::kKvHeads, LayerScope::kLayer, true),
    rule("model.layers.{layer}.self_attn.o_proj.weight", "model.layers.{layer}.self_attn.o_proj.weight", "",
     {"hidden", "q_rows"}, Split::kRow, LayerScope::kLayer, true),
    rule("model.layers.{layer}.post_attention_layernorm.weight", "model.layers.{layer}.post_attention_layernorm.weight", "",
     {"hidden"}),
    rule("model.layers.{layer}.mlp.gate_proj.weight", "model.layers.{layer}.mlp.gate_up_proj.weight", "0",
     {"intermediate", "hidden"}, Split::kColumn, LayerScope::kDenseMlp, true),
    rule("model.layers.{layer}.mlp.up_proj.weight", "model.layers.{layer}.mlp.gate_up_proj.weight", "1",
     {"intermediate", "hidden"}, Split::kColumn, LayerScope::kDenseMlp, true),
    rule("model.layers.{layer}.mlp.down_proj.weight", "model.layers.{layer}.mlp.down_proj.weight", "",
     {"hidden", "intermediate"}, Split::kRow, LayerScope::kDenseMlp, true),
};

}  // namespace

const std::vector<MappingRule>& llama_global_rules() { return kLlamaGlobalRules; }

const std::vector<MappingRule>& llama_layer_rules() { return kLlamaLayerRules; }

void append_llama_attention(std::vector<MappingRule>& rules) {
  for (const MappingRule& rule : kLlamaLayerRules) {
    if (rule.scope != LayerScope::kDenseMlp) rules.push_back(rule);
  }
}

std::vector<MappingRule> llama_rules(const ModelConfig&) {
  std::vector<MappingRule> rules = kLlamaGlobalRules;
  append(rules, kLlamaLayerRules);
  return rules;
}

}  // namespace weightstream::families
