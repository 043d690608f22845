// Layers a checkpoint holds, checked against config.json before a layout is built (issue 7):
// the count from tensor names, a config asking for more layers refused with its field and
// value, MTP layers, and names that only look like layers.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "model/model_fixtures.hpp"
#include "weightstream/error.hpp"

namespace weightstream {
namespace {

using ::testing::HasSubstr;
using testing::synth_in_memory;
using testing::synth_options;

std::vector<std::string_view> names_of(const testing::MemoryCheckpoint& checkpoint) {
  std::vector<std::string_view> names;
  for (const testing::MemoryTensor& tensor : checkpoint.tensors) names.push_back(tensor.name);
  return names;
}

std::string layer_error(const ModelConfig& config, std::span<const std::string_view> names) {
  try {
    check_checkpoint_layers(config, "m/config.json", names);
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kModel);
    return error.what();
  }
  return "no error";
}

TEST(CheckpointLayers, CountsTheLayersItsTensorsName) {
  for (const char* arch : {"llama", "qwen3"}) {
    testing::MemoryCheckpoint checkpoint = synth_in_memory(synth_options(arch));
    auto names = names_of(checkpoint);
    EXPECT_EQ(checkpoint_layer_count(checkpoint.config, names), 2) << arch;
    EXPECT_NO_THROW(check_checkpoint_layers(checkpoint.config, "m/config.json", names)) << arch;
  }
  // DeepSeek's MTP layer is model.layers.2 of a 2-layer model.
  testing::MemoryCheckpoint deepseek = synth_in_memory(synth_options("deepseek_v3"));
  EXPECT_EQ(checkpoint_layer_count(deepseek.config, names_of(deepseek)), 3);
}

TEST(CheckpointLayers, ConfigAskingForMoreLayersIsRefusedNamingFieldValueAndCount) {
  testing::MemoryCheckpoint checkpoint = synth_in_memory(synth_options("llama"));
  auto names = names_of(checkpoint);
  ModelConfig config = checkpoint.config;
  config.num_hidden_layers = 65536;
  EXPECT_EQ(layer_error(config, names),
            "m/config.json: num_hidden_layers = 65536, but the checkpoint holds 2 layers (tensors "
            "model.layers.{layer}.*): a cold load needs all 65536");
  std::vector<std::string_view> globals = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"};
  EXPECT_THAT(layer_error(checkpoint.config, globals),
              HasSubstr("num_hidden_layers = 2, but the checkpoint holds 0 layers"));
}

TEST(CheckpointLayers, LayersWithMissingTensorsStillCount) {
  // Tensors missing from a layer are the plan's and the session's to name, not this check's.
  testing::MemoryCheckpoint checkpoint = synth_in_memory(synth_options("llama"));
  std::vector<std::string_view> names = {"model.layers.0.input_layernorm.weight", "model.layers.1.mlp.up_proj.weight"};
  EXPECT_NO_THROW(check_checkpoint_layers(checkpoint.config, "m/config.json", names));
}

TEST(CheckpointLayers, NamesThatOnlyLookLikeLayersDoNotCount) {
  ModelConfig config = synth_in_memory(synth_options("llama")).config;
  std::vector<std::string_view> names = {"model.layers.0.mlp.up_proj.weight",  "model.layers.0.self_attn.q_proj.weight",
                                         "model.layers.-1.mlp.up_proj.weight", "model.layers.x.mlp.up_proj.weight",
                                         "model.layers.7",                     "model.layers.99999999999999999999.a",
                                         "layers.3.mlp.up_proj.weight",        "model.layers..weight"};
  EXPECT_EQ(checkpoint_layer_count(config, names), 1);
  EXPECT_THAT(layer_error(config, names), HasSubstr("holds 1 layer (tensors model.layers.{layer}.*)"));
}

TEST(CheckpointLayers, UnsupportedModelTypeIsNamed) {
  ModelConfig config = synth_in_memory(synth_options("llama")).config;
  config.model_type = "gpt2";
  EXPECT_THAT(layer_error(config, {}), HasSubstr("gpt2"));
}

}  // namespace
}  // namespace weightstream

namespace weightstream {
namespace {

std::string layout_error(const ModelConfig& config, LayoutOptions options) {
  try {
    build_model_layout(config, options);
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kModel);
    return error.what();
  }
  return "no error";
}

TEST(LayoutSize, AbsurdExpertCountIsRefusedBeforeBuilding) {
  // Layers match the checkpoint, so only the size bound can stop a million experts.
  testing::MemoryCheckpoint checkpoint = testing::synth_in_memory(testing::synth_options("deepseek_v3"));
  ModelConfig config = checkpoint.config;
  config.n_routed_experts = 1'000'000;
  LayoutOptions options;
  options.max_tensors = layout_tensor_bound(checkpoint.tensors.size());
  std::string error = layout_error(config, options);
  EXPECT_THAT(error, HasSubstr("deepseek_v3: config.json describes up to "));
  EXPECT_THAT(error, HasSubstr("routed experts = 1000000"));
  EXPECT_THAT(error, HasSubstr("more than " + std::to_string(options.max_tensors) +
                               " that the checkpoint's tensors allow: the layout is not built"));
  // Without a checkpoint the absolute bound applies.
  config.num_hidden_layers = 65536;
  EXPECT_THAT(layout_error(config, LayoutOptions{}),
              HasSubstr("more than " + std::to_string(kMaxLayoutTensors) + ", the most any model may map"));
}

TEST(LayoutSize, RealCheckpointsFitTheirBound) {
  for (const char* arch : {"llama", "qwen3", "deepseek_v3", "qwen3_next"}) {
    testing::MemoryCheckpoint checkpoint = testing::synth_in_memory(testing::synth_options(arch));
    LayoutOptions options;
    options.max_tensors = layout_tensor_bound(checkpoint.tensors.size());
    EXPECT_EQ(layout_error(checkpoint.config, options), "no error") << arch;
  }
}

}  // namespace
}  // namespace weightstream
