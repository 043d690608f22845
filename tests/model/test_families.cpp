// Issue 18: targets without their draft layers, FP8 block-scaled checkpoints held as vLLM's
// Fp8LinearMethod holds them, and the MoE families as tables (qwen3_moe, mixtral, glm4_moe,
// kimi_k2). Expected values are sliced by hand here, as vLLM's weight loaders slice.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <set>

#include "model/model_fixtures.hpp"
#include "weightstream/error.hpp"
#include "weightstream/synth.hpp"

namespace weightstream {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using testing::MemoryCheckpoint;
using testing::MemoryTensor;
using testing::slice_of;
using testing::synth_in_memory;
using testing::synth_options;

std::string error_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const Error& error) {
    return error.what();
  }
  return "no error";
}

LayoutOptions rank_options(int64_t tp_size, int64_t tp_rank, int64_t ep_size = 1, int64_t ep_rank = 0) {
  LayoutOptions options;
  options.parallel = {tp_size, tp_rank, ep_size, ep_rank};
  return options;
}

ModelLayout loaded(const MemoryCheckpoint& checkpoint, const LayoutOptions& options,
                   const std::vector<std::vector<TensorView>>& batches, LoadMode mode = LoadMode::kCold) {
  ModelLayout layout = build_model_layout(checkpoint.config, options);
  layout.allocate(Device{});
  testing::run_load(layout, mode, batches);
  return layout;
}

std::vector<std::byte> concat(std::initializer_list<std::vector<std::byte>> pieces) {
  std::vector<std::byte> result;
  for (const auto& piece : pieces) result.insert(result.end(), piece.begin(), piece.end());
  return result;
}

// ---- Targets hold target layers only -------------------------------------------------

TEST(Families, TargetLayoutHoldsNoMtpLayerAndSkipsTheirTensors) {
  for (const char* arch : {"deepseek_v3", "glm4_moe"}) {
    SCOPED_TRACE(arch);
    auto checkpoint = synth_in_memory(synth_options(arch));
    ModelLayout target = build_model_layout(checkpoint.config);
    int64_t layers = checkpoint.config.num_hidden_layers;
    for (const Parameter& parameter : target.parameters()) EXPECT_LT(parameter.layer, layers) << parameter.name;
    std::string mtp = "model.layers." + std::to_string(layers) + ".";
    TensorRoute route = target.route(mtp + "eh_proj.weight");
    EXPECT_EQ(route.kind, TensorRoute::Kind::kSkipped);
    EXPECT_THAT(route.reason, HasSubstr("the draft module (MTP layer " + std::to_string(layers) + ")"));
    for (const std::string& wanted : target.wanted_tensors()) EXPECT_FALSE(wanted.starts_with(mtp)) << wanted;
  }
}

TEST(Families, CheckpointWithoutMtpLayersLoadsAsATarget) {
  // What transformers' save_pretrained writes: the config counts an MTP layer, the
  // checkpoint has none.
  for (const char* arch : {"deepseek_v3", "glm4_moe"}) {
    SCOPED_TRACE(arch);
    auto checkpoint = synth_in_memory(synth_options(arch));
    std::string mtp = "model.layers." + std::to_string(checkpoint.config.num_hidden_layers) + ".";
    for (int64_t tp : {1, 2}) {
      ModelLayout layout = loaded(checkpoint, rank_options(tp, tp - 1), {checkpoint.views_except(mtp)});
      EXPECT_EQ(layout.loads_finished(), 1u);
    }
    // The draft of such a checkpoint wants MTP tensors that are not there.
    LayoutOptions draft_options;
    draft_options.modules = LayoutModules::kDraft;
    ModelLayout draft = build_model_layout(checkpoint.config, draft_options);
    draft.allocate(Device{});
    EXPECT_THAT(error_of([&] { testing::run_load(draft, LoadMode::kCold, {checkpoint.views_except(mtp)}); }),
                HasSubstr("MTP layer"));
  }
}

// ---- The families as tables ----------------------------------------------------------

TEST(Families, EveryFamilyHasATableThatSynthAndTheLayoutShare) {
  for (const Architecture& architecture : architectures()) {
    SCOPED_TRACE(std::string(architecture.model_type));
    auto checkpoint = synth_in_memory(synth_options(std::string(architecture.model_type)));
    // Every tensor synth writes is wanted by the target or the draft, and each loads.
    ModelLayout target = testing::cold_loaded_layout(checkpoint);
    std::set<std::string> wanted;
    for (const std::string& name : target.wanted_tensors()) wanted.insert(name);
    if (architecture.mtp != MtpPlacement::kNone) {
      LayoutOptions options;
      options.modules = LayoutModules::kDraft;
      ModelLayout draft = build_model_layout(checkpoint.config, options);
      for (const std::string& name : draft.wanted_tensors()) wanted.insert(name);
    }
    for (const MemoryTensor& tensor : checkpoint.tensors) EXPECT_TRUE(wanted.contains(tensor.name)) << tensor.name;
    EXPECT_EQ(mapping_rules(checkpoint.config).size(), architecture.rules(checkpoint.config).size());
  }
  EXPECT_THAT(error_of([] {
                ModelConfig config;
                config.model_type = "gpt2";
                mapping_rules(config);
              }),
              HasSubstr("supported: llama, qwen3, deepseek_v3, qwen3_next, qwen3_moe, mixtral, kimi_k2, glm4_moe"));
}

TEST(Families, Qwen3MoeExpertsStackAsVllmHoldsThem) {
  auto checkpoint = synth_in_memory(synth_options("qwen3_moe"));
  const ModelConfig& c = checkpoint.config;
  ASSERT_EQ(c.mlp_only_layers, std::vector<int64_t>{0});
  for (int64_t tp : {1, 2}) {
    for (int64_t rank = 0; rank < tp; ++rank) {
      ModelLayout layout = loaded(checkpoint, rank_options(tp, rank), {checkpoint.views()});
      int64_t inner = c.moe_intermediate_size / tp;
      const Parameter& w13 = layout.parameter("model.layers.1.mlp.experts.w13_weight");
      EXPECT_EQ(w13.shape, (std::vector<int64_t>{c.num_experts, 2 * inner, c.hidden_size}));
      EXPECT_EQ(layout.parameter("model.layers.1.mlp.experts.w2_weight").shape,
                (std::vector<int64_t>{c.num_experts, c.hidden_size, inner}));
      EXPECT_TRUE(layout.find("model.layers.0.mlp.gate_up_proj.weight"));  // mlp_only_layers
      EXPECT_TRUE(layout.find("model.layers.1.self_attn.q_norm.weight"));
      // Expert 3's up rows of this rank follow its gate rows.
      auto w13_bytes = testing::bytes_of(layout, "model.layers.1.mlp.experts.w13_weight");
      const MemoryTensor& up = checkpoint.tensor("model.layers.1.mlp.experts.3.up_proj.weight");
      auto expected = slice_of(up, rank * inner, inner, 0, c.hidden_size);
      size_t row_bytes = static_cast<size_t>(c.hidden_size) * 2;
      size_t at = (3 * 2 * inner + inner) * row_bytes;
      EXPECT_EQ(std::vector<std::byte>(w13_bytes.begin() + at, w13_bytes.begin() + at + expected.size()), expected);
    }
  }
}

TEST(Families, MixtralNamesItsExpertsW1W3W2UnderBlockSparseMoe) {
  auto checkpoint = synth_in_memory(synth_options("mixtral"));
  const ModelConfig& c = checkpoint.config;
  EXPECT_EQ(c.num_local_experts, 8);
  ModelLayout layout = loaded(checkpoint, rank_options(2, 1), {checkpoint.views()});
  int64_t inner = c.intermediate_size / 2;
  const Parameter& w13 = layout.parameter("model.layers.0.block_sparse_moe.experts.w13_weight");
  EXPECT_EQ(w13.shape, (std::vector<int64_t>{8, 2 * inner, c.hidden_size}));
  auto bytes = testing::bytes_of(layout, "model.layers.0.block_sparse_moe.experts.w13_weight");
  size_t row_bytes = static_cast<size_t>(c.hidden_size) * 2;
  // w13 = [w1 (gate); w3 (up)] per expert, rank 1's half of each.
  auto w1 = slice_of(checkpoint.tensor("model.layers.0.block_sparse_moe.experts.5.w1.weight"), inner, inner, 0, c.hidden_size);
  auto w3 = slice_of(checkpoint.tensor("model.layers.0.block_sparse_moe.experts.5.w3.weight"), inner, inner, 0, c.hidden_size);
  size_t at = 5 * 2 * inner * row_bytes;
  EXPECT_EQ(std::vector<std::byte>(bytes.begin() + at, bytes.begin() + at + w1.size()), w1);
  EXPECT_EQ(std::vector<std::byte>(bytes.begin() + at + w1.size(), bytes.begin() + at + 2 * w1.size()), w3);
  EXPECT_EQ(layout.parameter("model.layers.0.block_sparse_moe.gate.weight").shape,
            (std::vector<int64_t>{8, c.hidden_size}));
}

TEST(Families, Glm4MoeHasBiasesSharedExpertsDenseFirstLayersAndMtp) {
  auto checkpoint = synth_in_memory(synth_options("glm4_moe"));
  const ModelConfig& c = checkpoint.config;
  ModelLayout layout = loaded(checkpoint, rank_options(2, 0), {checkpoint.views()});
  EXPECT_TRUE(layout.find("model.layers.0.mlp.gate_up_proj.weight"));  // first_k_dense_replace = 1
  EXPECT_TRUE(layout.find("model.layers.1.mlp.shared_experts.gate_up_proj.weight"));
  EXPECT_EQ(layout.parameter("model.layers.1.mlp.gate.e_score_correction_bias").dtype, Dtype::kF32);
  const Parameter& bias = layout.parameter("model.layers.0.self_attn.qkv_proj.bias");
  int64_t kv_rows = std::max<int64_t>(c.num_key_value_heads / 2, 1) * c.head_dim;
  EXPECT_EQ(bias.shape, (std::vector<int64_t>{c.num_attention_heads * c.head_dim / 2 + 2 * kv_rows}));
  auto bytes = testing::bytes_of(layout, "model.layers.0.self_attn.qkv_proj.bias");
  auto q = slice_of(checkpoint.tensor("model.layers.0.self_attn.q_proj.bias"), 0, c.num_attention_heads * c.head_dim / 2, 0, 1);
  EXPECT_EQ(std::vector<std::byte>(bytes.begin(), bytes.begin() + q.size()), q);
  LayoutOptions draft_options = rank_options(2, 0);
  draft_options.modules = LayoutModules::kDraft;
  ModelLayout draft = build_model_layout(c, draft_options);
  EXPECT_TRUE(draft.find("model.layers.2.eh_proj.weight"));
  EXPECT_TRUE(draft.find("model.layers.2.mlp.experts.w13_weight"));
}

TEST(Families, KimiK2IsDeepSeekV3Named) {
  auto kimi = synth_in_memory(synth_options("kimi_k2"));
  auto deepseek = synth_in_memory(synth_options("deepseek_v3"));
  ASSERT_EQ(kimi.tensors.size(), deepseek.tensors.size());
  for (size_t i = 0; i < kimi.tensors.size(); ++i) EXPECT_EQ(kimi.tensors[i].name, deepseek.tensors[i].name);
  ModelLayout layout = loaded(kimi, rank_options(2, 1), {kimi.views()});
  EXPECT_TRUE(layout.find("model.layers.1.self_attn.fused_qkv_a_proj.weight"));
}

TEST(Families, ExpertParallelDividesEveryMoeFamily) {
  for (const char* arch : {"qwen3_moe", "mixtral", "glm4_moe", "kimi_k2"}) {
    SCOPED_TRACE(arch);
    auto checkpoint = synth_in_memory(synth_options(arch));
    std::string prefix = std::string(arch) == "mixtral" ? "model.layers.1.block_sparse_moe.experts."
                                                         : "model.layers.1.mlp.experts.";
    for (int64_t ep_rank = 0; ep_rank < 4; ++ep_rank) {
      ModelLayout layout = loaded(checkpoint, rank_options(1, 0, 4, ep_rank), {checkpoint.views()});
      const Parameter& w2 = layout.parameter(prefix + "w2_weight");
      EXPECT_EQ(w2.shape[0], 2);
      // Local expert 1 of this rank is global expert 2 * ep_rank + 1, whole.
      std::string down = prefix + std::to_string(2 * ep_rank + 1) +
                         (std::string(arch) == "mixtral" ? ".w2.weight" : ".down_proj.weight");
      const MemoryTensor& tensor = checkpoint.tensor(down);
      auto bytes = testing::bytes_of(layout, prefix + "w2_weight");
      EXPECT_EQ(std::vector<std::byte>(bytes.begin() + bytes.size() / 2, bytes.end()), tensor.bytes);
      TensorRoute other = layout.route(prefix + std::to_string((2 * ep_rank + 2) % 8) +
                                       (std::string(arch) == "mixtral" ? ".w2.weight" : ".down_proj.weight"));
      EXPECT_EQ(other.kind, TensorRoute::Kind::kSkipped);
    }
  }
}

// ---- Qwen3-Next's Gated DeltaNet layers across tensor-parallel ranks -------------------

// As vLLM 0.33.0's QwenGatedDeltaNetAttention (gqa_interleaved_layout) loads a rank:
// in_proj_qkvz and in_proj_ba contiguous rows (whole key-head groups), conv1d the rank's
// share of each of its q, k and v sections (mamba_v2_sharded_weight_loader), A_log and
// dt_bias their value heads, norm whole, out_proj its columns.
TEST(GatedDeltaNet, EveryRankHoldsWhatVllmsWeightLoadersSliceAtTp248) {
  auto checkpoint = synth_in_memory(synth_options("qwen3_next", 1, 512));
  const ModelConfig& c = checkpoint.config;
  const int64_t h = c.hidden_size, key_dim = c.linear_num_key_heads * c.linear_key_head_dim;
  const int64_t value_dim = c.linear_num_value_heads * c.linear_value_head_dim, v_heads = c.linear_num_value_heads;
  const int64_t kernel = c.linear_conv_kernel_dim;
  ASSERT_EQ(c.linear_num_key_heads, 8);
  ASSERT_EQ(v_heads, 16);
  const std::string p = "model.layers.0.linear_attn.";
  for (int64_t tp : {1, 2, 4, 8}) {
    for (int64_t rank = 0; rank < tp; ++rank) {
      SCOPED_TRACE("tp " + std::to_string(tp) + " rank " + std::to_string(rank));
      ModelLayout layout = build_model_layout(c, rank_options(tp, rank));
      layout.allocate(Device{});
      LoadCounters counters = testing::run_load(layout, LoadMode::kCold, {checkpoint.views()});
      EXPECT_EQ(counters.tensors_applied, layout.wanted_tensors().size()) << "conv1d counts once, not per section";
      auto rows = [&](const std::string& tensor, int64_t begin, int64_t count) {
        const MemoryTensor& t = checkpoint.tensor(p + tensor);
        int64_t width = 1;
        for (size_t i = 1; i < t.shape.size(); ++i) width *= t.shape[i];
        return slice_of(t, begin, count, 0, width);
      };
      int64_t qkvz = 2 * key_dim + 2 * value_dim;
      EXPECT_TRUE(testing::bytes_of(layout, p + "in_proj_qkvz.weight") ==
                  rows("in_proj_qkvz.weight", rank * qkvz / tp, qkvz / tp));
      EXPECT_TRUE(testing::bytes_of(layout, p + "in_proj_ba.weight") ==
                  rows("in_proj_ba.weight", rank * 2 * v_heads / tp, 2 * v_heads / tp));
      const Parameter& conv = layout.parameter(p + "conv1d.weight");
      EXPECT_EQ(conv.shape, (std::vector<int64_t>{(2 * key_dim + value_dim) / tp, 1, kernel}));
      ASSERT_EQ(conv.parts.size(), 3u);
      EXPECT_EQ(conv.parts[0].id, "q");
      EXPECT_EQ(conv.parts[2].id, "v");
      EXPECT_THAT(conv.parts[1].rule, HasSubstr("column_sections"));
      EXPECT_TRUE(testing::bytes_of(layout, p + "conv1d.weight") ==
                  concat({rows("conv1d.weight", rank * key_dim / tp, key_dim / tp),
                          rows("conv1d.weight", key_dim + rank * key_dim / tp, key_dim / tp),
                          rows("conv1d.weight", 2 * key_dim + rank * value_dim / tp, value_dim / tp)}));
      EXPECT_EQ(layout.parameter(p + "A_log").dtype, Dtype::kF32) << "vLLM holds A_log in F32";
      EXPECT_TRUE(testing::bytes_of(layout, p + "A_log") == rows("A_log", rank * v_heads / tp, v_heads / tp));
      EXPECT_TRUE(testing::bytes_of(layout, p + "dt_bias") == rows("dt_bias", rank * v_heads / tp, v_heads / tp));
      EXPECT_TRUE(testing::bytes_of(layout, p + "norm.weight") == checkpoint.tensor(p + "norm.weight").bytes);
      EXPECT_TRUE(testing::bytes_of(layout, p + "out_proj.weight") ==
                  slice_of(checkpoint.tensor(p + "out_proj.weight"), 0, h, rank * value_dim / tp, value_dim / tp));
    }
  }
}

TEST(GatedDeltaNet, Conv1dInPiecesAcrossBatchesLoadsReloadsAndUpdatesAsWhole) {
  auto checkpoint = synth_in_memory(synth_options("qwen3_next", 2, 512));
  LayoutOptions options = rank_options(4, 2);
  ModelLayout reference = loaded(checkpoint, options, {checkpoint.views()});
  // conv1d in three pieces whose bounds fall inside sections, each in its own batch.
  std::string conv = "model.layers.0.linear_attn.conv1d.weight";
  std::vector<std::vector<TensorView>> batches{checkpoint.views_except(conv)};
  TensorView whole = checkpoint.views_matching(conv).at(0);
  uint64_t cuts[] = {0, whole.bytes / 6 * 2 + 6, whole.bytes - 10, whole.bytes};  // inside rows
  for (int i = 0; i < 3; ++i) {
    TensorView piece = whole;
    piece.offset = cuts[i];
    piece.bytes = cuts[i + 1] - cuts[i];
    piece.data = whole.data + cuts[i];
    batches.insert(batches.begin() + i, {piece});
  }
  ModelLayout pieces = loaded(checkpoint, options, batches);
  EXPECT_EQ(compare_layouts(reference, pieces).mismatched, 0u);
  for (LoadMode mode : {LoadMode::kReload, LoadMode::kUpdate}) {
    SCOPED_TRACE(std::string(load_mode_name(mode)));
    LoadCounters counters = testing::run_load(pieces, mode, batches);
    EXPECT_EQ(counters.tensors_applied, reference.wanted_tensors().size());
    EXPECT_EQ(compare_layouts(reference, pieces).mismatched, 0u);
  }
  // Delivered twice, it is refused naming the tensor.
  ModelLayout twice = build_model_layout(checkpoint.config, options);
  twice.allocate(Device{});
  batches.push_back(checkpoint.views_matching(conv));
  EXPECT_THAT(error_of([&] { testing::run_load(twice, LoadMode::kCold, batches); }),
              AllOf(HasSubstr(conv + " delivered twice"), HasSubstr("part 'q'")));
}

TEST(GatedDeltaNet, RefusesATpSizeThatDoesNotDivideTheLinearAttentionHeads) {
  auto checkpoint = synth_in_memory(synth_options("qwen3_next", 1, 512));
  ModelConfig c = checkpoint.config;
  c.linear_num_key_heads = 6;  // 8 attention heads divide by 4; 6 key heads do not
  c.linear_num_value_heads = 12;
  EXPECT_THAT(error_of([&] { build_model_layout(c, rank_options(4, 1)); }),
              AllOf(HasSubstr("qwen3_next tp 4: the Gated DeltaNet layers (layer 0 first) have 6 key heads "
                              "(linear_num_key_heads) and 12 value heads (linear_num_value_heads), which do not both "
                              "divide among tp_size 4"),
                    HasSubstr("use a tp_size that divides 6")));
  c.linear_num_key_heads = 8;  // key heads divide, value heads do not
  c.linear_num_value_heads = 20;
  EXPECT_THAT(error_of([&] { build_model_layout(c, rank_options(8, 0)); }),
              AllOf(HasSubstr("8 key heads (linear_num_key_heads) and 20 value heads"),
                    HasSubstr("tp_size 8"), HasSubstr("use a tp_size that divides 4")));
  EXPECT_NO_THROW(build_model_layout(c, rank_options(4, 3)));
}

// ---- FP8 block quantization ----------------------------------------------------------

testing::MemoryCheckpoint fp8_checkpoint(const std::string& arch, int64_t hidden = 512) {
  SynthOptions options = synth_options(arch, 3, hidden);
  options.quantize = SynthOptions::Quantization::kFp8Block;
  return synth_in_memory(options);
}

int64_t blocks(int64_t extent) { return (extent + 127) / 128; }

// The rank's part of a weight and of its scale, as vLLM's block-quant loaders narrow them:
// rows [row_begin, +rows) x columns [column_begin, +columns) of the weight, the same
// rectangle in 128 x 128 blocks of X.weight_scale_inv.
struct HandSlice {
  std::vector<std::byte> weight, scale;
};

HandSlice hand_slice(const MemoryCheckpoint& checkpoint, const std::string& tensor, int64_t row_begin, int64_t rows,
                     int64_t column_begin, int64_t columns) {
  const MemoryTensor& weight = checkpoint.tensor(tensor);
  const MemoryTensor& scale = checkpoint.tensor(tensor + "_scale_inv");
  EXPECT_EQ(weight.dtype, Dtype::kF8E4M3);
  EXPECT_EQ(scale.dtype, Dtype::kF32);
  EXPECT_EQ(scale.shape, (std::vector<int64_t>{blocks(weight.shape[0]), blocks(weight.shape[1])}));
  return {slice_of(weight, row_begin, rows, column_begin, columns),
          slice_of(scale, row_begin / 128, blocks(rows), column_begin / 128, blocks(columns))};
}

void expect_held(const ModelLayout& layout, const std::string& parameter, std::initializer_list<HandSlice> parts) {
  std::vector<std::byte> weight, scale;
  for (const HandSlice& part : parts) {
    weight.insert(weight.end(), part.weight.begin(), part.weight.end());
    scale.insert(scale.end(), part.scale.begin(), part.scale.end());
  }
  EXPECT_EQ(layout.parameter(parameter).dtype, Dtype::kF8E4M3) << parameter;
  EXPECT_EQ(layout.parameter(parameter + "_scale_inv").dtype, Dtype::kF32) << parameter;
  EXPECT_TRUE(testing::bytes_of(layout, parameter) == weight) << parameter;
  EXPECT_TRUE(testing::bytes_of(layout, parameter + "_scale_inv") == scale) << parameter << "_scale_inv";
}

TEST(Fp8Block, SynthQuantizesBf16ValuesWithOneScalePerBlock) {
  auto checkpoint = fp8_checkpoint("llama");
  const ModelConfig& c = checkpoint.config;
  EXPECT_EQ(c.quantization.quant_method, "fp8");
  EXPECT_EQ(c.quantization.weight_block_size, (std::vector<int64_t>{128, 128}));
  EXPECT_TRUE(fp8_block_quantized(c));
  const MemoryTensor& weight = checkpoint.tensor("model.layers.0.mlp.down_proj.weight");
  const MemoryTensor& scale = checkpoint.tensor("model.layers.0.mlp.down_proj.weight_scale_inv");
  int64_t rows = weight.shape[0], columns = weight.shape[1];
  // scale = amax / 448: every block's largest code is +-448 (0x7e / 0xfe), its scale positive.
  for (int64_t br = 0; br < blocks(rows); ++br) {
    for (int64_t bc = 0; bc < blocks(columns); ++bc) {
      float value;
      std::memcpy(&value, scale.bytes.data() + 4 * (br * blocks(columns) + bc), 4);
      EXPECT_GT(value, 0.0f);
      float amax = 0;
      for (int64_t r = br * 128; r < std::min(rows, br * 128 + 128); ++r) {
        for (int64_t col = bc * 128; col < std::min(columns, bc * 128 + 128); ++col) {
          amax = std::max(amax, std::fabs(e4m3_to_float(static_cast<uint8_t>(weight.bytes[r * columns + col]))));
        }
      }
      EXPECT_EQ(amax, 448.0f) << "block " << br << "," << bc;
    }
  }
  // Unquantized: embeddings, norms, lm_head.
  EXPECT_EQ(checkpoint.tensor("model.embed_tokens.weight").dtype, Dtype::kBF16);
  EXPECT_EQ(checkpoint.tensor("model.layers.0.input_layernorm.weight").dtype, Dtype::kBF16);
  EXPECT_EQ(checkpoint.tensor("lm_head.weight").dtype, Dtype::kBF16);
}

TEST(Fp8Block, LlamaAtTp124EqualsHandSlicedWeightsAndScaleBlocks) {
  auto checkpoint = fp8_checkpoint("llama");
  const ModelConfig& c = checkpoint.config;
  int64_t h = c.hidden_size, q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
  int64_t inner = c.intermediate_size;
  ASSERT_EQ(c.head_dim, 128);
  for (int64_t tp : {1, 2, 4}) {
    for (int64_t rank = 0; rank < tp; ++rank) {
      SCOPED_TRACE("tp " + std::to_string(tp) + " rank " + std::to_string(rank));
      ModelLayout layout = loaded(checkpoint, rank_options(tp, rank), {checkpoint.views()});
      std::string p = "model.layers.1.";
      // K/V heads replicated when tp exceeds them (vLLM: shard rank = rank / replicas).
      int64_t kv_heads = c.num_key_value_heads;
      int64_t kv_begin = tp <= kv_heads ? rank * kv / tp : (rank / (tp / kv_heads)) * c.head_dim;
      int64_t kv_rows = tp <= kv_heads ? kv / tp : c.head_dim;
      expect_held(layout, p + "self_attn.qkv_proj.weight",
                  {hand_slice(checkpoint, p + "self_attn.q_proj.weight", rank * q / tp, q / tp, 0, h),
                   hand_slice(checkpoint, p + "self_attn.k_proj.weight", kv_begin, kv_rows, 0, h),
                   hand_slice(checkpoint, p + "self_attn.v_proj.weight", kv_begin, kv_rows, 0, h)});
      expect_held(layout, p + "self_attn.o_proj.weight",
                  {hand_slice(checkpoint, p + "self_attn.o_proj.weight", 0, h, rank * q / tp, q / tp)});
      expect_held(layout, p + "mlp.gate_up_proj.weight",
                  {hand_slice(checkpoint, p + "mlp.gate_proj.weight", rank * inner / tp, inner / tp, 0, h),
                   hand_slice(checkpoint, p + "mlp.up_proj.weight", rank * inner / tp, inner / tp, 0, h)});
      expect_held(layout, p + "mlp.down_proj.weight",
                  {hand_slice(checkpoint, p + "mlp.down_proj.weight", 0, h, rank * inner / tp, inner / tp)});
      EXPECT_EQ(layout.parameter(p + "mlp.gate_up_proj.weight_scale_inv").shape,
                (std::vector<int64_t>{2 * blocks(inner / tp), blocks(h)}));
      EXPECT_EQ(layout.parameter("lm_head.weight").dtype, Dtype::kBF16);
      EXPECT_EQ(layout.parameter(p + "input_layernorm.weight").dtype, Dtype::kBF16);
    }
  }
}

TEST(Fp8Block, MoeExpertsStackTheirScaleBlocks) {
  for (const char* arch : {"deepseek_v3", "qwen3_moe", "mixtral", "glm4_moe"}) {
    SCOPED_TRACE(arch);
    auto checkpoint = fp8_checkpoint(arch);
    const ModelConfig& c = checkpoint.config;
    bool mixtral = std::string(arch) == "mixtral";
    int64_t inner = mixtral ? c.intermediate_size : c.moe_intermediate_size, h = c.hidden_size;
    std::string prefix = mixtral ? "model.layers.1.block_sparse_moe.experts." : "model.layers.1.mlp.experts.";
    std::string gate = mixtral ? ".w1.weight" : ".gate_proj.weight", up = mixtral ? ".w3.weight" : ".up_proj.weight";
    std::string down = mixtral ? ".w2.weight" : ".down_proj.weight";
    for (int64_t tp : {1, 2, 4}) {
      int64_t rank = tp - 1;
      SCOPED_TRACE("tp " + std::to_string(tp));
      ModelLayout layout = loaded(checkpoint, rank_options(tp, rank), {checkpoint.views()});
      std::vector<std::byte> w13, w13_scale, w2, w2_scale;
      for (int64_t e = 0; e < 8; ++e) {
        std::string expert = prefix + std::to_string(e);
        for (const std::string& part : {gate, up}) {
          HandSlice slice = hand_slice(checkpoint, expert + part, rank * inner / tp, inner / tp, 0, h);
          w13.insert(w13.end(), slice.weight.begin(), slice.weight.end());
          w13_scale.insert(w13_scale.end(), slice.scale.begin(), slice.scale.end());
        }
        HandSlice slice = hand_slice(checkpoint, expert + down, 0, h, rank * inner / tp, inner / tp);
        w2.insert(w2.end(), slice.weight.begin(), slice.weight.end());
        w2_scale.insert(w2_scale.end(), slice.scale.begin(), slice.scale.end());
      }
      EXPECT_EQ(layout.parameter(prefix + "w13_weight_scale_inv").shape,
                (std::vector<int64_t>{8, 2 * blocks(inner / tp), blocks(h)}));
      EXPECT_EQ(layout.parameter(prefix + "w2_weight_scale_inv").shape,
                (std::vector<int64_t>{8, blocks(h), blocks(inner / tp)}));
      EXPECT_TRUE(testing::bytes_of(layout, prefix + "w13_weight") == w13);
      EXPECT_TRUE(testing::bytes_of(layout, prefix + "w13_weight_scale_inv") == w13_scale);
      EXPECT_TRUE(testing::bytes_of(layout, prefix + "w2_weight") == w2);
      EXPECT_TRUE(testing::bytes_of(layout, prefix + "w2_weight_scale_inv") == w2_scale);
      // The router stays as shipped.
      std::string router = mixtral ? "model.layers.1.block_sparse_moe.gate.weight" : "model.layers.1.mlp.gate.weight";
      EXPECT_EQ(layout.parameter(router).dtype, Dtype::kBF16);
    }
  }
}

TEST(Fp8Block, DeepSeekFusedQkvAProjConcatenatesScaleRowsAndLastPartMayBePartial) {
  auto checkpoint = fp8_checkpoint("deepseek_v3");
  const ModelConfig& c = checkpoint.config;
  int64_t h = c.hidden_size, kv_a = c.kv_lora_rank + c.qk_rope_head_dim;
  ASSERT_NE(kv_a % 128, 0);  // a partial last block
  ModelLayout layout = loaded(checkpoint, rank_options(2, 1), {checkpoint.views()});
  std::string p = "model.layers.0.self_attn.";
  expect_held(layout, p + "fused_qkv_a_proj.weight",
              {hand_slice(checkpoint, p + "q_a_proj.weight", 0, c.q_lora_rank, 0, h),
               hand_slice(checkpoint, p + "kv_a_proj_with_mqa.weight", 0, kv_a, 0, h)});
  int64_t q_rows = c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim);
  expect_held(layout, p + "q_b_proj.weight",
              {hand_slice(checkpoint, p + "q_b_proj.weight", q_rows / 2, q_rows / 2, 0, c.q_lora_rank)});
}

TEST(Fp8Block, WeightAndScaleInDifferentBatchesLoadReloadAndUpdateAlike) {
  auto checkpoint = fp8_checkpoint("llama");
  LayoutOptions options = rank_options(2, 1);
  ModelLayout reference = loaded(checkpoint, options, {checkpoint.views()});
  // Scales first, then weights; then weights of layer 1 before everything else.
  ModelLayout split = loaded(checkpoint, options,
                             {checkpoint.views_matching("_scale_inv"), checkpoint.views_except("_scale_inv")});
  EXPECT_EQ(compare_layouts(reference, split).mismatched, 0u);
  for (LoadMode mode : {LoadMode::kReload, LoadMode::kUpdate}) {
    SCOPED_TRACE(std::string(load_mode_name(mode)));
    LoadCounters counters = testing::run_load(
        split, mode, {checkpoint.views_except("_scale_inv"), checkpoint.views_matching("_scale_inv")});
    EXPECT_EQ(counters.tensors_applied, reference.wanted_tensors().size());
    EXPECT_EQ(compare_layouts(reference, split).mismatched, 0u);
  }
  // A weight without its scale leaves the parameter incomplete, named.
  ModelLayout partial = build_model_layout(checkpoint.config, options);
  partial.allocate(Device{});
  EXPECT_THAT(error_of([&] { testing::run_load(partial, LoadMode::kCold, {checkpoint.views_except("down_proj.weight_scale_inv")}); }),
              HasSubstr("model.layers.0.mlp.down_proj.weight_scale_inv"));
}

// A trainer's BF16 version of an FP8 block-scaled checkpoint: every F8_E4M3 weight replaced
// by new BF16 values of its shape (its scales dropped), every other tensor kept. `quantized`
// gets the FP8 checkpoint of those values, quantized here block by block by the rule FP8
// checkpoints use (scale = amax / 448, code = E4M3(value / scale)).
MemoryCheckpoint trainer_bf16(const MemoryCheckpoint& fp8, uint64_t seed, MemoryCheckpoint& quantized) {
  MemoryCheckpoint bf16;
  bf16.config = fp8.config;
  quantized.config = fp8.config;
  uint64_t state = seed;
  auto next_bf16 = [&state] {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    float value = static_cast<float>(static_cast<int64_t>(state >> 33) % 2001 - 1000) / 1000.0f * 0.07f;
    return static_cast<uint16_t>(std::bit_cast<uint32_t>(value) >> 16);
  };
  for (const MemoryTensor& tensor : fp8.tensors) {
    if (tensor.name.ends_with("_scale_inv")) continue;
    if (tensor.dtype != Dtype::kF8E4M3) {
      bf16.tensors.push_back(tensor);
      quantized.tensors.push_back(tensor);
      continue;
    }
    int64_t rows = tensor.shape[0], columns = tensor.shape[1];
    MemoryTensor values{tensor.name, Dtype::kBF16, tensor.shape, std::vector<std::byte>(tensor.bytes.size() * 2)};
    std::vector<float> floats(tensor.bytes.size());
    for (size_t i = 0; i < floats.size(); ++i) {
      uint16_t bits = next_bf16();
      std::memcpy(values.bytes.data() + 2 * i, &bits, 2);
      floats[i] = std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
    }
    MemoryTensor codes{tensor.name, Dtype::kF8E4M3, tensor.shape, std::vector<std::byte>(tensor.bytes.size())};
    int64_t block_rows = blocks(rows), block_columns = blocks(columns);
    MemoryTensor scales{tensor.name + "_scale_inv", Dtype::kF32, {block_rows, block_columns},
                        std::vector<std::byte>(static_cast<size_t>(block_rows * block_columns) * 4)};
    for (int64_t br = 0; br < block_rows; ++br) {
      for (int64_t bc = 0; bc < block_columns; ++bc) {
        float amax = 0;
        for (int64_t r = br * 128; r < std::min(rows, br * 128 + 128); ++r) {
          for (int64_t c = bc * 128; c < std::min(columns, bc * 128 + 128); ++c) {
            amax = std::max(amax, std::fabs(floats[static_cast<size_t>(r * columns + c)]));
          }
        }
        float scale = amax > 0 ? amax / 448.0f : 1.0f;
        std::memcpy(scales.bytes.data() + (br * block_columns + bc) * 4, &scale, 4);
        for (int64_t r = br * 128; r < std::min(rows, br * 128 + 128); ++r) {
          for (int64_t c = bc * 128; c < std::min(columns, bc * 128 + 128); ++c) {
            auto at = static_cast<size_t>(r * columns + c);
            codes.bytes[at] = std::byte{float_to_e4m3(floats[at] / scale)};
          }
        }
      }
    }
    bf16.tensors.push_back(std::move(values));
    quantized.tensors.push_back(std::move(codes));
    quantized.tensors.push_back(std::move(scales));
  }
  return bf16;
}

// A trainer pushes BF16 weights under checkpoint names into a model holding FP8 block-scaled
// weights: each rank's part is quantized block by block with the checkpoint's rule, in
// place, codes and scales alike, equal byte for byte to a cold load of the FP8 checkpoint
// of the same values.
TEST(Fp8Block, Bf16WeightsPushedIntoFp8ParametersAreQuantizedInPlaceAsTheCheckpointIs) {
  for (const char* arch : {"llama", "qwen3_moe", "deepseek_v3"}) {
    SCOPED_TRACE(arch);
    auto fp8_old = fp8_checkpoint(arch);
    MemoryCheckpoint fp8_new;
    MemoryCheckpoint bf16 = trainer_bf16(fp8_old, 11, fp8_new);
    for (int64_t tp : {1, 2}) {
      SCOPED_TRACE("tp " + std::to_string(tp));
      LayoutOptions options = rank_options(tp, tp - 1);
      ModelLayout layout = loaded(fp8_old, options, {fp8_old.views()});
      std::vector<const std::byte*> addresses;
      for (const Parameter& parameter : layout.parameters()) addresses.push_back(parameter.data);
      // Layer 1's tensors first, in their own batch: parts of one parameter across batches.
      testing::run_load(layout, LoadMode::kUpdate, {bf16.views_matching("layers.1."), bf16.views_except("layers.1.")});
      ModelLayout reference = loaded(fp8_new, options, {fp8_new.views()});
      LayoutComparison result = compare_layouts(reference, layout);
      EXPECT_GT(result.compared, 0u);
      EXPECT_EQ(result.mismatched, 0u) << (result.mismatches.empty() ? "" : result.mismatches[0]);
      ModelLayout before = loaded(fp8_old, options, {fp8_old.views()});
      EXPECT_GT(compare_layouts(before, layout).mismatched, 0u);  // the update changed the weights
      for (size_t i = 0; i < addresses.size(); ++i) EXPECT_EQ(layout.parameters()[i].data, addresses[i]);
    }
  }
}

// The same update into parameters on a GPU: quantized there by the device kernel
// (src/device/quantize_kernels.cu), equal byte for byte to the host path, whether the BF16
// pieces come from host memory (staged on the GPU) or from GPU memory (quantized where they
// lie when a piece holds a part's whole slice, staged when a tensor comes in two pieces).
TEST(CudaFp8Block, Bf16UpdateIntoGpuParametersIsQuantizedThereAsOnTheHost) {
  if (cuda_device_count() == 0) {
    GTEST_SKIP() << (cuda_compiled() ? "no CUDA device on this machine" : "built without CUDA")
                 << ": the CUDA path is tested by scripts/gpu.sh on a GPU machine";
  }
  const Device cuda0{Device::Kind::kCuda, 0};
  for (const char* arch : {"llama", "qwen3_moe"}) {
    SCOPED_TRACE(arch);
    auto fp8_old = fp8_checkpoint(arch);
    MemoryCheckpoint fp8_new;
    MemoryCheckpoint bf16 = trainer_bf16(fp8_old, 11, fp8_new);
    // The BF16 tensors on the GPU, every third in two pieces.
    std::vector<Buffer> on_gpu;
    std::vector<TensorView> gpu_views;
    for (const TensorView& view : bf16.views()) {
      on_gpu.emplace_back(cuda0, std::max<uint64_t>(view.bytes, 1));
      copy_bytes(on_gpu.back().data(), cuda0, view.data, Device{}, view.bytes);
      TensorView piece = view;
      piece.data = on_gpu.back().data();
      piece.device = cuda0;
      if (gpu_views.size() % 3 == 0 && view.bytes >= 4) {
        const uint64_t half = view.bytes / 2 / 4 * 4;
        TensorView second = piece;
        piece.bytes = half;
        second.offset = half;
        second.data = piece.data + half;
        second.bytes = view.bytes - half;
        gpu_views.push_back(second);  // the later piece first
      }
      gpu_views.push_back(piece);
    }
    for (int64_t tp : {1, 2}) {
      SCOPED_TRACE("tp " + std::to_string(tp));
      LayoutOptions options = rank_options(tp, tp - 1);
      ModelLayout host = loaded(fp8_old, options, {fp8_old.views()});
      testing::run_load(host, LoadMode::kUpdate, {bf16.views_matching("layers.1."), bf16.views_except("layers.1.")});
      for (bool from_gpu : {false, true}) {
        SCOPED_TRACE(from_gpu ? "pieces on the GPU" : "pieces in host memory");
        ModelLayout gpu = build_model_layout(fp8_old.config, options);
        gpu.allocate(cuda0);
        testing::run_load(gpu, LoadMode::kCold, {fp8_old.views()});
        std::vector<const std::byte*> addresses;
        for (const Parameter& parameter : gpu.parameters()) addresses.push_back(parameter.data);
        if (from_gpu) {
          testing::run_load(gpu, LoadMode::kUpdate, {gpu_views});
        } else {
          testing::run_load(gpu, LoadMode::kUpdate,
                            {bf16.views_matching("layers.1."), bf16.views_except("layers.1.")});
        }
        LayoutComparison result = compare_layouts(host, gpu);
        EXPECT_GT(result.compared, 0u);
        EXPECT_EQ(result.mismatched, 0u) << (result.mismatches.empty() ? "" : result.mismatches[0]);
        for (size_t i = 0; i < addresses.size(); ++i) EXPECT_EQ(gpu.parameters()[i].data, addresses[i]);
      }
    }
  }
}

TEST(Fp8Block, ABf16WeightAfterItsScalesInOneUpdateIsRefusedBeforeItsBatchIsWritten) {
  auto fp8 = fp8_checkpoint("llama");
  MemoryCheckpoint quantized;
  MemoryCheckpoint bf16 = trainer_bf16(fp8, 5, quantized);
  ModelLayout layout = loaded(fp8, rank_options(1, 0), {fp8.views()});
  std::vector<std::byte> codes = testing::bytes_of(layout, "model.layers.0.mlp.down_proj.weight");
  std::string error = error_of([&] {
    testing::run_load(layout, LoadMode::kUpdate,
                      {fp8.views_matching("layers.0.mlp.down_proj.weight_scale_inv"),
                       bf16.views_matching("layers.0.mlp.down_proj.weight")});
  });
  EXPECT_THAT(error, AllOf(HasSubstr("model.layers.0.mlp.down_proj.weight arrives as BF16"),
                           HasSubstr("its block scales model.layers.0.mlp.down_proj.weight_scale_inv arrived"),
                           HasSubstr("send an FP8 weight with its weight_scale_inv, or a BF16, F16 or F32 weight alone")));
  EXPECT_TRUE(testing::bytes_of(layout, "model.layers.0.mlp.down_proj.weight") == codes);
}

TEST(Fp8Block, RefusesATpSizeThatCutsABlock) {
  // Column parallel: gate_up of 1536 rows at tp 8 gives 192 rows a rank.
  ModelConfig config;
  config.model_type = "llama";
  config.hidden_size = 1024;
  config.intermediate_size = 1536;
  config.num_hidden_layers = 1;
  config.num_attention_heads = 8;
  config.num_key_value_heads = 8;
  config.head_dim = 128;
  config.vocab_size = 1000;
  config.quantization.quant_method = "fp8";
  config.quantization.weight_block_size = {128, 128};
  EXPECT_THAT(error_of([&] { build_model_layout(config, rank_options(8, 0)); }),
              HasSubstr("parameter model.layers.0.mlp.gate_up_proj.weight on tp 8 rank 0: part '0' from "
                        "model.layers.0.mlp.gate_proj.weight takes rows 0+192 of 1536, which does not fall on the "
                        "weight_block_size [128, 128] boundaries"));
  EXPECT_NO_THROW(build_model_layout(config, rank_options(4, 3)));
  // Row parallel: o_proj's 256 columns at tp 4 give 64 a rank (MLA: 4 heads of v_head_dim 64).
  ModelConfig mla;
  mla.model_type = "deepseek_v3";
  mla.hidden_size = 512;
  mla.intermediate_size = 1024;
  mla.num_hidden_layers = 1;
  mla.num_attention_heads = 4;
  mla.num_key_value_heads = 4;
  mla.q_lora_rank = 256;
  mla.kv_lora_rank = 128;
  mla.qk_nope_head_dim = 192;
  mla.qk_rope_head_dim = 64;
  mla.v_head_dim = 64;
  mla.head_dim = 256;
  mla.vocab_size = 1000;
  mla.quantization = config.quantization;
  EXPECT_THAT(error_of([&] { build_model_layout(mla, rank_options(4, 1)); }),
              HasSubstr("parameter model.layers.0.self_attn.o_proj.weight on tp 4 rank 1: part from "
                        "model.layers.0.self_attn.o_proj.weight takes columns 64+64 of 256"));
  EXPECT_NO_THROW(build_model_layout(mla, rank_options(2, 1)));
}

TEST(Fp8Block, ModulesToNotConvertStayUnquantized) {
  auto checkpoint = fp8_checkpoint("llama");
  ModelConfig config = checkpoint.config;
  config.quantization.modules_to_not_convert = {"model.layers.1.mlp.down_proj"};
  ModelLayout layout = build_model_layout(config);
  EXPECT_EQ(layout.parameter("model.layers.1.mlp.down_proj.weight").dtype, Dtype::kBF16);
  EXPECT_FALSE(layout.find("model.layers.1.mlp.down_proj.weight_scale_inv"));
  EXPECT_EQ(layout.parameter("model.layers.0.mlp.down_proj.weight").dtype, Dtype::kF8E4M3);
  // A fused parameter quantized in part is refused, as vLLM refuses it.
  config.quantization.modules_to_not_convert = {"model.layers.0.self_attn.k_proj"};
  EXPECT_THAT(error_of([&] { build_model_layout(config); }),
              HasSubstr("parameter model.layers.0.self_attn.qkv_proj.weight: part 'k' from "
                        "model.layers.0.self_attn.k_proj.weight is left unquantized (modules_to_not_convert) but "
                        "earlier parts are not"));
}

TEST(Fp8Block, RefusesQuantizationConfigsItDoesNotLoad) {
  auto checkpoint = fp8_checkpoint("llama");
  auto with = [&](auto change) {
    ModelConfig config = checkpoint.config;
    change(config.quantization);
    return error_of([&] { build_model_layout(config); });
  };
  EXPECT_THAT(with([](auto& q) { q.quant_method = "awq"; }),
              HasSubstr("quantization_config quant_method 'awq' is not supported"));
  EXPECT_THAT(with([](auto& q) { q.weight_block_size.clear(); }), HasSubstr("without weight_block_size"));
  EXPECT_THAT(with([](auto& q) { q.fmt = "e5m2"; }), HasSubstr("fmt 'e5m2' is not supported"));
  EXPECT_THAT(with([](auto& q) { q.activation_scheme = "static"; }), HasSubstr("activation_scheme 'static'"));
  LayoutOptions online;
  online.quantize = Processing::kFp8PerTensor;
  EXPECT_THAT(error_of([&] { build_model_layout(checkpoint.config, online); }),
              HasSubstr("FP8 block-quantized already"));
  EXPECT_THAT(error_of([] {
                parse_model_config("m/config.json",
                                   R"({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
                                       "num_attention_heads": 1, "vocab_size": 8,
                                       "quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}})");
              }),
              HasSubstr("m/config.json quantization_config: weight_block_size has 1 elements: it must be [block_n, block_k]"));
}

}  // namespace
}  // namespace weightstream
