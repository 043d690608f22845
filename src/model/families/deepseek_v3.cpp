// DeepSeek-V3 (DeepseekV3ForCausalLM, also Kimi-K2): multi-head latent attention, routed and shared
// experts with a router bias, and MTP layers that continue the decoder layers.
#include "model/families/family_rules.hpp"

namespace weightstream::families {
namespace {

// DeepSeek-V3 multi-head latent attention. With a q LoRA, q_a_proj and kv_a_proj_with_mqa
// share their input and are fused, as vLLM's fused_qkv_a_proj.
const std::vector<MappingRule> kMlaQLoraRules = {
    rule("model.layers.{layer}.self_attn.q_a_proj.weight", "model.layers.{layer}.self_attn.fused_qkv_a_proj.weight", "q_a",
     {"q_lora_rank", "hidden"}, Split::kReplicated, LayerScope::kLayer, true),
    rule("model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight",
     "model.layers.{layer}.self_attn.fused_qkv_a_proj.weight", "kv_a", {"kv_a_rows", "hidden"}, Split::kReplicated,
     LayerScope::kLayer, true),
    rule("model.layers.{layer}.self_attn.q_a_layernorm.weight", "model.layers.{layer}.self_attn.q_a_layernorm.weight", "",
     {"q_lora_rank"}),
    rule("model.layers.{layer}.self_attn.q_b_proj.weight", "model.layers.{layer}.self_attn.q_b_proj.weight", "",
     {"mla_q_rows", "q_lora_rank"}, Split::kColumn, LayerScope::kLayer, true),
};

const std::vector<MappingRule> kMlaQRules = {
    rule("model.layers.{layer}.self_attn.q_proj.weight", "model.layers.{layer}.self_attn.q_proj.weight", "",
     {"mla_q_rows", "hidden"}, Split::kColumn, LayerScope::kLayer, true),
    rule("model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight",
     "model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight", "", {"kv_a_rows", "hidden"}, Split::kReplicated,
     LayerScope::kLayer, true),
};

const std::vector<MappingRule> kMlaRules = {
    rule("model.layers.{layer}.input_layernorm.weight", "model.layers.{layer}.input_layernorm.weight", "", {"hidden"}),
    rule("model.layers.{layer}.self_attn.kv_a_layernorm.weight", "model.layers.{layer}.self_attn.kv_a_layernorm.weight",
     "", {"kv_lora_rank"}),
    rule("model.layers.{layer}.self_attn.kv_b_proj.weight", "model.layers.{layer}.self_attn.kv_b_proj.weight", "",
     {"kv_b_rows", "kv_lora_rank"}, Split::kColumn, LayerScope::kLayer, true),
    rule("model.layers.{layer}.self_attn.o_proj.weight", "model.layers.{layer}.self_attn.o_proj.weight", "",
     {"hidden", "mla_o_columns"}, Split::kRow, LayerScope::kLayer, true),
    rule("model.layers.{layer}.post_attention_layernorm.weight", "model.layers.{layer}.post_attention_layernorm.weight", "",
     {"hidden"}),
};

const std::vector<MappingRule> kMoeRules = {
    rule("model.layers.{layer}.mlp.gate.weight", "model.layers.{layer}.mlp.gate.weight", "", {"routed_experts", "hidden"},
     Split::kReplicated, LayerScope::kMoe),
    rule("model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight", "model.layers.{layer}.mlp.experts.w13_weight", "0",
     {"moe_intermediate", "hidden"}, Split::kColumn, LayerScope::kExpert, true),
    rule("model.layers.{layer}.mlp.experts.{expert}.up_proj.weight", "model.layers.{layer}.mlp.experts.w13_weight", "1",
     {"moe_intermediate", "hidden"}, Split::kColumn, LayerScope::kExpert, true),
    rule("model.layers.{layer}.mlp.experts.{expert}.down_proj.weight", "model.layers.{layer}.mlp.experts.w2_weight", "",
     {"hidden", "moe_intermediate"}, Split::kRow, LayerScope::kExpert, true),
};

const MappingRule kMoeScoreBiasRule = rule("model.layers.{layer}.mlp.gate.e_score_correction_bias",
                                       "model.layers.{layer}.mlp.gate.e_score_correction_bias", "",
                                       {"routed_experts"}, Split::kReplicated, LayerScope::kMoe, false,
                                       Dtype::kF32);

const std::vector<MappingRule> kSharedExpertRules = {
    rule("model.layers.{layer}.mlp.shared_experts.gate_proj.weight",
     "model.layers.{layer}.mlp.shared_experts.gate_up_proj.weight", "0", {"shared_intermediate", "hidden"},
     Split::kColumn, LayerScope::kMoe, true),
    rule("model.layers.{layer}.mlp.shared_experts.up_proj.weight",
     "model.layers.{layer}.mlp.shared_experts.gate_up_proj.weight", "1", {"shared_intermediate", "hidden"},
     Split::kColumn, LayerScope::kMoe, true),
    rule("model.layers.{layer}.mlp.shared_experts.down_proj.weight",
     "model.layers.{layer}.mlp.shared_experts.down_proj.weight", "", {"hidden", "shared_intermediate"}, Split::kRow,
     LayerScope::kMoe, true),
};

// The MTP layers DeepSeek-V3 ships as model.layers.{num_hidden_layers + i}: a full decoder
// block (the rules above) plus these.
const std::vector<MappingRule> kMtpRules = {
    rule("model.layers.{layer}.enorm.weight", "model.layers.{layer}.enorm.weight", "", {"hidden"}, Split::kReplicated,
     LayerScope::kMtp),
    rule("model.layers.{layer}.hnorm.weight", "model.layers.{layer}.hnorm.weight", "", {"hidden"}, Split::kReplicated,
     LayerScope::kMtp),
    rule("model.layers.{layer}.eh_proj.weight", "model.layers.{layer}.eh_proj.weight", "", {"hidden", "hidden2"},
     Split::kReplicated, LayerScope::kMtp),
    rule("model.layers.{layer}.embed_tokens.weight", "model.layers.{layer}.embed_tokens.weight", "", {"vocab", "hidden"},
     Split::kVocab, LayerScope::kMtp),
    rule("model.layers.{layer}.shared_head.norm.weight", "model.layers.{layer}.shared_head.norm.weight", "", {"hidden"},
     Split::kReplicated, LayerScope::kMtp),
    rule("model.layers.{layer}.shared_head.head.weight", "model.layers.{layer}.shared_head.head.weight", "",
     {"vocab", "hidden"}, Split::kVocab, LayerScope::kMtp),
};

}  // namespace

const std::vector<MappingRule>& moe_rules() { return kMoeRules; }

const MappingRule& moe_score_bias_rule() { return kMoeScoreBiasRule; }

const std::vector<MappingRule>& shared_expert_rules() { return kSharedExpertRules; }

const std::vector<MappingRule>& decoder_mtp_rules() { return kMtpRules; }

std::vector<MappingRule> deepseek_v3_rules(const ModelConfig& config) {
  std::vector<MappingRule> rules = llama_global_rules();
  append(rules, config.q_lora_rank > 0 ? kMlaQLoraRules : kMlaQRules);
  append(rules, kMlaRules);
  append_scope(rules, llama_layer_rules(), LayerScope::kDenseMlp);  // layers before first_k_dense_replace
  append(rules, kMoeRules);
  rules.push_back(kMoeScoreBiasRule);
  if (config.n_shared_experts > 0) append(rules, kSharedExpertRules);
  append(rules, kMtpRules);
  return rules;
}

}  // namespace weightstream::families
