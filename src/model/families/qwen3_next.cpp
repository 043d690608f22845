// Qwen3-Next (Qwen3NextForCausalLM): gated full attention between Gated DeltaNet layers, a gated
// shared expert, and an MTP module of its own.
#include "model/families/family_rules.hpp"

namespace weightstream::families {
namespace {

// Qwen3-Next, as its Hugging Face checkpoint names it and vLLM's qwen3_next.py and
// qwen3_next_mtp.py load it: Gated DeltaNet (linear attention) layers, with full attention
// every full_attention_interval-th layer whose q_proj carries the query and its output gate
// (2 x heads x head_dim rows, per head), MoE layers with one gated shared expert, and an MTP
// module under mtp.*: mtp.fc over [embedding; hidden] (2 x hidden columns), pre-fc norms,
// full-attention layers mtp.layers.{i}.* and a final norm. Its embedding and lm_head are the
// target's (vLLM's Qwen3NextMTP reads model.embed_tokens and lm_head), so the draft has none.
const std::vector<MappingRule> kDecoderNormRules = {
    rule("model.layers.{layer}.input_layernorm.weight", "model.layers.{layer}.input_layernorm.weight", "", {"hidden"}),
    rule("model.layers.{layer}.post_attention_layernorm.weight", "model.layers.{layer}.post_attention_layernorm.weight", "",
     {"hidden"}),
};

const std::vector<MappingRule> kGatedAttentionRules = {
    rule("model.layers.{layer}.self_attn.q_proj.weight", "model.layers.{layer}.self_attn.qkv_proj.weight", "q",
     {"q_gate_rows", "hidden"}, Split::kColumn, LayerScope::kFullAttention, true),
    rule("model.layers.{layer}.self_attn.k_proj.weight", "model.layers.{layer}.self_attn.qkv_proj.weight", "k",
     {"kv_rows", "hidden"}, Split::kKvHeads, LayerScope::kFullAttention, true),
    rule("model.layers.{layer}.self_attn.v_proj.weight", "model.layers.{layer}.self_attn.qkv_proj.weight", "v",
     {"kv_rows", "hidden"}, Split::kKvHeads, LayerScope::kFullAttention, true),
    rule("model.layers.{layer}.self_attn.o_proj.weight", "model.layers.{layer}.self_attn.o_proj.weight", "",
     {"hidden", "q_rows"}, Split::kRow, LayerScope::kFullAttention, true),
    rule("model.layers.{layer}.self_attn.q_norm.weight", "model.layers.{layer}.self_attn.q_norm.weight", "", {"head_dim"},
     Split::kReplicated, LayerScope::kFullAttention),
    rule("model.layers.{layer}.self_attn.k_norm.weight", "model.layers.{layer}.self_attn.k_norm.weight", "", {"head_dim"},
     Split::kReplicated, LayerScope::kFullAttention),
};

// Gated DeltaNet, divided among ranks as vLLM's QwenGatedDeltaNetAttention divides it for
// Qwen3-Next (gqa_interleaved_layout): the checkpoint's in_proj_qkvz and in_proj_ba are laid
// out by key-head group ([q, k, v, z] and [b, a] of each key head), and vLLM loads each as
// one output shard of a MergedColumnParallelLinear, so a contiguous column split gives a
// rank whole groups; conv1d runs over q, k and v laid flat, and its weight_loader
// (mamba_v2_sharded_weight_loader) divides each of the three sections; A_log and dt_bias
// are divided by value heads (sharded_weight_loader(0)), A_log held in F32 as vLLM holds it
// (a BF16 checkpoint's converts on copy), the gated norm (one value head wide) is
// replicated and out_proj is row parallel. build() refuses a tp_size that does
// not divide the key and the value heads.
const std::vector<MappingRule> kGatedDeltaNetRules = {
    rule("model.layers.{layer}.linear_attn.in_proj_qkvz.weight", "model.layers.{layer}.linear_attn.in_proj_qkvz.weight",
     "", {"linear_qkvz_rows", "hidden"}, Split::kColumn, LayerScope::kLinearAttention, true),
    rule("model.layers.{layer}.linear_attn.in_proj_ba.weight", "model.layers.{layer}.linear_attn.in_proj_ba.weight", "",
     {"linear_ba_rows", "hidden"}, Split::kColumn, LayerScope::kLinearAttention, true),
    sectioned_rule("model.layers.{layer}.linear_attn.conv1d.weight", "model.layers.{layer}.linear_attn.conv1d.weight",
     {"linear_conv_rows", "one", "linear_conv_kernel"},
     {{"q", "linear_key_dim"}, {"k", "linear_key_dim"}, {"v", "linear_value_dim"}}, LayerScope::kLinearAttention),
    rule("model.layers.{layer}.linear_attn.dt_bias", "model.layers.{layer}.linear_attn.dt_bias", "", {"linear_v_heads"},
     Split::kColumn, LayerScope::kLinearAttention),
    rule("model.layers.{layer}.linear_attn.A_log", "model.layers.{layer}.linear_attn.A_log", "", {"linear_v_heads"},
     Split::kColumn, LayerScope::kLinearAttention, false, Dtype::kF32),
    rule("model.layers.{layer}.linear_attn.norm.weight", "model.layers.{layer}.linear_attn.norm.weight", "",
     {"linear_v_head_dim"}, Split::kReplicated, LayerScope::kLinearAttention),
    rule("model.layers.{layer}.linear_attn.out_proj.weight", "model.layers.{layer}.linear_attn.out_proj.weight", "",
     {"hidden", "linear_value_dim"}, Split::kRow, LayerScope::kLinearAttention, true),
};

const std::vector<MappingRule> kGatedSharedExpertRules = {
    rule("model.layers.{layer}.mlp.shared_expert.gate_proj.weight",
     "model.layers.{layer}.mlp.shared_expert.gate_up_proj.weight", "0", {"shared_expert_intermediate", "hidden"},
     Split::kColumn, LayerScope::kMoe, true),
    rule("model.layers.{layer}.mlp.shared_expert.up_proj.weight",
     "model.layers.{layer}.mlp.shared_expert.gate_up_proj.weight", "1", {"shared_expert_intermediate", "hidden"},
     Split::kColumn, LayerScope::kMoe, true),
    rule("model.layers.{layer}.mlp.shared_expert.down_proj.weight", "model.layers.{layer}.mlp.shared_expert.down_proj.weight",
     "", {"hidden", "shared_expert_intermediate"}, Split::kRow, LayerScope::kMoe, true),
    rule("model.layers.{layer}.mlp.shared_expert_gate.weight", "model.layers.{layer}.mlp.shared_expert_gate.weight", "",
     {"one", "hidden"}, Split::kReplicated, LayerScope::kMoe),
};

const std::vector<MappingRule> kQwen3NextMtpModuleRules = {
    rule("mtp.fc.weight", "mtp.fc.weight", "", {"hidden", "hidden2"}, Split::kColumn, LayerScope::kMtpModule, true),
    rule("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_embedding.weight", "", {"hidden"}, Split::kReplicated,
     LayerScope::kMtpModule),
    rule("mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_hidden.weight", "", {"hidden"}, Split::kReplicated,
     LayerScope::kMtpModule),
    rule("mtp.norm.weight", "mtp.norm.weight", "", {"hidden"}, Split::kReplicated, LayerScope::kMtpModule),
};


}  // namespace

std::vector<MappingRule> qwen3_next_rules(const ModelConfig& config) {
  std::vector<MappingRule> rules = llama_global_rules();
  append(rules, kDecoderNormRules);
  append(rules, kGatedAttentionRules);
  append(rules, kGatedDeltaNetRules);
  append_scope(rules, llama_layer_rules(), LayerScope::kDenseMlp);  // layers of mlp_only_layers
  append(rules, moe_rules());
  if (config.shared_expert_intermediate_size > 0) append(rules, kGatedSharedExpertRules);
  append(rules, kQwen3NextMtpModuleRules);
  return rules;
}

}  // namespace weightstream::families
