#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <set>

#include "format/format_test_files.hpp"
#include "support/test_support.hpp"
#include "weightstream/model.hpp"
#include "weightstream/options.hpp"
#include "weightstream/stream.hpp"
#include "weightstream/synth.hpp"

namespace weightstream {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::as_bytes;
using testing::error_text;

// A synthesized checkpoint read back through the parsers.
struct ReadBack {
  ModelConfig config;
  CheckpointIndex index;
  std::map<std::string, TensorInfo> tensors;  // by name
  std::map<std::string, std::string> shard_of;
  std::map<std::string, std::string> files;  // shard name to contents
  uint64_t bytes = 0;

  std::string data(const std::string& name) const {
    const TensorInfo& tensor = tensors.at(name);
    const std::string& file = files.at(shard_of.at(name));
    uint64_t header_length = 0;
    std::memcpy(&header_length, file.data(), 8);
    return file.substr(8 + header_length + tensor.data_begin, tensor.bytes());
  }
};

ReadBack read_back(const std::filesystem::path& dir) {
  ReadBack back;
  back.config = parse_model_config("config.json", testing::read_file(dir / "config.json"));
  back.index = parse_checkpoint_index("index", testing::read_file(dir / std::string(kIndexFileName)));
  for (const std::string& shard : back.index.shards) {
    std::string file = testing::read_file(dir / shard);
    auto header = parse_safetensors_bytes(shard, as_bytes(file));
    EXPECT_EQ(header.metadata.at("format"), "pt");
    for (TensorInfo& tensor : header.tensors) {
      back.bytes += tensor.bytes();
      back.shard_of[tensor.name] = shard;
      EXPECT_TRUE(back.tensors.emplace(tensor.name, std::move(tensor)).second);
    }
    back.files[shard] = std::move(file);
  }
  return back;
}

std::vector<int64_t> shape_of(const ReadBack& back, const std::string& name) {
  auto found = back.tensors.find(name);
  if (found == back.tensors.end()) {
    ADD_FAILURE() << "no tensor " << name;
    return {};
  }
  return found->second.shape;
}

using Shape = std::vector<int64_t>;

class SynthArch : public ::testing::TestWithParam<std::string> {};

TEST_P(SynthArch, WritesAConsistentCheckpoint) {
  testing::TempDir dir;
  SynthOptions options;
  options.arch = GetParam();
  options.shards = 3;
  SynthResult result = synthesize_checkpoint(dir.path(), options);
  ReadBack back = read_back(dir.path());

  EXPECT_EQ(back.config.model_type, GetParam());
  EXPECT_EQ(back.config.num_hidden_layers, 2);
  EXPECT_EQ(back.config.hidden_size, 256);
  EXPECT_EQ(back.config.torch_dtype, "bfloat16");
  EXPECT_EQ(result.config.hidden_size, back.config.hidden_size);
  EXPECT_EQ(back.index.shards, (std::vector<std::string>{"model-00001-of-00003.safetensors",
                                                         "model-00002-of-00003.safetensors",
                                                         "model-00003-of-00003.safetensors"}));
  // The index covers exactly the tensors of the shards, each in the shard it names.
  EXPECT_EQ(back.index.weight_map, back.shard_of);
  EXPECT_EQ(back.index.total_size, back.bytes);
  EXPECT_EQ(result.bytes, back.bytes);
  EXPECT_EQ(result.tensors, back.tensors.size());
  ASSERT_EQ(result.files.size(), 5u);
  EXPECT_EQ(std::filesystem::path(result.files[0]).filename(), "config.json");
  EXPECT_EQ(std::filesystem::path(result.files[1]).filename(), kIndexFileName);
  EXPECT_EQ(std::filesystem::path(result.files[4]).filename(), "model-00003-of-00003.safetensors");

  // Shards are balanced by bytes: none exceeds its share by more than its largest tensor.
  uint64_t largest = 0;
  for (const auto& [name, tensor] : back.tensors) largest = std::max(largest, tensor.bytes());
  std::map<std::string, uint64_t> shard_bytes;
  for (const auto& [name, shard] : back.shard_of) shard_bytes[shard] += back.tensors.at(name).bytes();
  for (const auto& [shard, bytes] : shard_bytes) EXPECT_LE(bytes, back.bytes / 3 + largest) << shard;

  // The public tensor list matches what was written.
  auto specs = checkpoint_tensor_specs(back.config, Dtype::kBF16);
  ASSERT_EQ(specs.size(), back.tensors.size());
  for (const TensorSpec& spec : specs) EXPECT_EQ(shape_of(back, spec.name), spec.shape) << spec.name;
}

TEST_P(SynthArch, IsDeterministicForASeed) {
  testing::TempDir first, second, other;
  SynthOptions options;
  options.arch = GetParam();
  options.seed = 42;
  synthesize_checkpoint(first.path(), options);
  synthesize_checkpoint(second.path(), options);
  options.seed = 43;
  synthesize_checkpoint(other.path(), options);
  for (const char* name : {"config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
                           "model-00002-of-00002.safetensors"}) {
    EXPECT_EQ(testing::read_file(first / name), testing::read_file(second / name)) << name;
  }
  EXPECT_NE(testing::read_file(first / "model-00001-of-00002.safetensors"),
            testing::read_file(other / "model-00001-of-00002.safetensors"));
  EXPECT_EQ(testing::read_file(first / "config.json"), testing::read_file(other / "config.json"));
}

INSTANTIATE_TEST_SUITE_P(Archs, SynthArch,
                         ::testing::Values("llama", "qwen3", "deepseek_v3", "qwen3_next", "qwen3_moe", "mixtral", "kimi_k2",
                                           "glm4_moe"));

TEST(Synth, NamesAndShapesLlamaLikeHuggingFace) {
  testing::TempDir dir;
  SynthOptions options;  // llama, hidden 256: 4 heads of 64, 1 key/value head
  synthesize_checkpoint(dir.path(), options);
  ReadBack back = read_back(dir.path());
  EXPECT_EQ(back.config.num_attention_heads, 4);
  EXPECT_EQ(back.config.num_key_value_heads, 1);
  EXPECT_EQ(back.config.head_dim, 64);
  EXPECT_EQ(back.config.intermediate_size, 704);
  EXPECT_EQ(back.config.vocab_size, 4096);
  EXPECT_EQ(shape_of(back, "model.embed_tokens.weight"), (Shape{4096, 256}));
  EXPECT_EQ(shape_of(back, "lm_head.weight"), (Shape{4096, 256}));
  EXPECT_EQ(shape_of(back, "model.norm.weight"), (Shape{256}));
  for (int layer = 0; layer < 2; ++layer) {
    std::string p = "model.layers." + std::to_string(layer) + ".";
    EXPECT_EQ(shape_of(back, p + "self_attn.q_proj.weight"), (Shape{256, 256}));
    EXPECT_EQ(shape_of(back, p + "self_attn.k_proj.weight"), (Shape{64, 256}));
    EXPECT_EQ(shape_of(back, p + "self_attn.v_proj.weight"), (Shape{64, 256}));
    EXPECT_EQ(shape_of(back, p + "self_attn.o_proj.weight"), (Shape{256, 256}));
    EXPECT_EQ(shape_of(back, p + "mlp.gate_proj.weight"), (Shape{704, 256}));
    EXPECT_EQ(shape_of(back, p + "mlp.up_proj.weight"), (Shape{704, 256}));
    EXPECT_EQ(shape_of(back, p + "mlp.down_proj.weight"), (Shape{256, 704}));
    EXPECT_EQ(shape_of(back, p + "input_layernorm.weight"), (Shape{256}));
    EXPECT_EQ(shape_of(back, p + "post_attention_layernorm.weight"), (Shape{256}));
  }
  EXPECT_EQ(back.tensors.size(), 3u + 2 * 9);
}

TEST(Synth, TiedEmbeddingsHaveNoLmHead) {
  testing::TempDir dir;
  SynthOptions options;
  options.tie_word_embeddings = true;
  synthesize_checkpoint(dir.path(), options);
  ReadBack back = read_back(dir.path());
  EXPECT_TRUE(back.config.tie_word_embeddings);
  EXPECT_EQ(back.tensors.count("lm_head.weight"), 0u);
  EXPECT_EQ(back.tensors.count("model.embed_tokens.weight"), 1u);
}

TEST(Synth, Qwen3HasQkNormsAndAnExplicitHeadDim) {
  testing::TempDir dir;
  SynthOptions options;
  options.arch = "qwen3";
  options.hidden = 512;
  synthesize_checkpoint(dir.path(), options);
  ReadBack back = read_back(dir.path());
  auto config = nlohmann::json::parse(testing::read_file(dir / "config.json"));
  EXPECT_EQ(config["head_dim"], 64);
  EXPECT_EQ(config["architectures"][0], "Qwen3ForCausalLM");
  EXPECT_EQ(back.config.num_attention_heads, 8);
  EXPECT_EQ(back.config.num_key_value_heads, 2);
  EXPECT_EQ(shape_of(back, "model.layers.1.self_attn.q_norm.weight"), (Shape{64}));
  EXPECT_EQ(shape_of(back, "model.layers.1.self_attn.k_norm.weight"), (Shape{64}));
  EXPECT_EQ(shape_of(back, "model.layers.1.self_attn.k_proj.weight"), (Shape{128, 512}));
}

TEST(Synth, DeepseekV3HasMlaExpertsAndMtpLayers) {
  testing::TempDir dir;
  SynthOptions options;
  options.arch = "deepseek_v3";
  options.layers = 3;
  synthesize_checkpoint(dir.path(), options);
  ReadBack back = read_back(dir.path());
  const ModelConfig& c = back.config;
  EXPECT_EQ(c.first_k_dense_replace, 1);
  EXPECT_EQ(c.n_routed_experts, 8);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.num_nextn_predict_layers, 1);
  const int64_t h = 256, heads = c.num_attention_heads;
  ASSERT_GT(c.q_lora_rank, 0);

  // Layer 0 is dense, layers 1 and 2 are MoE, layer 3 is the MTP layer.
  std::string dense = "model.layers.0.";
  EXPECT_EQ(shape_of(back, dense + "self_attn.q_a_proj.weight"), (Shape{c.q_lora_rank, h}));
  EXPECT_EQ(shape_of(back, dense + "self_attn.q_a_layernorm.weight"), (Shape{c.q_lora_rank}));
  EXPECT_EQ(shape_of(back, dense + "self_attn.q_b_proj.weight"),
            (Shape{heads * (c.qk_nope_head_dim + c.qk_rope_head_dim), c.q_lora_rank}));
  EXPECT_EQ(shape_of(back, dense + "self_attn.kv_a_proj_with_mqa.weight"),
            (Shape{c.kv_lora_rank + c.qk_rope_head_dim, h}));
  EXPECT_EQ(shape_of(back, dense + "self_attn.kv_a_layernorm.weight"), (Shape{c.kv_lora_rank}));
  EXPECT_EQ(shape_of(back, dense + "self_attn.kv_b_proj.weight"),
            (Shape{heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank}));
  EXPECT_EQ(shape_of(back, dense + "self_attn.o_proj.weight"), (Shape{h, heads * c.v_head_dim}));
  EXPECT_EQ(shape_of(back, dense + "mlp.gate_proj.weight"), (Shape{c.intermediate_size, h}));
  EXPECT_EQ(back.tensors.count(dense + "mlp.gate.weight"), 0u);

  for (const std::string p : {"model.layers.1.", "model.layers.2.", "model.layers.3."}) {
    EXPECT_EQ(back.tensors.count(p + "mlp.gate_proj.weight"), 0u) << p;
    EXPECT_EQ(shape_of(back, p + "mlp.gate.weight"), (Shape{8, h}));
    EXPECT_EQ(shape_of(back, p + "mlp.gate.e_score_correction_bias"), (Shape{8}));
    EXPECT_EQ(back.tensors.at(p + "mlp.gate.e_score_correction_bias").dtype, Dtype::kF32);
    for (int e = 0; e < 8; ++e) {
      std::string expert = p + "mlp.experts." + std::to_string(e) + ".";
      EXPECT_EQ(shape_of(back, expert + "gate_proj.weight"), (Shape{c.moe_intermediate_size, h}));
      EXPECT_EQ(shape_of(back, expert + "up_proj.weight"), (Shape{c.moe_intermediate_size, h}));
      EXPECT_EQ(shape_of(back, expert + "down_proj.weight"), (Shape{h, c.moe_intermediate_size}));
    }
    EXPECT_EQ(back.tensors.count(p + "mlp.experts.8.gate_proj.weight"), 0u);
    EXPECT_EQ(shape_of(back, p + "mlp.shared_experts.gate_proj.weight"), (Shape{c.moe_intermediate_size, h}));
    EXPECT_EQ(shape_of(back, p + "mlp.shared_experts.down_proj.weight"), (Shape{h, c.moe_intermediate_size}));
  }
  std::string mtp = "model.layers.3.";
  EXPECT_EQ(shape_of(back, mtp + "embed_tokens.weight"), (Shape{4096, h}));
  EXPECT_EQ(shape_of(back, mtp + "enorm.weight"), (Shape{h}));
  EXPECT_EQ(shape_of(back, mtp + "hnorm.weight"), (Shape{h}));
  EXPECT_EQ(shape_of(back, mtp + "eh_proj.weight"), (Shape{h, 2 * h}));
  EXPECT_EQ(shape_of(back, mtp + "shared_head.norm.weight"), (Shape{h}));
  EXPECT_EQ(shape_of(back, mtp + "shared_head.head.weight"), (Shape{4096, h}));
  EXPECT_EQ(shape_of(back, mtp + "self_attn.kv_b_proj.weight"),
            (Shape{heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank}));
  EXPECT_EQ(back.tensors.count("model.layers.4.enorm.weight"), 0u);
  EXPECT_EQ(shape_of(back, "lm_head.weight"), (Shape{4096, h}));

  auto config = nlohmann::json::parse(testing::read_file(dir / "config.json"));
  EXPECT_EQ(config["architectures"][0], "DeepseekV3ForCausalLM");
  EXPECT_EQ(config["model_type"], "deepseek_v3");
  EXPECT_EQ(config["num_hidden_layers"], 3);
}

float bf16_value(const std::string& data, size_t index) {
  uint16_t bits = 0;
  std::memcpy(&bits, data.data() + 2 * index, 2);
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value = 0;
  std::memcpy(&value, &wide, 4);
  return value;
}

TEST(Synth, Qwen3NextHasGatedDeltaNetExpertsAndAnMtpModule) {
  testing::TempDir dir;
  SynthOptions options;
  options.arch = "qwen3_next";
  options.layers = 4;
  options.hidden = 128;
  synthesize_checkpoint(dir.path(), options);
  ReadBack back = read_back(dir.path());
  const ModelConfig& c = back.config;
  EXPECT_EQ(c.full_attention_interval, 4);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.num_nextn_predict_layers, 1);
  const int64_t h = 128, heads = c.num_attention_heads, head_dim = c.head_dim;
  const int64_t key_dim = c.linear_num_key_heads * c.linear_key_head_dim;
  const int64_t value_dim = c.linear_num_value_heads * c.linear_value_head_dim;

  // Layers 0 to 2 are Gated DeltaNet, layer 3 has full attention with a gated query.
  EXPECT_EQ(shape_of(back, "model.layers.0.linear_attn.in_proj_qkvz.weight"), (Shape{2 * key_dim + 2 * value_dim, h}));
  EXPECT_EQ(shape_of(back, "model.layers.0.linear_attn.in_proj_ba.weight"), (Shape{2 * c.linear_num_value_heads, h}));
  EXPECT_EQ(shape_of(back, "model.layers.0.linear_attn.conv1d.weight"),
            (Shape{2 * key_dim + value_dim, 1, c.linear_conv_kernel_dim}));
  EXPECT_EQ(shape_of(back, "model.layers.0.linear_attn.A_log"), (Shape{c.linear_num_value_heads}));
  EXPECT_EQ(shape_of(back, "model.layers.0.linear_attn.out_proj.weight"), (Shape{h, value_dim}));
  EXPECT_EQ(back.tensors.count("model.layers.0.self_attn.q_proj.weight"), 0u);
  EXPECT_EQ(shape_of(back, "model.layers.3.self_attn.q_proj.weight"), (Shape{2 * heads * head_dim, h}));
  EXPECT_EQ(shape_of(back, "model.layers.3.self_attn.o_proj.weight"), (Shape{h, heads * head_dim}));
  EXPECT_EQ(back.tensors.count("model.layers.3.linear_attn.A_log"), 0u);
  EXPECT_EQ(shape_of(back, "model.layers.2.mlp.experts.7.down_proj.weight"), (Shape{h, c.moe_intermediate_size}));
  EXPECT_EQ(shape_of(back, "model.layers.2.mlp.shared_expert_gate.weight"), (Shape{1, h}));

  // The MTP module: fc over [embedding; hidden], norms, one full-attention MoE layer.
  EXPECT_EQ(shape_of(back, "mtp.fc.weight"), (Shape{h, 2 * h}));
  for (const char* norm : {"mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"}) {
    EXPECT_EQ(shape_of(back, norm), (Shape{h})) << norm;
  }
  EXPECT_EQ(shape_of(back, "mtp.layers.0.self_attn.q_proj.weight"), (Shape{2 * heads * head_dim, h}));
  EXPECT_EQ(shape_of(back, "mtp.layers.0.mlp.experts.0.gate_proj.weight"), (Shape{c.moe_intermediate_size, h}));
  EXPECT_EQ(back.tensors.count("mtp.embed_tokens.weight"), 0u) << "the draft uses the target's embedding";
  // The MTP module comes last in the files, so it lies in the last shard.
  std::set<std::string> mtp_shards;
  for (const auto& [name, shard] : back.shard_of) {
    if (name.starts_with("mtp.")) mtp_shards.insert(shard);
  }
  EXPECT_EQ(mtp_shards, (std::set<std::string>{"model-00002-of-00002.safetensors"}));
}

TEST(Synth, WeightsAreSmallFiniteAndVariedNormsNearOne) {
  testing::TempDir dir;
  synthesize_checkpoint(dir.path(), SynthOptions{});
  ReadBack back = read_back(dir.path());
  std::string weight = back.data("model.layers.0.mlp.up_proj.weight");
  size_t negative = 0;
  std::set<uint16_t> distinct;
  for (size_t i = 0; i < weight.size() / 2; ++i) {
    float value = bf16_value(weight, i);
    ASSERT_TRUE(std::isfinite(value));
    ASSERT_GE(std::fabs(value), 4e-4f);
    ASSERT_LE(std::fabs(value), 0.13f);
    negative += value < 0;
    uint16_t bits = 0;
    std::memcpy(&bits, weight.data() + 2 * i, 2);
    distinct.insert(bits);
  }
  size_t count = weight.size() / 2;
  EXPECT_GT(negative, count * 4 / 10);
  EXPECT_LT(negative, count * 6 / 10);
  EXPECT_GT(distinct.size(), 1000u);
  std::string norm = back.data("model.norm.weight");
  for (size_t i = 0; i < norm.size() / 2; ++i) {
    float value = bf16_value(norm, i);
    ASSERT_GE(value, 1.0f);
    ASSERT_LT(value, 1.13f);
  }
  EXPECT_NE(back.data("model.layers.0.mlp.up_proj.weight"), back.data("model.layers.1.mlp.up_proj.weight"));
}

TEST(Synth, TensorBytesDoNotDependOnTheShardLayout) {
  testing::TempDir one, three;
  SynthOptions options;
  options.shards = 1;
  synthesize_checkpoint(one.path(), options);
  options.shards = 3;
  synthesize_checkpoint(three.path(), options);
  ReadBack a = read_back(one.path()), b = read_back(three.path());
  for (const auto& [name, tensor] : a.tensors) EXPECT_EQ(a.data(name), b.data(name)) << name;
}

TEST(Synth, OtherDtypes) {
  for (Dtype dtype : {Dtype::kF16, Dtype::kF32, Dtype::kF8E4M3}) {
    testing::TempDir dir;
    SynthOptions options;
    options.dtype = dtype;
    synthesize_checkpoint(dir.path(), options);
    ReadBack back = read_back(dir.path());
    EXPECT_EQ(back.tensors.at("model.norm.weight").dtype, dtype);
    if (dtype == Dtype::kF32) {
      EXPECT_EQ(back.config.torch_dtype, "float32");
      std::string data = back.data("lm_head.weight");
      for (size_t i = 0; i < data.size() / 4; ++i) {
        float value = 0;
        std::memcpy(&value, data.data() + 4 * i, 4);
        ASSERT_TRUE(std::isfinite(value) && std::fabs(value) < 0.13f && std::fabs(value) > 4e-4f);
      }
    }
  }
}

TEST(Synth, ScalesLayersToATargetSize) {
  testing::TempDir dir;
  SynthOptions options;
  options.target_bytes = 48ull << 20;
  SynthResult result = synthesize_checkpoint(dir.path(), options);
  EXPECT_GT(result.config.num_hidden_layers, 10);
  EXPECT_EQ(result.config.hidden_size, 256);
  EXPECT_NEAR(static_cast<double>(result.bytes), 48.0 * (1 << 20), 1.5 * (1 << 20));
}

TEST(Synth, ABlockAlignedModelHasTheFp8ModelsShapesInBf16) {
  testing::TempDir fp8_dir, bf16_dir;
  SynthOptions options;
  options.arch = "qwen3_moe";
  options.hidden = 512;
  options.quantize = SynthOptions::Quantization::kFp8Block;
  SynthResult fp8 = synthesize_checkpoint(fp8_dir.path(), options);
  options.quantize = SynthOptions::Quantization::kNone;
  options.block_aligned = true;
  SynthResult bf16 = synthesize_checkpoint(bf16_dir.path(), options);
  EXPECT_TRUE(bf16.config.quantization.quant_method.empty());
  EXPECT_EQ(bf16.config.head_dim, fp8.config.head_dim);
  EXPECT_EQ(bf16.config.num_attention_heads, fp8.config.num_attention_heads);
  EXPECT_EQ(bf16.config.intermediate_size, fp8.config.intermediate_size);
  EXPECT_EQ(bf16.config.moe_intermediate_size, fp8.config.moe_intermediate_size);
  // Every FP8 weight has a BF16 twin of its shape; nothing else is quantized.
  Checkpoint a = Checkpoint::open(fp8_dir.path().string(), Options{});
  Checkpoint b = Checkpoint::open(bf16_dir.path().string(), Options{});
  size_t weights = 0;
  for (const CheckpointTensor& tensor : a.tensors()) {
    if (tensor.name.ends_with("_scale_inv")) continue;
    std::optional<size_t> twin = b.find(tensor.name);
    ASSERT_TRUE(twin.has_value()) << tensor.name;
    EXPECT_EQ(b.tensors()[*twin].shape, tensor.shape) << tensor.name;
    EXPECT_NE(b.tensors()[*twin].dtype, Dtype::kF8E4M3) << tensor.name;
    weights += tensor.dtype == Dtype::kF8E4M3;
  }
  EXPECT_GT(weights, 0u);
}

TEST(Synth, RejectsBadOptions) {
  testing::TempDir dir;
  SynthOptions options;
  options.arch = "gpt2";
  EXPECT_THAT(error_text([&] { synthesize_checkpoint(dir.path(), options); }, ErrorCode::kInvalidArgument),
              HasSubstr("synth: arch 'gpt2' is not one of llama, qwen3, deepseek_v3"));
  options = SynthOptions{};
  options.hidden = 100;
  EXPECT_THAT(error_text([&] { synthesize_checkpoint(dir.path(), options); }, ErrorCode::kInvalidArgument),
              HasSubstr("hidden 100 must be a multiple of 32"));
  options = SynthOptions{};
  options.shards = 1000;
  options.layers = 1;
  EXPECT_THAT(error_text([&] { synthesize_checkpoint(dir.path(), options); }, ErrorCode::kInvalidArgument),
              HasSubstr("1000 shards for 12 tensors: every shard must hold a tensor"));
}

TEST(Synth, OneTensorPerShardWhenShardsEqualTensors) {
  testing::TempDir dir;
  SynthOptions options;
  options.layers = 1;
  options.shards = 12;
  synthesize_checkpoint(dir.path(), options);
  ReadBack back = read_back(dir.path());
  EXPECT_EQ(back.index.shards.size(), 12u);
  std::set<std::string> used;
  for (const auto& [name, shard] : back.shard_of) used.insert(shard);
  EXPECT_EQ(used.size(), 12u);
}

TEST(Synth, ReplacesACheckpointOnlyWhenAskedAndLeavesNoOldShardBehind) {
  testing::TempDir dir;
  SynthOptions options;
  options.layers = 2;
  options.shards = 3;
  synthesize_checkpoint(dir.path(), options);
  options.shards = 2;
  options.seed = 7;
  EXPECT_THAT(error_text([&] { synthesize_checkpoint(dir.path(), options); }, ErrorCode::kInvalidArgument),
              HasSubstr("synth: " + dir.path().string() + " holds a checkpoint already (config.json, "
                        "model.safetensors.index.json and 3 .safetensors files): it is replaced only when asked"));
  // A folder with something else in it is no checkpoint: written into as before.
  testing::TempDir other;
  testing::write_file(other / "README.md", "notes");
  synthesize_checkpoint(other.path(), options);

  options.replace = true;
  SynthResult result = synthesize_checkpoint(dir.path(), options);
  std::set<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) names.insert(entry.path().filename().string());
  EXPECT_EQ(names, (std::set<std::string>{"config.json", "model.safetensors.index.json",
                                          "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}));
  EXPECT_EQ(result.files.size(), 4u);
  ReadBack back = read_back(dir.path());
  EXPECT_EQ(back.index.shards.size(), 2u);
}

TEST(Synth, ReportsAnUnwritableDirectory) {
  testing::TempDir dir;
  testing::write_file(dir / "file", "x");
  std::string message =
      error_text([&] { synthesize_checkpoint(dir / "file" / "sub", SynthOptions{}); }, ErrorCode::kIo);
  EXPECT_THAT(message, HasSubstr((dir / "file" / "sub").string()));
}

}  // namespace
}  // namespace weightstream
