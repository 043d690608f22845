// Mixtral (MixtralForCausalLM): llama attention and routed experts in every layer.
#include "model/families/family_rules.hpp"

namespace weightstream::families {
namespace {

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

}  // namespace

std::vector<MappingRule> mixtral_rules(const ModelConfig&) {
  std::vector<MappingRule> rules = llama_global_rules();
  append_llama_attention(rules);
  append(rules, kMixtralMoeRules);
  return rules;
}

}  // namespace weightstream::families
