// The mapping tables of the supported architectures, and the one builder that turns a
// table, a config and this rank's place into a ModelLayout. Adding an architecture means
// adding a table, not code.
#include <algorithm>

#include "weightstream/error.hpp"
#include "weightstream/model.hpp"

namespace weightstream {
namespace {

using Dimensions = std::map<std::string, int64_t, std::less<>>;

MappingRule rule(std::string tensor, std::string parameter, std::string part, std::vector<std::string> shape,
                 Split split = Split::kReplicated, LayerScope scope = LayerScope::kLayer, bool linear = false,
                 std::optional<Dtype> dtype = std::nullopt) {
  return MappingRule{std::move(tensor), std::move(parameter), std::move(part), std::move(shape), split, scope, linear,
                     dtype};
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

// Splits as vLLM's are for one rank only: build() refuses tp_size above 1 with these layers
// (conv1d's q, k and v sections are each divided among ranks, which no single split says).
const std::vector<MappingRule> kGatedDeltaNetRules = {
    rule("model.layers.{layer}.linear_attn.in_proj_qkvz.weight", "model.layers.{layer}.linear_attn.in_proj_qkvz.weight",
     "", {"linear_qkvz_rows", "hidden"}, Split::kColumn, LayerScope::kLinearAttention, true),
    rule("model.layers.{layer}.linear_attn.in_proj_ba.weight", "model.layers.{layer}.linear_attn.in_proj_ba.weight", "",
     {"linear_ba_rows", "hidden"}, Split::kColumn, LayerScope::kLinearAttention, true),
    rule("model.layers.{layer}.linear_attn.conv1d.weight", "model.layers.{layer}.linear_attn.conv1d.weight", "",
     {"linear_conv_rows", "one", "linear_conv_kernel"}, Split::kColumn, LayerScope::kLinearAttention),
    rule("model.layers.{layer}.linear_attn.dt_bias", "model.layers.{layer}.linear_attn.dt_bias", "", {"linear_v_heads"},
     Split::kColumn, LayerScope::kLinearAttention),
    rule("model.layers.{layer}.linear_attn.A_log", "model.layers.{layer}.linear_attn.A_log", "", {"linear_v_heads"},
     Split::kColumn, LayerScope::kLinearAttention),
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

void append(std::vector<MappingRule>& rules, const std::vector<MappingRule>& more) {
  rules.insert(rules.end(), more.begin(), more.end());
}

bool is_deepseek(const ModelConfig& config) { return config.model_type == "deepseek_v3"; }

bool is_qwen3_next(const ModelConfig& config) { return config.model_type == "qwen3_next"; }

/// The checkpoint prefix of a decoder layer's tensors, which Qwen3-Next's MTP layers swap
/// for kQwen3NextMtpLayerPrefix (counted from 0 there).
constexpr std::string_view kDecoderLayerPrefix = "model.layers.{layer}.";
constexpr std::string_view kQwen3NextMtpLayerPrefix = "mtp.layers.{layer}.";

int64_t routed_experts(const ModelConfig& config) {
  return config.n_routed_experts > 0 ? config.n_routed_experts : config.num_experts;
}

bool is_moe_layer(const ModelConfig& config, int64_t layer) {
  if (routed_experts(config) == 0) return false;
  int64_t frequency = std::max<int64_t>(config.moe_layer_freq, 1);
  return layer >= config.first_k_dense_replace && layer % frequency == 0;
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
  }
  return slice;
}

/// A parameter being assembled from its parts.
struct PendingParameter {
  Parameter parameter;
  bool stacked = false;
  bool linear = false;
  std::map<int64_t, int64_t> next_row;  ///< per stack index (local expert), rows filled so far
  std::vector<std::pair<int64_t, int64_t>> placement;  ///< per part: stack index, first row
  int64_t columns = -1;
  int64_t rank = 0;  ///< dimensions of the checkpoint tensors (1 or 2)
};

class LayoutBuilder {
 public:
  LayoutBuilder(const ModelConfig& config, const LayoutOptions& options)
      : config_(config), options_(options), dimensions_(model_dimensions(config)) {
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
    if (is_qwen3_next(config) && !config.layer_types.empty()) {
      WS_EXPECT(static_cast<int64_t>(config.layer_types.size()) == config.num_hidden_layers, ErrorCode::kModel,
                "qwen3_next: layer_types has " + std::to_string(config.layer_types.size()) +
                    " entries for num_hidden_layers = " + std::to_string(config.num_hidden_layers));
      for (size_t layer = 0; layer < config.layer_types.size(); ++layer) {
        const std::string& type = config.layer_types[layer];
        WS_EXPECT(type == "full_attention" || type == "linear_attention", ErrorCode::kModel,
                  "qwen3_next: layer_types[" + std::to_string(layer) + "] = '" + type +
                      "': expected full_attention or linear_attention");
      }
    }
    layout_.set_description(describe());
  }

  ModelLayout build(const std::vector<MappingRule>& rules) {
    int64_t total_layers = config_.num_hidden_layers + mtp_layer_count(config_);
    expect_bounded_size(rules, total_layers);
    expect_linear_attention_on_one_rank();
    bool tied = config_.tie_word_embeddings;
    for (const MappingRule& rule : rules) {
      if (rule.scope != LayerScope::kGlobal) continue;
      if (tied && rule.tensor == "lm_head.weight") continue;
      apply(rule, -1, -1);
    }
    for (int64_t layer = 0; layer < total_layers; ++layer) {
      bool mtp = layer >= config_.num_hidden_layers;
      layout_.set_layer_kind(layer, mtp ? LayerKind::kMtp : LayerKind::kDecoder);
      bool moe = has_experts(layer);
      bool full_attention = has_full_attention(layer);
      for (const MappingRule& rule : rules) {
        switch (rule.scope) {
          case LayerScope::kGlobal: break;
          case LayerScope::kLayer: apply(rule, layer, -1); break;
          case LayerScope::kFullAttention:
            if (full_attention) apply(rule, layer, -1);
            break;
          case LayerScope::kLinearAttention:
            if (!full_attention) apply(rule, layer, -1);
            break;
          case LayerScope::kMtpModule:
            if (layer == config_.num_hidden_layers) apply(rule, layer, -1);
            break;
          case LayerScope::kDenseMlp:
            if (!moe) apply(rule, layer, -1);
            break;
          case LayerScope::kMoe:
            if (moe) apply(rule, layer, -1);
            break;
          case LayerScope::kExpert:
            if (moe) {
              for (int64_t expert = 0; expert < experts_; ++expert) apply(rule, layer, expert);
            }
            break;
          case LayerScope::kMtp:
            if (mtp) apply(rule, layer, -1);
            break;
        }
      }
    }
    for (PendingParameter& pending : pending_) finish(pending);
    if (tied && layout_.find("model.embed_tokens.weight")) add_tied_lm_head();
    for (const std::string& rule : ignore_rules(config_)) layout_.add_ignore_rule(rule);
    return std::move(layout_);
  }

 private:
  /// config.json is untrusted: refuses, before building, a config whose layers, experts
  /// and rules would map more tensors than allowed (every parameter part costs memory).
  void expect_bounded_size(const std::vector<MappingRule>& rules, int64_t total_layers) const {
    long double global = 0, per_layer = 0, per_expert = 0;
    for (const MappingRule& rule : rules) {
      if (rule.scope == LayerScope::kGlobal) global += 1;
      else if (rule.scope == LayerScope::kExpert) per_expert += 1;
      else per_layer += 1;
    }
    long double bound = global + static_cast<long double>(std::max<int64_t>(total_layers, 0)) *
                                     (per_layer + static_cast<long double>(std::max<int64_t>(experts_, 0)) * per_expert);
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
    if (options_.modules == LayoutModules::kTarget) text += " (target)";
    return text;
  }

  /// Whether `layer` has routed experts. vLLM decides Qwen3-Next's from the layer's index in
  /// its own name, so an MTP layer mtp.layers.{i} counts as layer i there.
  bool has_experts(int64_t layer) const {
    if (!is_qwen3_next(config_)) return is_moe_layer(config_, layer);
    int64_t index = layer >= config_.num_hidden_layers ? layer - config_.num_hidden_layers : layer;
    bool dense = std::find(config_.mlp_only_layers.begin(), config_.mlp_only_layers.end(), index) !=
                 config_.mlp_only_layers.end();
    return !dense && routed_experts(config_) > 0 && (index + 1) % config_.decoder_sparse_step == 0;
  }

  /// Whether `layer` has full attention (else Gated DeltaNet): every layer of the other
  /// architectures and every MTP layer; for Qwen3-Next layer_types, or every
  /// full_attention_interval-th layer (4 when absent, as transformers' Qwen3NextConfig).
  bool has_full_attention(int64_t layer) const {
    if (!is_qwen3_next(config_) || layer >= config_.num_hidden_layers) return true;
    if (!config_.layer_types.empty()) return config_.layer_types[static_cast<size_t>(layer)] == "full_attention";
    int64_t interval = config_.full_attention_interval > 0 ? config_.full_attention_interval : 4;
    return (layer + 1) % interval == 0;
  }

  void expect_linear_attention_on_one_rank() const {
    if (options_.parallel.tp_size == 1 || options_.modules == LayoutModules::kDraft) return;
    for (int64_t layer = 0; layer < config_.num_hidden_layers; ++layer) {
      WS_EXPECT(has_full_attention(layer), ErrorCode::kModel,
                config_.model_type + " tp " + std::to_string(options_.parallel.tp_size) + ": layer " +
                    std::to_string(layer) +
                    " is a Gated DeltaNet layer, whose tensor-parallel split (linear_attn.conv1d's q, k and v "
                    "sections divided each) is not supported yet; use tp_size 1, or a draft layout (its MTP "
                    "layers have full attention)");
    }
  }

  /// A rule's pattern expanded for `layer`: Qwen3-Next names its MTP layers mtp.layers.{i}
  /// from 0 where DeepSeek-V3 continues model.layers.{num_hidden_layers + i}.
  std::string expand_name(std::string_view pattern, int64_t layer, int64_t expert) const {
    if (is_qwen3_next(config_) && layer >= config_.num_hidden_layers && pattern.starts_with(kDecoderLayerPrefix)) {
      std::string renamed = std::string(kQwen3NextMtpLayerPrefix) + std::string(pattern.substr(kDecoderLayerPrefix.size()));
      return expand(renamed, layer - config_.num_hidden_layers, expert);
    }
    return expand(pattern, layer, expert);
  }

  bool module_wants(int64_t layer) const {
    bool mtp = layer >= config_.num_hidden_layers;
    switch (options_.modules) {
      case LayoutModules::kAll: return true;
      case LayoutModules::kTarget: return !mtp;
      case LayoutModules::kDraft: return layer >= 0 && mtp;
    }
    return true;
  }

  void apply(const MappingRule& rule, int64_t layer, int64_t expert) {
    std::string tensor = expand_name(rule.tensor, layer, expert);
    if (!module_wants(layer)) {
      layout_.add_skipped_tensor(tensor, options_.modules == LayoutModules::kDraft
                                             ? "the target module (this layout is the draft)"
                                             : "the draft module (MTP layer " + std::to_string(layer) + ")");
      return;
    }
    int64_t local_expert = 0;
    Split split = rule.split;
    if (expert >= 0 && options_.parallel.ep_size > 1) {
      if (expert < first_expert_ || expert >= first_expert_ + experts_per_rank_) {
        layout_.add_skipped_tensor(tensor, "expert " + std::to_string(expert) + " of expert-parallel rank " +
                                               std::to_string(expert / experts_per_rank_));
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
    Slice slice = slice_for_rank(rule, split, shape, dimensions_, options_.parallel, tensor);

    std::string name = expand_name(rule.parameter, layer, expert);
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
      pending_.push_back(std::move(pending));
    }
    PendingParameter& pending = pending_[it->second];
    WS_EXPECT(pending.columns < 0 || pending.columns == slice.columns, ErrorCode::kModel,
              "parameter " + name + ": part '" + rule.part + "' from " + tensor + " has " +
                  std::to_string(slice.columns) + " columns per rank, earlier parts " +
                  std::to_string(pending.columns));
    pending.columns = slice.columns;
    int64_t& row = pending.next_row[local_expert];
    ParameterPart part;
    part.tensor = tensor;
    part.id = rule.part;
    part.shape = shape;
    part.row_begin = slice.row_begin;
    part.rows = slice.rows;
    part.column_begin = slice.column_begin;
    part.columns = slice.columns;
    part.rule = rule.tensor + " -> " + rule.parameter + (rule.part.empty() ? "" : "[" + rule.part + "]") + ", " +
                std::string(split_name(split));
    pending.placement.emplace_back(local_expert, row);
    pending.parameter.parts.push_back(std::move(part));
    row += slice.slot_rows;
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
    } else {
      parameter.shape = {block_rows, columns};
    }
    for (size_t i = 0; i < parameter.parts.size(); ++i) {
      auto [stack, row] = pending.placement[i];
      parameter.parts[i].element_offset =
          static_cast<uint64_t>(stack * block_rows + row) * static_cast<uint64_t>(columns);
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
  Dimensions dimensions_;
  Dtype dtype_ = Dtype::kBF16;
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
      {"linear_v_heads", config.linear_num_value_heads},
      {"linear_v_head_dim", config.linear_value_head_dim},
      {"linear_value_dim", linear_value_dim},
      {"shared_expert_intermediate", config.shared_expert_intermediate_size},
  };
}

std::vector<MappingRule> mapping_rules(const ModelConfig& config) {
  std::vector<MappingRule> rules;
  if (config.model_type == "llama" || config.model_type == "qwen3") {
    append(rules, kLlamaGlobalRules);
    append(rules, kLlamaLayerRules);
    if (config.model_type == "qwen3") append(rules, kQwen3LayerRules);
    return rules;
  }
  if (is_qwen3_next(config)) {
    append(rules, kLlamaGlobalRules);
    append(rules, kDecoderNormRules);
    append(rules, kGatedAttentionRules);
    append(rules, kGatedDeltaNetRules);
    for (const MappingRule& rule : kLlamaLayerRules) {
      if (rule.scope == LayerScope::kDenseMlp) rules.push_back(rule);  // layers of mlp_only_layers
    }
    append(rules, kMoeRules);
    if (config.shared_expert_intermediate_size > 0) append(rules, kGatedSharedExpertRules);
    append(rules, kQwen3NextMtpModuleRules);
    return rules;
  }
  WS_EXPECT(is_deepseek(config), ErrorCode::kModel,
            (config.source.empty() ? std::string() : config.source + ": ") + "model_type '" + config.model_type +
                "' has no mapping table (supported: llama, qwen3, deepseek_v3, qwen3_next); " +
                "build a ModelLayout through the API instead");
  append(rules, kLlamaGlobalRules);
  append(rules, config.q_lora_rank > 0 ? kMlaQLoraRules : kMlaQRules);
  append(rules, kMlaRules);
  // Dense MLP layers (before first_k_dense_replace) are llama's MLP.
  for (const MappingRule& rule : kLlamaLayerRules) {
    if (rule.scope == LayerScope::kDenseMlp) rules.push_back(rule);
  }
  append(rules, kMoeRules);
  rules.push_back(kMoeScoreBiasRule);
  if (config.n_shared_experts > 0) append(rules, kSharedExpertRules);
  append(rules, kMtpRules);
  return rules;
}

int64_t mtp_layer_count(const ModelConfig& config) {
  return is_deepseek(config) || is_qwen3_next(config) ? config.num_nextn_predict_layers : 0;
}

std::vector<std::string> ignore_rules(const ModelConfig& /*config*/) {
  // Rotary tables are recomputed by every engine; older checkpoints still ship them.
  return {"*.rotary_emb.inv_freq"};
}

ModelLayout build_model_layout(const ModelConfig& config, const LayoutOptions& options) {
  std::vector<MappingRule> rules = mapping_rules(config);
  return LayoutBuilder(config, options).build(rules);
}

}  // namespace weightstream
