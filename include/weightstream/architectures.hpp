#pragma once
/// @file architectures.hpp
/// The supported model architectures: for each, the declarative mapping table that says
/// which checkpoint tensors fill which rows of which parameter on which tensor-parallel
/// rank, and the facts about its layers that build_model_layout (model.hpp) and synth
/// (synth.hpp) read. Adding a family means adding one Architecture.

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weightstream/format.hpp"

namespace weightstream {

/// Vocabulary rows are padded to a multiple of this before they are divided among ranks
/// (as vLLM's VocabParallelEmbedding does); padding rows are zero.
inline constexpr int64_t kVocabPadding = 64;

/// How a checkpoint tensor is divided among tensor-parallel ranks. Tensors are viewed as
/// two-dimensional, [shape[0], product of the other dimensions].
enum class Split {
  kReplicated,  ///< every rank holds the whole tensor
  kColumn,      ///< dim 0 (output features) divided: each rank's slice is one contiguous byte range
  kRow,         ///< dim 1 (input features) divided: each rank's slice is strided
  kVocab,       ///< dim 0 padded to a multiple of kVocabPadding, then divided; padding rows zero
  kKvHeads,     ///< dim 0 divided by K/V heads; heads replicated when tp_size exceeds their count
  /// dim 0 is a run of sections (MappingRule::sections), each divided among ranks: a rank
  /// takes its share of every section, concatenated in section order, one part per section
  /// (vLLM's mamba_v2_sharded_weight_loader, as Qwen3-Next's conv1d over q, k and v).
  kColumnSections,
};

/// "replicated", "column", "row", "vocab", "kv_heads", "column_sections".
std::string_view split_name(Split split) noexcept;

/// Which layers a mapping rule applies to.
enum class LayerScope {
  kGlobal,    ///< once per model (embeddings, final norm, lm_head); {layer} does not appear
  kLayer,     ///< every decoder layer, MTP layers included
  kDenseMlp,  ///< decoder layers with a dense MLP
  kMoe,       ///< decoder layers with routed experts (once per layer)
  kExpert,    ///< every routed expert of a MoE layer that this rank holds; {expert} appears
  kMtp,       ///< multi-token-prediction layers only (enorm, hnorm, eh_proj, shared_head)
  /// Layers with full (softmax) attention: every layer of a model without linear attention,
  /// every full_attention_interval-th layer of Qwen3-Next, and MTP layers.
  kFullAttention,
  kLinearAttention,  ///< Qwen3-Next's Gated DeltaNet (linear attention) layers
  /// Once, with the first MTP layer: the MTP module's weights outside its layers (Qwen3-Next's
  /// mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.norm); no {layer}.
  kMtpModule,
};

/// One section of dim 0 of a tensor divided by Split::kColumnSections.
struct RowSection {
  std::string part;  ///< the part id its slice fills ("q", "k", "v"), unique within the parameter
  std::string rows;  ///< its rows, as the name of a dimension (see model_dimensions)
};

/// One row of a declarative mapping table: which checkpoint tensor fills which part of
/// which parameter, how it is divided among ranks, and its full (unsharded) shape.
struct MappingRule {
  std::string tensor;     ///< checkpoint name pattern, with {layer} and {expert} placeholders
  std::string parameter;  ///< parameter name pattern; without {expert} while `tensor` has it, experts are stacked
  std::string part;       ///< part id within a fused parameter ("q", "k", "v", "0", "1"); empty when whole
  std::vector<std::string> shape;  ///< checkpoint shape as names of dimensions (see model_dimensions)
  Split split = Split::kReplicated;
  LayerScope scope = LayerScope::kLayer;
  bool linear = false;    ///< a linear layer's weight: quantized when the layout quantizes
  /// Parameter dtype when it is not the model's (DeepSeek's router bias stays F32).
  std::optional<Dtype> dtype;
  /// For Split::kColumnSections: dim 0's sections in order, whose rows add up to shape[0].
  /// The rule then fills one part per section (its `part` is unused).
  std::vector<RowSection> sections;
};

/// Where a family's checkpoints put their multi-token-prediction (draft) layers.
enum class MtpPlacement {
  kNone,           ///< the family has no MTP layers
  kDecoderLayers,  ///< model.layers.{num_hidden_layers + i}.* (DeepSeek-V3, Kimi-K2, GLM-4.5)
  kMtpModule,      ///< mtp.layers.{i}.* and mtp.* (Qwen3-Next)
};

/// Which decoder layers of a family have routed experts (the others a dense MLP).
enum class ExpertLayers {
  kNone,         ///< a dense model
  kFirstKDense,  ///< layer >= first_k_dense_replace and layer % moe_layer_freq == 0 (DeepSeek-V3, GLM-4.5)
  kSparseStep,   ///< not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0 (Qwen3-MoE, Qwen3-Next)
  kEveryLayer,   ///< every layer (Mixtral)
};

/// One supported architecture: its model_type, its mapping table and the facts about its
/// layers that build_model_layout and synth read. Adding a family means adding one of these.
struct Architecture {
  std::string_view model_type;  ///< config.json model_type, e.g. "qwen3_moe"
  std::string_view hf_class;    ///< config.json "architectures" entry, e.g. "Qwen3MoeForCausalLM"
  ExpertLayers experts = ExpertLayers::kNone;
  MtpPlacement mtp = MtpPlacement::kNone;
  bool linear_attention = false;  ///< Gated DeltaNet layers between full-attention layers (Qwen3-Next)
  bool mla = false;               ///< multi-head latent attention (DeepSeek-V3, Kimi-K2)
  /// The mapping table for one config of the family (rows depend on it: a q LoRA, shared
  /// experts, attention biases, q/k norms).
  std::vector<MappingRule> (*rules)(const ModelConfig& config) = nullptr;
};

/// Every supported architecture, in the order messages list them.
std::span<const Architecture> architectures() noexcept;
/// The architecture of `model_type`, or null.
const Architecture* find_architecture(std::string_view model_type) noexcept;
/// The architecture of a config. Throws Error(kModel) naming the model_type and the supported ones.
const Architecture& architecture_of(const ModelConfig& config);
/// "llama, qwen3, ..." (every supported model_type).
std::string supported_model_types();

/// True when config.json's quantization_config declares FP8 block-scaled weights (as
/// DeepSeek-V3, Kimi-K2, Qwen3-*-FP8 and GLM-4.5-FP8 ship): quant_method "fp8" with a
/// weight_block_size. Linear weights are then F8_E4M3 and each has an F32
/// X.weight_scale_inv of [ceil(out / block_n), ceil(in / block_k)] (dequantized weight =
/// code x scale). Throws Error(kModel) for a quantization_config that weightstream does not
/// load (another quant_method or fmt, FP8 without weight_block_size, static activations).
bool fp8_block_quantized(const ModelConfig& config);

/// The named dimensions that MappingRule::shape refers to, computed from a config
/// ("hidden", "vocab", "q_rows", "kv_rows", "intermediate", "moe_intermediate", ...).
std::map<std::string, int64_t, std::less<>> model_dimensions(const ModelConfig& config);

/// The mapping table of the config's architecture (architecture_of(config).rules).
/// Throws Error(kModel) naming the model_type when it is not supported.
std::vector<MappingRule> mapping_rules(const ModelConfig& config);

/// MTP layers the config declares (num_nextn_predict_layers) for the architectures that
/// have them (MtpPlacement other than kNone); 0 for the others. Layout layers
/// num_hidden_layers and up; they belong to the draft layout only.
int64_t mtp_layer_count(const ModelConfig& config);

/// Checkpoint tensors that no parameter uses and that are not errors (glob patterns, '*'
/// matches any run of characters), e.g. "*.rotary_emb.inv_freq".
std::vector<std::string> ignore_rules(const ModelConfig& config);

}  // namespace weightstream
