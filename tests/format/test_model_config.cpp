#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "format/format_test_files.hpp"

namespace weightstream {
namespace {

using ::testing::HasSubstr;
using testing::error_text;

// A Llama-3-8B config.json, trimmed to the fields that matter and a few that do not.
const char* const kLlamaConfig = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
  "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
  "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "rope_scaling": null})";

nlohmann::json llama() { return nlohmann::json::parse(kLlamaConfig); }

std::string config_error(const nlohmann::json& config) {
  return error_text([&] { parse_model_config("config.json", config.dump()); });
}

TEST(ModelConfig, ReadsALlamaConfig) {
  ModelConfig config = parse_model_config("config.json", kLlamaConfig);
  EXPECT_EQ(config.model_type, "llama");
  EXPECT_EQ(config.hidden_size, 4096);
  EXPECT_EQ(config.intermediate_size, 14336);
  EXPECT_EQ(config.num_hidden_layers, 32);
  EXPECT_EQ(config.num_attention_heads, 32);
  EXPECT_EQ(config.num_key_value_heads, 8);
  EXPECT_EQ(config.head_dim, 128);
  EXPECT_EQ(config.vocab_size, 128256);
  EXPECT_FALSE(config.tie_word_embeddings);
  EXPECT_EQ(config.torch_dtype, "bfloat16");
}

TEST(ModelConfig, DefaultsKeyValueHeadsAndHeadDim) {
  auto json = llama();
  json.erase("num_key_value_heads");
  json["head_dim"] = nullptr;
  ModelConfig config = parse_model_config("config.json", json.dump());
  EXPECT_EQ(config.num_key_value_heads, 32);
  EXPECT_EQ(config.head_dim, 128);
}

TEST(ModelConfig, ReadsAnExplicitHeadDim) {
  auto json = llama();
  json["head_dim"] = 256;  // Qwen3 and Gemma set head_dim apart from hidden / heads
  EXPECT_EQ(parse_model_config("config.json", json.dump()).head_dim, 256);
}

TEST(ModelConfig, ReadsTheNewDtypeSpelling) {
  auto json = llama();
  json.erase("torch_dtype");
  json["dtype"] = "float16";
  EXPECT_EQ(parse_model_config("config.json", json.dump()).torch_dtype, "float16");
}

TEST(ModelConfig, RejectsAMissingRequiredField) {
  for (const char* field : {"hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"}) {
    auto json = llama();
    json.erase(field);
    EXPECT_THAT(config_error(json), HasSubstr(std::string("config.json: ") + field + " is missing: it is required"));
  }
}

TEST(ModelConfig, RejectsALayerCountOutOfRange) {
  auto json = llama();
  json["num_hidden_layers"] = -3;
  EXPECT_THAT(config_error(json), HasSubstr("config.json: num_hidden_layers = -3: must be from 1 to 65536"));
  json["num_hidden_layers"] = 0;
  EXPECT_THAT(config_error(json), HasSubstr("num_hidden_layers = 0: must be from 1 to 65536"));
}

TEST(ModelConfig, RejectsAnAbsurdDimension) {
  auto json = llama();
  json["hidden_size"] = int64_t{1} << 40;
  EXPECT_THAT(config_error(json), HasSubstr("config.json: hidden_size = 1099511627776: must be from 1 to 1048576"));
  json = llama();
  json["vocab_size"] = 18446744073709551615ull;
  EXPECT_THAT(config_error(json), HasSubstr("vocab_size = 18446744073709551615: must be from 1 to 1048576"));
  json = llama();
  json["intermediate_size"] = 0;
  EXPECT_THAT(config_error(json), HasSubstr("intermediate_size = 0: must be from 1 to 1048576"));
}

TEST(ModelConfig, RejectsANonIntegerSize) {
  auto json = llama();
  json["hidden_size"] = "4096";
  EXPECT_THAT(config_error(json), HasSubstr("config.json: hidden_size = \"4096\": must be an integer, not a string"));
  json["hidden_size"] = 4096.5;
  EXPECT_THAT(config_error(json), HasSubstr("hidden_size = 4096.5: must be an integer, not a floating-point number"));
  json["hidden_size"] = true;
  EXPECT_THAT(config_error(json), HasSubstr("hidden_size = true: must be an integer, not a boolean"));
}

TEST(ModelConfig, RejectsKeyValueHeadsThatDoNotDivideHeads) {
  auto json = llama();
  json["num_key_value_heads"] = 5;
  EXPECT_THAT(config_error(json), HasSubstr("num_key_value_heads = 5: must divide num_attention_heads = 32"));
  json["num_key_value_heads"] = 64;
  EXPECT_THAT(config_error(json), HasSubstr("num_key_value_heads = 64: must be from 1 to 32"));
}

TEST(ModelConfig, RejectsHeadsThatDoNotDivideHiddenWithoutHeadDim) {
  auto json = llama();
  json["num_attention_heads"] = 24;
  json["num_key_value_heads"] = 8;
  json["hidden_size"] = 4100;
  EXPECT_THAT(config_error(json),
              HasSubstr("num_attention_heads = 24: must divide hidden_size = 4100 when head_dim is absent"));
}

TEST(ModelConfig, RejectsWrongTypesOfOtherFields) {
  auto json = llama();
  json["tie_word_embeddings"] = "no";
  EXPECT_THAT(config_error(json), HasSubstr("tie_word_embeddings = \"no\": must be true or false, not a string"));
  json = llama();
  json["model_type"] = 3;
  EXPECT_THAT(config_error(json), HasSubstr("model_type = 3: must be a string, not an integer"));
}

TEST(ModelConfig, RejectsARepeatedKey) {
  EXPECT_THAT(error_text([] { parse_model_config("config.json", R"({"hidden_size": 8, "hidden_size": 16})"); }),
              HasSubstr("config.json: key 'hidden_size' appears twice in one object"));
}

TEST(ModelConfig, RejectsANonObject) {
  EXPECT_THAT(error_text([] { parse_model_config("config.json", "[]"); }),
              HasSubstr("config.json: config is an array, not a JSON object"));
  EXPECT_THAT(error_text([] { parse_model_config("config.json", "{"); }), HasSubstr("config.json: not valid JSON"));
}

// DeepSeek-V3's config.json, trimmed.
const char* const kDeepseekConfig = R"({
  "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
  "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
  "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
  "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
  "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280, "torch_dtype": "bfloat16",
  "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                          "weight_block_size": [128, 128]}})";

TEST(ModelConfig, ReadsADeepseekV3Config) {
  ModelConfig config = parse_model_config("config.json", kDeepseekConfig);
  EXPECT_EQ(config.q_lora_rank, 1536);
  EXPECT_EQ(config.kv_lora_rank, 512);
  EXPECT_EQ(config.qk_nope_head_dim, 128);
  EXPECT_EQ(config.qk_rope_head_dim, 64);
  EXPECT_EQ(config.v_head_dim, 128);
  EXPECT_EQ(config.n_routed_experts, 256);
  EXPECT_EQ(config.n_shared_experts, 1);
  EXPECT_EQ(config.num_experts_per_tok, 8);
  EXPECT_EQ(config.moe_intermediate_size, 2048);
  EXPECT_EQ(config.first_k_dense_replace, 3);
  EXPECT_EQ(config.num_nextn_predict_layers, 1);
  EXPECT_EQ(config.head_dim, 192) << "MLA heads are qk_nope_head_dim + qk_rope_head_dim wide";
}

TEST(ModelConfig, ReadsANullQLoraRankAsAbsent) {
  auto json = nlohmann::json::parse(kDeepseekConfig);
  json["q_lora_rank"] = nullptr;  // DeepSeek-V2-Lite
  EXPECT_EQ(parse_model_config("config.json", json.dump()).q_lora_rank, 0);
}

TEST(ModelConfig, RejectsMoreDenseLayersThanLayers) {
  auto json = nlohmann::json::parse(kDeepseekConfig);
  json["first_k_dense_replace"] = 62;
  EXPECT_THAT(config_error(json), HasSubstr("first_k_dense_replace = 62: must be from 0 to 61"));
}

TEST(ModelConfig, RejectsMoreExpertsPerTokenThanExperts) {
  auto json = nlohmann::json::parse(kDeepseekConfig);
  json["num_experts_per_tok"] = 300;
  EXPECT_THAT(config_error(json), HasSubstr("num_experts_per_tok = 300: must be at most the 256 routed experts"));
}

TEST(ModelConfig, RejectsMlaWithoutHeadDims) {
  auto json = nlohmann::json::parse(kDeepseekConfig);
  json.erase("v_head_dim");
  EXPECT_THAT(config_error(json), HasSubstr("v_head_dim is missing: MLA (kv_lora_rank > 0) needs it"));
}

TEST(ModelConfig, RejectsExpertsWithoutTheirSize) {
  auto json = nlohmann::json::parse(kDeepseekConfig);
  json.erase("moe_intermediate_size");
  EXPECT_THAT(config_error(json), HasSubstr("moe_intermediate_size is missing: n_routed_experts > 0 needs it"));
}

// Shaped like Qwen3-Next-80B-A3B's config.json: Gated DeltaNet layers with full attention
// every fourth layer, 512 experts and one shared expert.
const char* const kQwen3NextConfig = R"({
  "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
  "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
  "head_dim": 256, "vocab_size": 151936, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
  "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
  "linear_value_head_dim": 128, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
  "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "mlp_only_layers": [],
  "partial_rotary_factor": 0.25, "tie_word_embeddings": false, "torch_dtype": "bfloat16"})";

nlohmann::json qwen3_next() { return nlohmann::json::parse(kQwen3NextConfig); }

TEST(ModelConfig, ReadsAQwen3NextConfig) {
  ModelConfig config = parse_model_config("config.json", kQwen3NextConfig);
  EXPECT_EQ(config.model_type, "qwen3_next");
  EXPECT_EQ(config.head_dim, 256);
  EXPECT_EQ(config.full_attention_interval, 4);
  EXPECT_TRUE(config.layer_types.empty());
  EXPECT_EQ(config.linear_num_key_heads, 16);
  EXPECT_EQ(config.linear_num_value_heads, 32);
  EXPECT_EQ(config.linear_key_head_dim, 128);
  EXPECT_EQ(config.linear_value_head_dim, 128);
  EXPECT_EQ(config.linear_conv_kernel_dim, 4);
  EXPECT_EQ(config.num_experts, 512);
  EXPECT_EQ(config.shared_expert_intermediate_size, 512);
  EXPECT_EQ(config.decoder_sparse_step, 1);
  EXPECT_TRUE(config.mlp_only_layers.empty());
  EXPECT_EQ(config.num_nextn_predict_layers, 0) << "no MTP layer count given";

  auto json = qwen3_next();
  json["layer_types"] = nlohmann::json::array();
  for (int layer = 0; layer < 48; ++layer) json["layer_types"].push_back(layer % 4 == 3 ? "full_attention" : "linear_attention");
  json["mlp_only_layers"] = {0, 47};
  config = parse_model_config("config.json", json.dump());
  ASSERT_EQ(config.layer_types.size(), 48u);
  EXPECT_EQ(config.layer_types[3], "full_attention");
  EXPECT_EQ(config.mlp_only_layers, (std::vector<int64_t>{0, 47}));
}

TEST(ModelConfig, ReadsTheMtpLayerCountUnderEitherName) {
  auto json = qwen3_next();
  json["num_nextn_predict_layers"] = 1;  // the name vLLM's Qwen3NextMTP reads
  EXPECT_EQ(parse_model_config("config.json", json.dump()).num_nextn_predict_layers, 1);
  json.erase("num_nextn_predict_layers");
  json["mtp_num_hidden_layers"] = 2;  // the name later Qwen configs carry
  EXPECT_EQ(parse_model_config("config.json", json.dump()).num_nextn_predict_layers, 2);
  json["num_nextn_predict_layers"] = 2;
  EXPECT_EQ(parse_model_config("config.json", json.dump()).num_nextn_predict_layers, 2);
  json["num_nextn_predict_layers"] = 1;
  EXPECT_THAT(config_error(json), HasSubstr("mtp_num_hidden_layers = 2 and num_nextn_predict_layers = 1 disagree"));
}

TEST(ModelConfig, RejectsMalformedLayerLists) {
  auto json = qwen3_next();
  json["layer_types"] = "linear_attention";
  EXPECT_THAT(config_error(json), HasSubstr("layer_types = \"linear_attention\": must be a list"));
  json["layer_types"] = {1, 2};
  EXPECT_THAT(config_error(json), HasSubstr("layer_types = 1: elements must be strings"));
  json.erase("layer_types");
  json["mlp_only_layers"] = {48};
  EXPECT_THAT(config_error(json),
              HasSubstr("mlp_only_layers = 48: elements must be layer indices from 0 to num_hidden_layers - 1"));
  json["mlp_only_layers"] = {"0"};
  EXPECT_THAT(config_error(json), HasSubstr("mlp_only_layers = \"0\": elements must be layer indices"));
}

}  // namespace
}  // namespace weightstream
