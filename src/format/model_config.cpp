// The config.json fields weightstream uses. config.json is untrusted: every size that
// later drives an allocation is range-checked here, before anything is allocated.

#include <functional>

#include "format/shared/json_text.hpp"
#include "weightstream/error.hpp"
#include "weightstream/format.hpp"

namespace weightstream {
namespace {

using Json = nlohmann::json;

constexpr int64_t kMaxDimension = int64_t{1} << 20;
constexpr int64_t kMaxCount = int64_t{1} << 16;

// Reads integer fields of one config object with one error style:
// "config.json: num_hidden_layers = -3: must be from 1 to 65536".
class ConfigFields {
 public:
  ConfigFields(std::string_view object, const Json& document) : object_(object), document_(document) {}

  // The field when present and not null.
  const Json* find(std::string_view field) const {
    auto found = document_.find(field);
    return found == document_.end() || found->is_null() ? nullptr : &*found;
  }

  [[noreturn]] void fail(std::string_view field, const std::string& rule) const {
    WS_FAIL(ErrorCode::kFormat, std::string(object_) + ": " + std::string(field) + " " + rule);
  }

  [[noreturn]] void fail_value(std::string_view field, const Json& value, const std::string& rule) const {
    std::string text = value.dump(-1, ' ', false, Json::error_handler_t::replace);
    if (text.size() > 64) text = text.substr(0, 64) + "...";
    fail(field, "= " + text + ": " + rule);
  }

  // An integer field in [low, high]; `fallback` when absent, or an error when absent and required.
  int64_t integer(std::string_view field, int64_t low, int64_t high, std::optional<int64_t> fallback) const {
    const Json* value = find(field);
    if (value == nullptr) {
      if (!fallback) fail(field, "is missing: it is required");
      return *fallback;
    }
    std::string range = "must be from " + std::to_string(low) + " to " + std::to_string(high);
    if (value->is_number_unsigned()) {
      uint64_t number = value->get<uint64_t>();
      if (number > static_cast<uint64_t>(high) || static_cast<int64_t>(number) < low) fail_value(field, *value, range);
      return static_cast<int64_t>(number);
    }
    if (value->is_number_integer()) {
      int64_t number = value->get<int64_t>();
      if (number < low || number > high) fail_value(field, *value, range);
      return number;
    }
    fail_value(field, *value, "must be an integer, not " + std::string(detail::json_type_text(value->type())));
  }

  std::string text(std::string_view field) const {
    const Json* value = find(field);
    if (value == nullptr) return {};
    if (!value->is_string()) {
      fail_value(field, *value, "must be a string, not " + std::string(detail::json_type_text(value->type())));
    }
    return value->get<std::string>();
  }

  // A list field: each element read by `element`; empty when absent.
  template <typename Element>
  std::vector<Element> list(std::string_view field, const std::function<Element(const Json&)>& element) const {
    const Json* value = find(field);
    if (value == nullptr) return {};
    if (!value->is_array() || value->size() > static_cast<size_t>(kMaxCount)) {
      fail_value(field, *value, "must be a list of at most " + std::to_string(kMaxCount) + " elements");
    }
    std::vector<Element> result;
    for (const Json& item : *value) result.push_back(element(item));
    return result;
  }

  bool flag(std::string_view field, bool fallback) const {
    const Json* value = find(field);
    if (value == nullptr) return fallback;
    if (!value->is_boolean()) {
      fail_value(field, *value, "must be true or false, not " + std::string(detail::json_type_text(value->type())));
    }
    return value->get<bool>();
  }

 private:
  std::string_view object_;
  const Json& document_;
};

/// The fields every decoder model has: sizes, heads, vocabulary, dtype.
void read_common_fields(const ConfigFields& fields, ModelConfig& config) {
  config.model_type = fields.text("model_type");
  config.hidden_size = fields.integer("hidden_size", 1, kMaxDimension, std::nullopt);
  config.num_hidden_layers = fields.integer("num_hidden_layers", 1, kMaxCount, std::nullopt);
  config.num_attention_heads = fields.integer("num_attention_heads", 1, kMaxCount, std::nullopt);
  config.vocab_size = fields.integer("vocab_size", 1, kMaxDimension, std::nullopt);
  config.intermediate_size = fields.integer("intermediate_size", 1, kMaxDimension, 0);
  config.num_key_value_heads =
      fields.integer("num_key_value_heads", 1, config.num_attention_heads, config.num_attention_heads);
  if (config.num_attention_heads % config.num_key_value_heads != 0) {
    fields.fail("num_key_value_heads",
                "= " + std::to_string(config.num_key_value_heads) + ": must divide num_attention_heads = " +
                    std::to_string(config.num_attention_heads));
  }
  config.tie_word_embeddings = fields.flag("tie_word_embeddings", false);
  // Newer transformers releases write "dtype" where older ones wrote "torch_dtype".
  config.torch_dtype = fields.text("torch_dtype");
  if (config.torch_dtype.empty()) config.torch_dtype = fields.text("dtype");
}

/// DeepSeek-V3's fields (MLA, routed and shared experts, MTP layers), which GLM-4.5 and
/// Qwen3-Next share in part.
void read_mla_and_moe_fields(const ConfigFields& fields, ModelConfig& config) {
  config.q_lora_rank = fields.integer("q_lora_rank", 1, kMaxDimension, 0);
  config.kv_lora_rank = fields.integer("kv_lora_rank", 1, kMaxDimension, 0);
  config.qk_nope_head_dim = fields.integer("qk_nope_head_dim", 0, kMaxDimension, 0);
  config.qk_rope_head_dim = fields.integer("qk_rope_head_dim", 0, kMaxDimension, 0);
  config.v_head_dim = fields.integer("v_head_dim", 1, kMaxDimension, 0);
  config.n_routed_experts = fields.integer("n_routed_experts", 0, kMaxCount, 0);
  config.n_shared_experts = fields.integer("n_shared_experts", 0, kMaxCount, 0);
  config.moe_intermediate_size = fields.integer("moe_intermediate_size", 1, kMaxDimension, 0);
  config.first_k_dense_replace = fields.integer("first_k_dense_replace", 0, config.num_hidden_layers, 0);
  config.moe_layer_freq = fields.integer("moe_layer_freq", 1, kMaxCount, 1);
  config.num_nextn_predict_layers = fields.integer("num_nextn_predict_layers", 0, kMaxCount, 0);
  // Qwen3-Next and later Qwen releases name the MTP layer count mtp_num_hidden_layers.
  if (fields.find("mtp_num_hidden_layers") != nullptr) {
    int64_t mtp_layers = fields.integer("mtp_num_hidden_layers", 0, kMaxCount, 0);
    if (fields.find("num_nextn_predict_layers") != nullptr && mtp_layers != config.num_nextn_predict_layers) {
      fields.fail("mtp_num_hidden_layers", "= " + std::to_string(mtp_layers) + " and num_nextn_predict_layers = " +
                                               std::to_string(config.num_nextn_predict_layers) + " disagree");
    }
    config.num_nextn_predict_layers = mtp_layers;
  }
}

/// Qwen3-Next's and Qwen3-MoE's fields: linear attention layers, sparse steps, dense layers.
void read_linear_attention_fields(const ConfigFields& fields, ModelConfig& config) {
  config.full_attention_interval = fields.integer("full_attention_interval", 1, kMaxCount, 0);
  config.layer_types = fields.list<std::string>("layer_types", [&](const Json& item) {
    if (!item.is_string()) fields.fail_value("layer_types", item, "elements must be strings");
    return item.get<std::string>();
  });
  config.linear_num_key_heads = fields.integer("linear_num_key_heads", 1, kMaxCount, 0);
  config.linear_num_value_heads = fields.integer("linear_num_value_heads", 1, kMaxCount, 0);
  config.linear_key_head_dim = fields.integer("linear_key_head_dim", 1, kMaxDimension, 0);
  config.linear_value_head_dim = fields.integer("linear_value_head_dim", 1, kMaxDimension, 0);
  config.linear_conv_kernel_dim = fields.integer("linear_conv_kernel_dim", 1, kMaxDimension, 0);
  config.shared_expert_intermediate_size = fields.integer("shared_expert_intermediate_size", 0, kMaxDimension, 0);
  config.decoder_sparse_step = fields.integer("decoder_sparse_step", 1, kMaxCount, 1);
  config.mlp_only_layers = fields.list<int64_t>("mlp_only_layers", [&](const Json& item) {
    if (!item.is_number_integer() || item.get<int64_t>() < 0 || item.get<int64_t>() >= config.num_hidden_layers) {
      fields.fail_value("mlp_only_layers", item, "elements must be layer indices from 0 to num_hidden_layers - 1");
    }
    return item.get<int64_t>();
  });
}

/// The expert counts of the families that name them otherwise, and experts per token.
void read_expert_counts(const ConfigFields& fields, ModelConfig& config) {
  config.num_experts = fields.integer("num_experts", 0, kMaxCount, 0);
  config.num_local_experts = fields.integer("num_local_experts", 0, kMaxCount, 0);
  config.num_experts_per_tok = fields.integer("num_experts_per_tok", 0, kMaxCount, 0);
  // Mixtral and others name their expert count differently, so only the counts read here bound it.
  if (int64_t routed = std::max(config.n_routed_experts, std::max(config.num_experts, config.num_local_experts));
      routed > 0 && config.num_experts_per_tok > routed) {
    fields.fail("num_experts_per_tok", "= " + std::to_string(config.num_experts_per_tok) +
                                           ": must be at most the " + std::to_string(routed) + " routed experts");
  }
}

/// quantization_config, when present: FP8 block-scaled checkpoints' fields.
void read_quantization(std::string_view object, const Json* quantization, ModelConfig& config) {
  WS_EXPECT(quantization->is_object(), ErrorCode::kFormat,
            std::string(object) + ": quantization_config must be an object, not " +
                std::string(detail::json_type_text(quantization->type())));
  std::string quantization_object = std::string(object) + " quantization_config";
  ConfigFields quant(quantization_object, *quantization);
  ModelConfig::Quantization& q = config.quantization;
  q.quant_method = quant.text("quant_method");
  q.fmt = quant.text("fmt");
  q.activation_scheme = quant.text("activation_scheme");
  q.weight_block_size = quant.list<int64_t>("weight_block_size", [&](const Json& item) {
    if (!item.is_number_integer() || item.get<int64_t>() < 1 || item.get<int64_t>() > kMaxDimension) {
      quant.fail_value("weight_block_size", item, "elements must be integers from 1 to " + std::to_string(kMaxDimension));
    }
    return item.get<int64_t>();
  });
  if (!q.weight_block_size.empty() && q.weight_block_size.size() != 2) {
    quant.fail("weight_block_size", "has " + std::to_string(q.weight_block_size.size()) +
                                        " elements: it must be [block_n, block_k]");
  }
  auto names = [&](std::string_view field) {
    return quant.list<std::string>(field, [&](const Json& item) {
      if (!item.is_string()) quant.fail_value(field, item, "elements must be strings");
      return item.get<std::string>();
    });
  };
  q.modules_to_not_convert = names("modules_to_not_convert");
  for (std::string& name : names("ignored_layers")) q.modules_to_not_convert.push_back(std::move(name));
}

/// The head dimension, given or derived (MLA's nope + rope dims, or hidden / heads), after
/// the checks that MLA and routed experts have the fields they need.
void resolve_head_dim(const ConfigFields& fields, ModelConfig& config) {
  bool mla = config.kv_lora_rank > 0;
  if (mla) {
    // MLA (DeepSeek-V2/V3): queries and keys have nope + rope dims per head, values v_head_dim.
    if (config.qk_nope_head_dim + config.qk_rope_head_dim == 0) {
      fields.fail("qk_nope_head_dim", "and qk_rope_head_dim are both 0 or missing: MLA (kv_lora_rank > 0) needs them");
    }
    if (config.v_head_dim == 0) fields.fail("v_head_dim", "is missing: MLA (kv_lora_rank > 0) needs it");
  }
  if (config.n_routed_experts > 0 && config.moe_intermediate_size == 0) {
    fields.fail("moe_intermediate_size", "is missing: n_routed_experts > 0 needs it");
  }
  if (fields.find("head_dim") != nullptr) {
    config.head_dim = fields.integer("head_dim", 1, kMaxDimension, std::nullopt);
  } else if (mla) {
    config.head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim;
  } else {
    if (config.hidden_size % config.num_attention_heads != 0) {
      fields.fail("num_attention_heads",
                  "= " + std::to_string(config.num_attention_heads) + ": must divide hidden_size = " +
                      std::to_string(config.hidden_size) + " when head_dim is absent");
    }
    config.head_dim = config.hidden_size / config.num_attention_heads;
  }
}

}  // namespace

ModelConfig parse_model_config(std::string_view object, std::string_view json) {
  Json document = detail::parse_json_strictly(object, json);
  WS_EXPECT(document.is_object(), ErrorCode::kFormat,
            std::string(object) + ": config is " + std::string(detail::json_type_text(document.type())) +
                ", not a JSON object");
  ConfigFields fields(object, document);
  ModelConfig config;
  config.source = std::string(object);
  read_common_fields(fields, config);
  read_mla_and_moe_fields(fields, config);
  read_linear_attention_fields(fields, config);
  read_expert_counts(fields, config);
  config.attention_bias = fields.flag("attention_bias", false);
  config.use_qk_norm = fields.flag("use_qk_norm", false);
  if (const Json* quantization = fields.find("quantization_config")) read_quantization(object, quantization, config);
  resolve_head_dim(fields, config);
  return config;
}

}  // namespace weightstream
