// The mapping tables of the supported architectures, and the one builder that turns a
// table, a config and this rank's place into a ModelLayout. Adding an architecture means
// adding a table, not code.
#include <algorithm>
#include <numeric>

#include "format/shared/json_text.hpp"
#include "model/checkpoint_tensors.hpp"
#include "weightstream/error.hpp"
#include "weightstream/model.hpp"
#include "weightstream/synth.hpp"

namespace weightstream {
namespace {

using Dimensions = std::map<std::string, int64_t, std::less<>>;

MappingRule rule(std::string tensor, std::string parameter, std::string part, std::vector<std::string> shape,
                 Split split = Split::kReplicated, LayerScope scope = LayerScope::kLayer, bool linear = false,
                 std::optional<Dtype> dtype = std::nullopt) {
  return MappingRule{std::move(tensor), std::move(parameter), std::move(part), std::move(shape), split, scope, linear,
                     dtype};
}

/// A rule of Split::kColumnSections: `tensor`'s dim 0 is `sections` in order, each divided among ranks.
MappingRule sectioned_rule(std::string tensor, std::string parameter, std::vector<std::string> shape,
                           std::vector<RowSection> sections, LayerScope scope) {
  MappingRule made = rule(std::move(tensor), std::move(parameter), "", std::move(shape), Split::kColumnSections, scope);
  made.sections = std::move(sections);
  return made;
}

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

const std::vector<MappingRule> kQwen3LayerRules = {
    rule("model.layers.{layer}.self_attn.q_norm.weight", "model.layers.{layer}.self_attn.q_norm.weight", "", {"head_dim"}),
    rule("model.layers.{layer}.self_attn.k_norm.weight", "model.layers.{layer}.self_attn.k_norm.weight", "", {"head_dim"}),
};

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

// Mixtral, as its Hugging Face checkpoint names it (block_sparse_moe, experts w1 = gate,
// w3 = up, w2 = down, each of intermediate_size) and vLLM's mixtral.py holds it
// (block_sparse_moe.gate, FusedMoE block_sparse_moe.experts.w13_weight / w2_weight).
const std::vector<MappingRule> kMixtralMoeRules = {
    rule("model.layers.{layer}.block_sparse_moe.gate.weight", "model.layers.{layer}.block_sparse_moe.gate.weight", "",
     {"routed_experts", "hidden"}, Split::kReplicated, LayerScope::kMoe),
    rule("model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",
     "model.layers.{layer}.block_sparse_moe.experts.w13_weight", "0", {"intermediate", "hidden"}, Split::kColumn,
     LayerScope::kExpert, true),
    rule("model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight",
     "model.layers.{layer}.block_sparse_moe.experts.w13_weight", "1", {"intermediate", "hidden"}, Split::kColumn,
     LayerScope::kExpert, true),
    rule("model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight",
     "model.layers.{layer}.block_sparse_moe.experts.w2_weight", "", {"hidden", "intermediate"}, Split::kRow,
     LayerScope::kExpert, true),
};

void append(std::vector<MappingRule>& rules, const std::vector<MappingRule>& more) {
  rules.insert(rules.end(), more.begin(), more.end());
}

void append_scope(std::vector<MappingRule>& rules, const std::vector<MappingRule>& more, LayerScope scope) {
  for (const MappingRule& rule : more) {
    if (rule.scope == scope) rules.push_back(rule);
  }
}

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

std::vector<MappingRule> qwen3_rules(const ModelConfig& config) {
  std::vector<MappingRule> rules = llama_rules(config);
  append(rules, kQwen3LayerRules);
  return rules;
}

// Qwen3-MoE: Qwen3's attention, routed experts without a shared one, dense MLP in the layers
// of mlp_only_layers (vLLM's qwen3_moe.py).
std::vector<MappingRule> qwen3_moe_rules(const ModelConfig& config) {
  std::vector<MappingRule> rules = qwen3_rules(config);
  append(rules, kMoeRules);
  return rules;
}

std::vector<MappingRule> mixtral_rules(const ModelConfig&) {
  std::vector<MappingRule> rules = kLlamaGlobalRules;
  append_llama_attention(rules);
  append(rules, kMixtralMoeRules);
  return rules;
}

std::vector<MappingRule> deepseek_rules(const ModelConfig& config) {
  std::vector<MappingRule> rules = kLlamaGlobalRules;
  append(rules, config.q_lora_rank > 0 ? kMlaQLoraRules : kMlaQRules);
  append(rules, kMlaRules);
  append_scope(rules, kLlamaLayerRules, LayerScope::kDenseMlp);  // layers before first_k_dense_replace
  append(rules, kMoeRules);
  rules.push_back(kMoeScoreBiasRule);
  if (config.n_shared_experts > 0) append(rules, kSharedExpertRules);
  append(rules, kMtpRules);
  return rules;
}

// GLM-4.5: llama attention (with biases, optional q/k norms), DeepSeek-V3's MoE (router
// bias, shared experts, first_k_dense_replace dense layers) and MTP layers (vLLM's
// glm4_moe.py and glm4_moe_mtp.py).
std::vector<MappingRule> glm4_moe_rules(const ModelConfig& config) {
  std::vector<MappingRule> rules = kLlamaGlobalRules;
  append(rules, kLlamaLayerRules);
  if (config.attention_bias) append(rules, kAttentionBiasRules);
  if (config.use_qk_norm) append(rules, kQwen3LayerRules);
  append(rules, kMoeRules);
  rules.push_back(kMoeScoreBiasRule);
  if (config.n_shared_experts > 0) append(rules, kSharedExpertRules);
  append(rules, kMtpRules);
  return rules;
}

std::vector<MappingRule> qwen3_next_rules(const ModelConfig& config) {
  std::vector<MappingRule> rules = kLlamaGlobalRules;
  append(rules, kDecoderNormRules);
  append(rules, kGatedAttentionRules);
  append(rules, kGatedDeltaNetRules);
  append_scope(rules, kLlamaLayerRules, LayerScope::kDenseMlp);  // layers of mlp_only_layers
  append(rules, kMoeRules);
  if (config.shared_expert_intermediate_size > 0) append(rules, kGatedSharedExpertRules);
  append(rules, kQwen3NextMtpModuleRules);
  return rules;
}

// The four first supported come first, so that messages listing them read as they did.
const Architecture kArchitectures[] = {
    {"llama", "LlamaForCausalLM", ExpertLayers::kNone, MtpPlacement::kNone, false, false, llama_rules},
    {"qwen3", "Qwen3ForCausalLM", ExpertLayers::kNone, MtpPlacement::kNone, false, false, qwen3_rules},
    {"deepseek_v3", "DeepseekV3ForCausalLM", ExpertLayers::kFirstKDense, MtpPlacement::kDecoderLayers, false, true,
     deepseek_rules},
    {"qwen3_next", "Qwen3NextForCausalLM", ExpertLayers::kSparseStep, MtpPlacement::kMtpModule, true, false,
     qwen3_next_rules},
    {"qwen3_moe", "Qwen3MoeForCausalLM", ExpertLayers::kSparseStep, MtpPlacement::kNone, false, false, qwen3_moe_rules},
    {"mixtral", "MixtralForCausalLM", ExpertLayers::kEveryLayer, MtpPlacement::kNone, false, false, mixtral_rules},
    // Kimi-K2 ships DeepSeek-V3's architecture and names under its own model_type.
    {"kimi_k2", "DeepseekV3ForCausalLM", ExpertLayers::kFirstKDense, MtpPlacement::kDecoderLayers, false, true,
     deepseek_rules},
    {"glm4_moe", "Glm4MoeForCausalLM", ExpertLayers::kFirstKDense, MtpPlacement::kDecoderLayers, false, false,
     glm4_moe_rules},
};

/// The checkpoint prefix of a decoder layer's tensors, which Qwen3-Next's MTP layers swap
/// for kQwen3NextMtpLayerPrefix (counted from 0 there).
constexpr std::string_view kDecoderLayerPrefix = "model.layers.{layer}.";
constexpr std::string_view kQwen3NextMtpLayerPrefix = "mtp.layers.{layer}.";

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

/// The name of a block-quantized weight's scale, as checkpoints and vLLM name it:
/// X.weight -> X.weight_scale_inv, experts.w13_weight -> experts.w13_weight_scale_inv.
std::string block_scale_name(const std::string& weight) { return weight + "_scale_inv"; }

int64_t ceil_div(int64_t value, int64_t divisor) { return (value + divisor - 1) / divisor; }

/// Whether a checkpoint tensor's module (its name without ".weight") is one that
/// modules_to_not_convert leaves unquantized: an entry matches whole dot-separated
/// components of the module name ("lm_head", "mlp.gate", "model.layers.0.self_attn.q_proj").
bool left_unquantized(const ModelConfig& config, std::string_view tensor) {
  std::string module(tensor);
  if (module.ends_with(".weight")) module.resize(module.size() - 7);
  std::string dotted = "." + module + ".";
  for (const std::string& entry : config.quantization.modules_to_not_convert) {
    if (!entry.empty() && dotted.find("." + entry + ".") != std::string::npos) return true;
  }
  return false;
}

/// Where the rules of an architecture apply: which layers have experts, full attention,
/// and how MTP layers are named.
class LayerScopes {
 public:
  LayerScopes(const Architecture& architecture, const ModelConfig& config)
      : architecture_(architecture), config_(config) {}

  int64_t total_layers() const { return config_.num_hidden_layers + mtp_layer_count(config_); }
  bool mtp(int64_t layer) const { return layer >= config_.num_hidden_layers; }

  /// Whether `layer` has routed experts. vLLM decides Qwen3-Next's from the layer's index in
  /// its own name, so an MTP layer mtp.layers.{i} counts as layer i there.
  bool has_experts(int64_t layer) const {
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

  /// Whether `layer` has full attention (else Gated DeltaNet): every layer of the other
  /// architectures and every MTP layer; for Qwen3-Next layer_types, or every
  /// full_attention_interval-th layer (4 when absent, as transformers' Qwen3NextConfig).
  bool has_full_attention(int64_t layer) const {
    if (!architecture_.linear_attention || mtp(layer)) return true;
    if (!config_.layer_types.empty()) return config_.layer_types[static_cast<size_t>(layer)] == "full_attention";
    int64_t interval = config_.full_attention_interval > 0 ? config_.full_attention_interval : 4;
    return (layer + 1) % interval == 0;
  }

  /// A rule's pattern expanded for `layer`: Qwen3-Next names its MTP layers mtp.layers.{i}
  /// from 0 where DeepSeek-V3 continues model.layers.{num_hidden_layers + i}.
  std::string expand_name(std::string_view pattern, int64_t layer, int64_t expert) const {
    if (architecture_.mtp == MtpPlacement::kMtpModule && mtp(layer) && pattern.starts_with(kDecoderLayerPrefix)) {
      std::string renamed = std::string(kQwen3NextMtpLayerPrefix) + std::string(pattern.substr(kDecoderLayerPrefix.size()));
      return expand(renamed, layer - config_.num_hidden_layers, expert);
    }
    return expand(pattern, layer, expert);
  }

  /// Calls visit(rule, layer, expert) for every rule of every layer that it applies to:
  /// global rules first (layer -1), then layer by layer in rule order (expert -1 outside
  /// experts, else every routed expert).
  template <typename Visit>
  void for_each(const std::vector<MappingRule>& rules, int64_t experts, Visit&& visit) const {
    bool tied = config_.tie_word_embeddings;
    for (const MappingRule& rule : rules) {
      if (rule.scope != LayerScope::kGlobal) continue;
      if (tied && rule.tensor == "lm_head.weight") continue;
      visit(rule, -1, -1);
    }
    for (int64_t layer = 0; layer < total_layers(); ++layer) {
      bool moe = has_experts(layer);
      bool full_attention = has_full_attention(layer);
      for (const MappingRule& rule : rules) {
        switch (rule.scope) {
          case LayerScope::kGlobal: break;
          case LayerScope::kLayer: visit(rule, layer, -1); break;
          case LayerScope::kFullAttention:
            if (full_attention) visit(rule, layer, -1);
            break;
          case LayerScope::kLinearAttention:
            if (!full_attention) visit(rule, layer, -1);
            break;
          case LayerScope::kMtpModule:
            if (layer == config_.num_hidden_layers) visit(rule, layer, -1);
            break;
          case LayerScope::kDenseMlp:
            if (!moe) visit(rule, layer, -1);
            break;
          case LayerScope::kMoe:
            if (moe) visit(rule, layer, -1);
            break;
          case LayerScope::kExpert:
            if (moe) {
              for (int64_t expert = 0; expert < experts; ++expert) visit(rule, layer, expert);
            }
            break;
          case LayerScope::kMtp:
            if (mtp(layer)) visit(rule, layer, -1);
            break;
        }
      }
    }
  }

 private:
  const Architecture& architecture_;
  const ModelConfig& config_;
};

/// The slice of one tensor a rank takes, and the rows it occupies in its parameter (more
/// than the slice's rows for vocabulary padding).
struct Slice {
  int64_t row_begin = 0, rows = 0, column_begin = 0, columns = 0, slot_rows = 0;
};

int64_t divide_exactly(int64_t extent, int64_t parts, const std::string& what) {
  WS_EXPECT(parts > 0 && extent % parts == 0, ErrorCode::kModel,
            what + ": extent " + std::to_string(extent) + " does not divide among " + std::to_string(parts) +
                " tensor-parallel ranks");
  return extent / parts;
}
Slice slice_for_rank(const MappingRule& rule, Split split, const std::vector<int64_t>& shape,
                     const Dimensions& dimensions, const Parallelism& parallel, const std::string& tensor) {
  int64_t rows = shape.empty() ? 1 : shape[0];
  int64_t columns = 1;
  for (size_t i = 1; i < shape.size(); ++i) columns *= shape[i];
  Slice slice{0, rows, 0, columns, rows};
  int64_t size = parallel.tp_size, rank = parallel.tp_rank;
  std::string what = "tensor " + tensor + " (rule " + rule.tensor + ", " + std::string(split_name(split)) + " split)";
  switch (split) {
    case Split::kReplicated: break;
    case Split::kColumn: {
      int64_t share = divide_exactly(rows, size, what);
      slice = {rank * share, share, 0, columns, share};
      break;
    }
    case Split::kRow: {
      WS_EXPECT(shape.size() >= 2, ErrorCode::kModel, what + ": a row split needs two dimensions");
      int64_t share = divide_exactly(columns, size, what);
      slice = {0, rows, rank * share, share, rows};
      break;
    }
    case Split::kVocab: {
      int64_t padded = (rows + kVocabPadding - 1) / kVocabPadding * kVocabPadding;
      int64_t share = divide_exactly(padded, size, what + " padded to a multiple of 64");
      int64_t begin = std::min(rank * share, rows);
      int64_t end = std::min((rank + 1) * share, rows);
      slice = {begin, end - begin, 0, columns, share};
      break;
    }
    case Split::kKvHeads: {
      int64_t heads = dimensions.at("kv_heads");
      int64_t head_dim = dimensions.at("head_dim");
      WS_EXPECT(rows == heads * head_dim, ErrorCode::kModel,
                what + ": " + std::to_string(rows) + " rows are not " + std::to_string(heads) + " K/V heads of " +
                    std::to_string(head_dim));
      if (size <= heads) {
        int64_t share = divide_exactly(heads, size, what + " (K/V heads)") * head_dim;
        slice = {rank * share, share, 0, columns, share};
      } else {
        // More ranks than K/V heads: each head is replicated on tp_size / heads ranks.
        WS_EXPECT(size % heads == 0, ErrorCode::kModel,
                  what + ": tp_size " + std::to_string(size) + " is not a multiple of the " + std::to_string(heads) +
                      " K/V heads");
        int64_t head = rank / (size / heads);
        slice = {head * head_dim, head_dim, 0, columns, head_dim};
      }
      break;
    }
    case Split::kColumnSections:
      WS_FAIL(ErrorCode::kModel, what + ": a sectioned tensor takes one slice per section (section_slices)");
  }
  return slice;
}

/// The slices of a Split::kColumnSections tensor a rank takes, one per section in order,
/// each with its part id: the rank's share of every section (vLLM's
/// mamba_v2_sharded_weight_loader, without its duplicated groups, which Qwen3-Next does not use).
std::vector<std::pair<std::string, Slice>> section_slices(const MappingRule& rule, const std::vector<int64_t>& shape,
                                                          const Dimensions& dimensions, const Parallelism& parallel,
                                                          const std::string& tensor) {
  int64_t rows = shape.empty() ? 1 : shape[0];
  int64_t columns = 1;
  for (size_t i = 1; i < shape.size(); ++i) columns *= shape[i];
  std::string what = "tensor " + tensor + " (rule " + rule.tensor + ", column_sections split)";
  WS_EXPECT(!rule.sections.empty(), ErrorCode::kModel, what + ": the rule names no sections");
  std::vector<std::pair<std::string, Slice>> slices;
  int64_t begin = 0;
  for (const RowSection& section : rule.sections) {
    auto it = dimensions.find(section.rows);
    WS_EXPECT(it != dimensions.end() && it->second > 0, ErrorCode::kModel,
              what + ": section '" + section.part + "' has dimension '" + section.rows +
                  "', which is missing or zero in config.json");
    int64_t extent = it->second;
    WS_EXPECT(extent <= rows - begin, ErrorCode::kModel,
              what + ": section '" + section.part + "' (" + section.rows + " = " + std::to_string(extent) +
                  " rows from row " + std::to_string(begin) + ") runs past the tensor's " + std::to_string(rows) +
                  " rows");
    int64_t share = divide_exactly(extent, parallel.tp_size, what + " section '" + section.part + "' (" + section.rows + ")");
    slices.emplace_back(section.part, Slice{begin + parallel.tp_rank * share, share, 0, columns, share});
    begin += extent;
  }
  WS_EXPECT(begin == rows, ErrorCode::kModel,
            what + ": its sections cover " + std::to_string(begin) + " of the tensor's " + std::to_string(rows) + " rows");
  return slices;
}

/// A parameter being assembled from its parts.
struct PendingParameter {
  Parameter parameter;
  bool stacked = false;
  bool linear = false;
  /// FP8 block quantization: the parts are F8_E4M3 codes with block scales (null: not quantized).
  std::optional<bool> block_quantized;
  std::map<int64_t, int64_t> next_row;  ///< per stack index (local expert), rows filled so far
  std::vector<std::pair<int64_t, int64_t>> placement;  ///< per part: stack index, first row
  int64_t columns = -1;
  int64_t rank = 0;  ///< dimensions of the checkpoint tensors
  /// The checkpoint tensors' dimensions after the first ([1, kernel] for conv1d): kept in
  /// the parameter's shape when its parts take whole rows, as vLLM's conv1d [rows, 1, kernel].
  std::vector<int64_t> trailing;
};

class LayoutBuilder {
 public:
  LayoutBuilder(const Architecture& architecture, const ModelConfig& config, const LayoutOptions& options)
      : config_(config),
        options_(options),
        scopes_(architecture, config),
        dimensions_(model_dimensions(config)) {
    const Parallelism& parallel = options.parallel;
    WS_EXPECT(parallel.tp_size >= 1 && parallel.tp_rank >= 0 && parallel.tp_rank < parallel.tp_size,
              ErrorCode::kModel,
              "tp_rank " + std::to_string(parallel.tp_rank) + " is outside tp_size " + std::to_string(parallel.tp_size));
    WS_EXPECT(parallel.ep_size >= 1 && parallel.ep_rank >= 0 && parallel.ep_rank < parallel.ep_size,
              ErrorCode::kModel,
              "ep_rank " + std::to_string(parallel.ep_rank) + " is outside ep_size " + std::to_string(parallel.ep_size));
    WS_EXPECT(config.num_attention_heads % parallel.tp_size == 0, ErrorCode::kModel,
              config.model_type + ": " + std::to_string(config.num_attention_heads) +
                  " attention heads do not divide among tp_size " + std::to_string(parallel.tp_size));
    dtype_ = options.dtype.value_or(config.torch_dtype == "float16"   ? Dtype::kF16
                                    : config.torch_dtype == "float32" ? Dtype::kF32
                                                                      : Dtype::kBF16);
    block_quantized_ = fp8_block_quantized(config);
    if (block_quantized_) {
      WS_EXPECT(options.quantize == Processing::kNone, ErrorCode::kModel,
                config.model_type + ": the checkpoint's weights are FP8 block-quantized already " +
                    "(quantization_config); online quantization (fp8, per tensor) does not apply to them");
      block_n_ = config.quantization.weight_block_size[0];
      block_k_ = config.quantization.weight_block_size[1];
    }
    experts_ = routed_experts(config);
    if (experts_ > 0 && parallel.ep_size > 1) {
      WS_EXPECT(experts_ % parallel.ep_size == 0, ErrorCode::kModel,
                config.model_type + ": " + std::to_string(experts_) + " routed experts do not divide among ep_size " +
                    std::to_string(parallel.ep_size));
      experts_per_rank_ = experts_ / parallel.ep_size;
      first_expert_ = parallel.ep_rank * experts_per_rank_;
    } else {
      experts_per_rank_ = experts_;
    }
    if (architecture.linear_attention && !config.layer_types.empty()) {
      WS_EXPECT(static_cast<int64_t>(config.layer_types.size()) == config.num_hidden_layers, ErrorCode::kModel,
                config.model_type + ": layer_types has " + std::to_string(config.layer_types.size()) +
                    " entries for num_hidden_layers = " + std::to_string(config.num_hidden_layers));
      for (size_t layer = 0; layer < config.layer_types.size(); ++layer) {
        const std::string& type = config.layer_types[layer];
        WS_EXPECT(type == "full_attention" || type == "linear_attention", ErrorCode::kModel,
                  config.model_type + ": layer_types[" + std::to_string(layer) + "] = '" + type +
                      "': expected full_attention or linear_attention");
      }
    }
    layout_.set_description(describe());
  }

  ModelLayout build(const std::vector<MappingRule>& rules) {
    expect_bounded_size(rules, scopes_.total_layers());
    expect_linear_attention_heads_divide();
    for (int64_t layer = 0; layer < scopes_.total_layers(); ++layer) {
      layout_.set_layer_kind(layer, scopes_.mtp(layer) ? LayerKind::kMtp : LayerKind::kDecoder);
    }
    scopes_.for_each(rules, experts_, [this](const MappingRule& rule, int64_t layer, int64_t expert) {
      apply(rule, layer, expert);
    });
    for (PendingParameter& pending : pending_) finish(pending);
    if (config_.tie_word_embeddings && layout_.find("model.embed_tokens.weight")) add_tied_lm_head();
    for (const std::string& rule : ignore_rules(config_)) layout_.add_ignore_rule(rule);
    return std::move(layout_);
  }

 private:
  /// config.json is untrusted: refuses, before building, a config whose layers, experts
  /// and rules would map more tensors than allowed (every parameter part costs memory).
  void expect_bounded_size(const std::vector<MappingRule>& rules, int64_t total_layers) const {
    long double global = 0, per_layer = 0, per_expert = 0;
    for (const MappingRule& rule : rules) {
      long double parts = static_cast<long double>(std::max<size_t>(rule.sections.size(), 1));
      if (rule.scope == LayerScope::kGlobal) global += parts;
      else if (rule.scope == LayerScope::kExpert) per_expert += parts;
      else per_layer += parts;
    }
    long double bound = global + static_cast<long double>(std::max<int64_t>(total_layers, 0)) *
                                     (per_layer + static_cast<long double>(std::max<int64_t>(experts_, 0)) * per_expert);
    if (block_quantized_) bound *= 2;  // a scale per quantized weight
    uint64_t limit = options_.max_tensors > 0 ? options_.max_tensors : kMaxLayoutTensors;
    if (bound <= static_cast<long double>(limit)) return;
    WS_FAIL(ErrorCode::kModel,
            config_.model_type + ": config.json describes up to " + std::to_string(static_cast<uint64_t>(std::min<long double>(bound, 1e19L))) +
                " tensors (num_hidden_layers = " + std::to_string(config_.num_hidden_layers) +
                ", MTP layers = " + std::to_string(mtp_layer_count(config_)) + ", routed experts = " +
                std::to_string(experts_) + "), more than " +
                (options_.max_tensors > 0 ? std::to_string(limit) + " that the checkpoint's tensors allow"
                                          : std::to_string(limit) + ", the most any model may map") +
                ": the layout is not built");
  }

  std::string describe() const {
    const Parallelism& parallel = options_.parallel;
    std::string text = config_.model_type + " tp " + std::to_string(parallel.tp_size) + " rank " +
                       std::to_string(parallel.tp_rank);
    if (parallel.ep_size > 1) {
      text += " ep " + std::to_string(parallel.ep_size) + " rank " + std::to_string(parallel.ep_rank);
    }
    if (options_.modules == LayoutModules::kDraft) text += " (draft)";
    return text;
  }

  std::string rank_text() const {
    return "tp " + std::to_string(options_.parallel.tp_size) + " rank " + std::to_string(options_.parallel.tp_rank);
  }

  /// vLLM gives each rank whole key heads of a Gated DeltaNet layer (in_proj_qkvz and
  /// in_proj_ba by key-head group, conv1d's q and k sections) and whole value heads (conv1d's
  /// v section, A_log, dt_bias, out_proj's columns); it floors a share that does not divide,
  /// so such a tp_size is refused here.
  void expect_linear_attention_heads_divide() const {
    int64_t size = options_.parallel.tp_size;
    if (size == 1 || options_.modules == LayoutModules::kDraft) return;
    for (int64_t layer = 0; layer < config_.num_hidden_layers; ++layer) {
      if (scopes_.has_full_attention(layer)) continue;
      int64_t keys = config_.linear_num_key_heads, values = config_.linear_num_value_heads;
      WS_EXPECT(keys % size == 0 && values % size == 0, ErrorCode::kModel,
                config_.model_type + " tp " + std::to_string(size) + ": the Gated DeltaNet layers (layer " +
                    std::to_string(layer) + " first) have " + std::to_string(keys) +
                    " key heads (linear_num_key_heads) and " + std::to_string(values) +
                    " value heads (linear_num_value_heads), which do not both divide among tp_size " +
                    std::to_string(size) + ": each rank holds whole key and value heads of linear_attn.in_proj_qkvz, "
                    "in_proj_ba, conv1d, A_log, dt_bias and out_proj; use a tp_size that divides " +
                    std::to_string(std::gcd(keys, values)));
      return;
    }
  }

  bool module_wants(int64_t layer) const {
    bool mtp = scopes_.mtp(layer);
    return options_.modules == LayoutModules::kDraft ? layer >= 0 && mtp : !mtp;
  }

  void apply(const MappingRule& rule, int64_t layer, int64_t expert) {
    std::string tensor = scopes_.expand_name(rule.tensor, layer, expert);
    bool quantized = block_quantized_ && rule.linear && !left_unquantized(config_, tensor);
    auto skip = [&](const std::string& reason) {
      layout_.add_skipped_tensor(tensor, reason);
      if (quantized) layout_.add_skipped_tensor(block_scale_name(tensor), reason);
    };
    if (!module_wants(layer)) {
      skip(options_.modules == LayoutModules::kDraft ? "the target module (this layout is the draft)"
                                                     : "the draft module (MTP layer " + std::to_string(layer) + ")");
      return;
    }
    int64_t local_expert = 0;
    Split split = rule.split;
    if (expert >= 0 && options_.parallel.ep_size > 1) {
      if (expert < first_expert_ || expert >= first_expert_ + experts_per_rank_) {
        skip("expert " + std::to_string(expert) + " of expert-parallel rank " + std::to_string(expert / experts_per_rank_));
        return;
      }
      // Expert parallelism keeps each expert whole on its rank.
      split = Split::kReplicated;
      local_expert = expert - first_expert_;
    } else if (expert >= 0) {
      local_expert = expert;
    }
    std::vector<int64_t> shape;
    for (const std::string& dimension : rule.shape) {
      auto it = dimensions_.find(dimension);
      WS_EXPECT(it != dimensions_.end() && it->second > 0, ErrorCode::kModel,
                config_.model_type + " rule " + rule.tensor + ": dimension '" + dimension +
                    "' is missing or zero in config.json");
      shape.push_back(it->second);
    }
    std::vector<std::pair<std::string, Slice>> slices = split == Split::kColumnSections
        ? section_slices(rule, shape, dimensions_, options_.parallel, tensor)
        : std::vector<std::pair<std::string, Slice>>{{rule.part, slice_for_rank(rule, split, shape, dimensions_,
                                                                                  options_.parallel, tensor)}};

    std::string name = scopes_.expand_name(rule.parameter, layer, expert);
    auto [it, inserted] = pending_index_.try_emplace(name, pending_.size());
    if (inserted) {
      PendingParameter pending;
      pending.parameter.name = name;
      pending.parameter.dtype = rule.dtype.value_or(dtype_);
      pending.parameter.load_dtype = pending.parameter.dtype;
      pending.parameter.layer = layer;
      pending.stacked = expert >= 0;
      pending.linear = rule.linear;
      pending.rank = static_cast<int64_t>(shape.size());
      if (shape.size() > 1) pending.trailing.assign(shape.begin() + 1, shape.end());
      pending_.push_back(std::move(pending));
    }
    PendingParameter& pending = pending_[it->second];
    for (const auto& [id, slice] : slices) {
      WS_EXPECT(pending.columns < 0 || pending.columns == slice.columns, ErrorCode::kModel,
                "parameter " + name + ": part '" + id + "' from " + tensor + " has " + std::to_string(slice.columns) +
                    " columns per rank, earlier parts " + std::to_string(pending.columns));
      // vLLM refuses a fused layer whose shards are quantized in part ("Detected some but not
      // all shards of ... are quantized"): one scale layout holds for a whole parameter.
      WS_EXPECT(!pending.block_quantized || *pending.block_quantized == quantized, ErrorCode::kModel,
                "parameter " + name + ": part '" + id + "' from " + tensor + " is " +
                    (quantized ? "FP8 block-quantized" : "left unquantized (modules_to_not_convert)") +
                    " but earlier parts are not: a fused parameter is quantized whole or not at all");
      pending.block_quantized = quantized;
      pending.columns = slice.columns;
      int64_t& row = pending.next_row[local_expert];
      ParameterPart part;
      part.tensor = tensor;
      part.id = id;
      part.shape = shape;
      part.row_begin = slice.row_begin;
      part.rows = slice.rows;
      part.column_begin = slice.column_begin;
      part.columns = slice.columns;
      part.rule = rule.tensor + " -> " + rule.parameter + (id.empty() ? "" : "[" + id + "]") + ", " +
                  std::string(split_name(split));
      pending.placement.emplace_back(local_expert, row);
      pending.parameter.parts.push_back(std::move(part));
      row += slice.slot_rows;
    }
  }

  /// The F32 block scales of a block-quantized parameter, as vLLM's Fp8LinearMethod and
  /// FusedMoE hold them for weight_block_size [block_n, block_k]: each part's rank slice
  /// in blocks, parts' block-rows concatenated in part order (per expert when stacked).
  /// A slice that does not start on a block boundary, or whose extent is not whole blocks
  /// (except the last part of a parameter that takes the tensor's full rows, whose last
  /// block may be partial), is refused as vLLM's validate_fp8_block_shape refuses it.
  Parameter block_scale(const PendingParameter& pending) const {
    const Parameter& weight = pending.parameter;
    Parameter scale;
    scale.name = block_scale_name(weight.name);
    scale.dtype = Dtype::kF32;
    scale.load_dtype = Dtype::kF32;
    scale.layer = weight.layer;
    std::string block = "[" + std::to_string(block_n_) + ", " + std::to_string(block_k_) + "]";
    auto refuse = [&](const ParameterPart& part, const std::string& what) {
      WS_FAIL(ErrorCode::kModel,
              "parameter " + weight.name + " on " + rank_text() + ": part " +
                  (part.id.empty() ? std::string() : "'" + part.id + "' ") + "from " + part.tensor + " takes " + what +
                  ", which does not fall on the weight_block_size " + block +
                  " boundaries of its FP8 block scales (vLLM refuses this split too); use a tp size that divides " +
                  "the tensor in whole blocks");
    };
    // The last part of each stack (expert) may end in a partial block.
    std::map<int64_t, size_t> last_part;
    for (size_t i = 0; i < weight.parts.size(); ++i) last_part[pending.placement[i].first] = i;
    std::map<int64_t, int64_t> next_block_row;
    std::vector<std::pair<int64_t, int64_t>> placement;
    int64_t block_columns = -1;
    for (size_t i = 0; i < weight.parts.size(); ++i) {
      const ParameterPart& part = weight.parts[i];
      int64_t tensor_rows = part.tensor_rows(), tensor_columns = part.tensor_columns();
      bool whole_rows = part.row_begin == 0 && part.rows == tensor_rows;
      bool partial_rows_allowed = whole_rows && last_part[pending.placement[i].first] == i;
      if (part.row_begin % block_n_ != 0 || (part.rows % block_n_ != 0 && !partial_rows_allowed)) {
        refuse(part, "rows " + std::to_string(part.row_begin) + "+" + std::to_string(part.rows) + " of " +
                         std::to_string(tensor_rows));
      }
      bool whole_columns = part.column_begin == 0 && part.columns == tensor_columns;
      if (part.column_begin % block_k_ != 0 || (part.columns % block_k_ != 0 && !whole_columns)) {
        refuse(part, "columns " + std::to_string(part.column_begin) + "+" + std::to_string(part.columns) + " of " +
                         std::to_string(tensor_columns));
      }
      ParameterPart blocks;
      blocks.tensor = block_scale_name(part.tensor);
      blocks.id = part.id;
      blocks.shape = {ceil_div(tensor_rows, block_n_), ceil_div(tensor_columns, block_k_)};
      blocks.row_begin = part.row_begin / block_n_;
      blocks.rows = ceil_div(part.rows, block_n_);
      blocks.column_begin = part.column_begin / block_k_;
      blocks.columns = ceil_div(part.columns, block_k_);
      blocks.rule = part.rule + ", " + block + " block scales";
      block_columns = blocks.columns;
      int64_t stack = pending.placement[i].first;
      int64_t& row = next_block_row[stack];
      placement.emplace_back(stack, row);
      row += blocks.rows;
      scale.parts.push_back(std::move(blocks));
    }
    int64_t block_rows = 0;
    for (const auto& [stack, rows] : next_block_row) block_rows = std::max(block_rows, rows);
    scale.shape = pending.stacked ? std::vector<int64_t>{experts_per_rank_, block_rows, block_columns}
                                  : std::vector<int64_t>{block_rows, block_columns};
    for (size_t i = 0; i < scale.parts.size(); ++i) {
      auto [stack, row] = placement[i];
      scale.parts[i].element_offset =
          static_cast<uint64_t>(stack * block_rows + row) * static_cast<uint64_t>(block_columns);
    }
    return scale;
  }

  void finish(PendingParameter& pending) {
    Parameter& parameter = pending.parameter;
    int64_t block_rows = 0;
    for (const auto& [expert, rows] : pending.next_row) block_rows = std::max(block_rows, rows);
    int64_t columns = pending.columns;
    if (pending.stacked) {
      parameter.shape = {experts_per_rank_, block_rows, columns};
    } else if (pending.rank <= 1) {
      parameter.shape = {block_rows};
    } else if (pending.rank > 2 && columns == std::accumulate(pending.trailing.begin(), pending.trailing.end(),
                                                               int64_t{1}, std::multiplies<>())) {
      parameter.shape = {block_rows};
      parameter.shape.insert(parameter.shape.end(), pending.trailing.begin(), pending.trailing.end());
    } else {
      parameter.shape = {block_rows, columns};
    }
    for (size_t i = 0; i < parameter.parts.size(); ++i) {
      auto [stack, row] = pending.placement[i];
      parameter.parts[i].element_offset =
          static_cast<uint64_t>(stack * block_rows + row) * static_cast<uint64_t>(columns);
    }
    if (pending.block_quantized.value_or(false)) {
      // Held as the checkpoint ships it: E4M3 codes, and the block scales beside them.
      Parameter scale = block_scale(pending);
      parameter.dtype = Dtype::kF8E4M3;
      parameter.load_dtype = Dtype::kF8E4M3;
      parameter.block_scale = scale.name;
      parameter.scale_block = {block_n_, block_k_};
      layout_.add_parameter(std::move(parameter));
      layout_.add_parameter(std::move(scale));
      return;
    }
    bool quantize = pending.linear && options_.quantize == Processing::kFp8PerTensor;
    if (quantize) {
      parameter.processing = Processing::kFp8PerTensor;
      parameter.load_dtype = parameter.dtype;
      parameter.dtype = Dtype::kF8E4M3;
      parameter.scale = scale_name(parameter.name);
    }
    int64_t layer = parameter.layer;
    std::string scale = parameter.scale;
    layout_.add_parameter(std::move(parameter));
    if (quantize) {
      Parameter scale_parameter;
      scale_parameter.name = scale;
      scale_parameter.dtype = Dtype::kF32;
      scale_parameter.load_dtype = Dtype::kF32;
      scale_parameter.shape = {1};
      scale_parameter.layer = layer;
      layout_.add_parameter(std::move(scale_parameter));
    }
  }

  void add_tied_lm_head() {
    const Parameter& embedding = layout_.parameter("model.embed_tokens.weight");
    Parameter lm_head;
    lm_head.name = "lm_head.weight";
    lm_head.dtype = embedding.dtype;
    lm_head.load_dtype = embedding.dtype;
    lm_head.shape = embedding.shape;
    lm_head.layer = -1;
    layout_.add_parameter(std::move(lm_head));
    // Tied checkpoints may still carry a copy; the hook derives it from the embedding.
    layout_.add_ignore_rule("lm_head.weight");
  }

  const ModelConfig& config_;
  const LayoutOptions& options_;
  LayerScopes scopes_;
  Dimensions dimensions_;
  Dtype dtype_ = Dtype::kBF16;
  bool block_quantized_ = false;
  int64_t block_n_ = 0, block_k_ = 0;
  int64_t experts_ = 0;
  int64_t experts_per_rank_ = 0;
  int64_t first_expert_ = 0;
  ModelLayout layout_;
  std::vector<PendingParameter> pending_;
  std::map<std::string, size_t, std::less<>> pending_index_;
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

ModelLayout build_model_layout(const ModelConfig& config, const LayoutOptions& options) {
  const Architecture& architecture = architecture_of(config);
  std::vector<MappingRule> rules = architecture.rules(config);
  return LayoutBuilder(architecture, config, options).build(rules);
}

namespace detail {

std::vector<CheckpointTensor> checkpoint_tensors(const ModelConfig& config, Dtype dtype) {
  const Architecture* architecture = find_architecture(config.model_type);
  WS_EXPECT(architecture != nullptr, ErrorCode::kInvalidArgument,
            "no tensor list for model_type " + detail::quoted_name(config.model_type) + ": " + supported_model_types());
  bool quantized = fp8_block_quantized(config);
  Dimensions dimensions = model_dimensions(config);
  LayerScopes scopes(*architecture, config);
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
