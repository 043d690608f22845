#pragma once
// The building blocks of the families' mapping tables (src/model/families/): the rule
// constructors, the blocks several families share, and each family's table function, which
// the list of architectures (architectures.cpp) names. A family's names, fusions and splits
// live in its own file; the one builder that turns a table into a ModelLayout
// (layout_builder.cpp) knows no family.

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "weightstream/architectures.hpp"

namespace weightstream::families {

inline MappingRule rule(std::string tensor, std::string parameter, std::string part, std::vector<std::string> shape,
                        Split split = Split::kReplicated, LayerScope scope = LayerScope::kLayer, bool linear = false,
                        std::optional<Dtype> dtype = std::nullopt) {
  return MappingRule{std::move(tensor), std::move(parameter), std::move(part), std::move(shape), split, scope, linear,
                     dtype};
}

/// A rule of Split::kColumnSections: `tensor`'s dim 0 is `sections` in order, each divided among ranks.
inline MappingRule sectioned_rule(std::string tensor, std::string parameter, std::vector<std::string> shape,
                                  std::vector<RowSection> sections, LayerScope scope) {
  MappingRule made = rule(std::move(tensor), std::move(parameter), "", std::move(shape), Split::kColumnSections, scope);
  made.sections = std::move(sections);
  return made;
}

inline void append(std::vector<MappingRule>& rules, const std::vector<MappingRule>& more) {
  rules.insert(rules.end(), more.begin(), more.end());
}

/// Appends the rules of `more` whose scope is `scope`.
inline void append_scope(std::vector<MappingRule>& rules, const std::vector<MappingRule>& more, LayerScope scope) {
  for (const MappingRule& rule : more) {
    if (rule.scope == scope) rules.push_back(rule);
  }
}

// Blocks that several families share, each defined with the family that introduced it.

/// llama.cpp: the embedding, the final norm and lm_head.
const std::vector<MappingRule>& llama_global_rules();
/// llama.cpp: a decoder layer's norms, fused q/k/v attention and dense gate/up MLP.
const std::vector<MappingRule>& llama_layer_rules();
/// llama.cpp: llama_layer_rules() without the dense MLP (norms and attention).
void append_llama_attention(std::vector<MappingRule>& rules);
/// qwen3.cpp: per-head q_norm and k_norm.
const std::vector<MappingRule>& qk_norm_rules();
/// deepseek_v3.cpp: the router and the routed experts (experts.w13_weight / w2_weight).
const std::vector<MappingRule>& moe_rules();
/// deepseek_v3.cpp: the router's score correction bias, held in F32.
const MappingRule& moe_score_bias_rule();
/// deepseek_v3.cpp: shared experts beside the routed ones.
const std::vector<MappingRule>& shared_expert_rules();
/// deepseek_v3.cpp: what an MTP layer named model.layers.{num_hidden_layers + i} adds to a decoder block.
const std::vector<MappingRule>& decoder_mtp_rules();

// Each family's mapping table for one config (Architecture::rules).

std::vector<MappingRule> llama_rules(const ModelConfig& config);
std::vector<MappingRule> qwen3_rules(const ModelConfig& config);
std::vector<MappingRule> qwen3_moe_rules(const ModelConfig& config);
std::vector<MappingRule> mixtral_rules(const ModelConfig& config);
std::vector<MappingRule> deepseek_v3_rules(const ModelConfig& config);
std::vector<MappingRule> glm4_moe_rules(const ModelConfig& config);
std::vector<MappingRule> qwen3_next_rules(const ModelConfig& config);

}  // namespace weightstream::families
