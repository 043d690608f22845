#pragma once
// Where a family's rules apply: which layers have experts, full or linear attention and MTP,
// how a rule's name pattern expands for a layer and an expert, and the names of FP8 scales.
// Shared by the layout builder (layout_builder.cpp) and the checkpoint tensor list
// (checkpoint_tensors.cpp), so that both walk a table the same way.

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "weightstream/architectures.hpp"

namespace weightstream::model {

/// Routed experts of a config, whichever field its family names them by.
int64_t routed_experts(const ModelConfig& config);

/// `pattern` with {layer} and {expert} replaced.
std::string expand(std::string_view pattern, int64_t layer, int64_t expert);

/// The name of a per-tensor FP8 scale: X.weight -> X.weight_scale.
std::string scale_name(const std::string& parameter);

/// The name of a block-quantized weight's scale, as checkpoints and vLLM name it:
/// X.weight -> X.weight_scale_inv, experts.w13_weight -> experts.w13_weight_scale_inv.
inline std::string block_scale_name(const std::string& weight) { return weight + "_scale_inv"; }

inline int64_t ceil_div(int64_t value, int64_t divisor) { return (value + divisor - 1) / divisor; }

/// Whether a checkpoint tensor's module (its name without ".weight") is one that
/// modules_to_not_convert leaves unquantized: an entry matches whole dot-separated
/// components of the module name ("lm_head", "mlp.gate", "model.layers.0.self_attn.q_proj").
bool left_unquantized(const ModelConfig& config, std::string_view tensor);

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
  bool has_experts(int64_t layer) const;

  /// Whether `layer` has full attention (else Gated DeltaNet): every layer of the other
  /// architectures and every MTP layer; for Qwen3-Next layer_types, or every
  /// full_attention_interval-th layer (4 when absent, as transformers' Qwen3NextConfig).
  bool has_full_attention(int64_t layer) const;

  /// A rule's pattern expanded for `layer`: Qwen3-Next names its MTP layers mtp.layers.{i}
  /// from 0 where DeepSeek-V3 continues model.layers.{num_hidden_layers + i}.
  std::string expand_name(std::string_view pattern, int64_t layer, int64_t expert) const;

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

}  // namespace weightstream::model
