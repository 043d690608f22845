// Model hooks (once per load, never per batch, in place, non-rerunnable ones refused at
// begin) and per-layer processing (online FP8 E4M3 with a per-tensor scale).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>

#include "model/model_fixtures.hpp"
#include "weightstream/error.hpp"
#include "weightstream/synth.hpp"

namespace weightstream {
namespace {

using ::testing::HasSubstr;
using testing::bytes_of;
using testing::host_layout;
using testing::MemoryCheckpoint;
using testing::run_load;
using testing::synth_in_memory;
using testing::synth_options;

TEST(Fp8, E4M3CodesFollowTheOcpFormat) {
  EXPECT_EQ(float_to_e4m3(0.0f), 0x00);
  EXPECT_EQ(float_to_e4m3(1.0f), 0x38);
  EXPECT_EQ(float_to_e4m3(-2.0f), 0xC0);
  EXPECT_EQ(float_to_e4m3(448.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3(1e6f), 0x7E);      // saturates: E4M3FN has no infinity
  EXPECT_EQ(float_to_e4m3(-1e6f), 0xFE);
  EXPECT_EQ(float_to_e4m3(0.001953125f), 0x01);  // 2^-9, the smallest subnormal
  EXPECT_EQ(float_to_e4m3(0.015625f), 0x08);     // 2^-6, the smallest normal
  EXPECT_EQ(float_to_e4m3(1.0625f), 0x38);       // halfway between 1 and 1.125: ties to even
  EXPECT_EQ(float_to_e4m3(1.1875f), 0x3A);       // halfway between 1.125 and 1.25: ties to even
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7F) == 0x7F) continue;  // NaN
    float value = e4m3_to_float(static_cast<uint8_t>(code));
    EXPECT_EQ(float_to_e4m3(value), code == 0x80 ? 0x80 : code) << code;
  }
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7F)));
}

TEST(Convert, Bf16F16F32RoundTrip) {
  float values[] = {1.0f, -3.140625f, 65504.0f, 6.103515625e-05f, 5.960464477539063e-08f, 0.0f};
  std::byte wide[sizeof(values)], narrow[sizeof(values) / 2], back[sizeof(values)];
  std::memcpy(wide, values, sizeof(values));
  for (Dtype dtype : {Dtype::kF16, Dtype::kBF16}) {
    convert_elements(narrow, dtype, wide, Dtype::kF32, 6);
    convert_elements(back, Dtype::kF32, narrow, dtype, 6);
    float result[6];
    std::memcpy(result, back, sizeof(result));
    EXPECT_EQ(result[0], 1.0f);
    EXPECT_EQ(result[1], -3.140625f);
    if (dtype == Dtype::kF16) {
      EXPECT_EQ(result[2], 65504.0f);
      EXPECT_EQ(result[3], 6.103515625e-05f);
      EXPECT_EQ(result[4], 5.960464477539063e-08f);
    }
  }
  // BF16 rounds to nearest even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7.
  float halfway = 1.0f + std::ldexp(1.0f, -8);
  uint16_t bits;
  convert_elements(reinterpret_cast<std::byte*>(&bits), Dtype::kBF16, reinterpret_cast<const std::byte*>(&halfway),
                   Dtype::kF32, 1);
  EXPECT_EQ(bits, 0x3F80);
  EXPECT_THROW(convert_elements(narrow, Dtype::kI16, wide, Dtype::kF32, 1), Error);
}

TEST(ModelHook, RunsOncePerLoadAfterAllBatches) {
  MemoryCheckpoint checkpoint = synth_in_memory(synth_options("llama"));
  ModelLayout layout = host_layout(checkpoint);
  int runs = 0;
  bool complete_when_run = false;
  layout.add_hook(make_model_hook("count", [&](ModelLayout& model) {
    ++runs;
    // lm_head is loaded last in file order: the hook sees it complete.
    auto loaded = parameter_bytes(model.parameter("lm_head.weight"));
    const auto& expected = checkpoint.tensor("lm_head.weight").bytes;
    complete_when_run = std::equal(expected.begin(), expected.end(), loaded.begin());
  }));
  auto views = checkpoint.views();
  LoadSession session(layout);
  session.begin(LoadMode::kCold);
  for (const TensorView& view : views) {
    session.load(view);
    EXPECT_EQ(runs, 0) << "a model hook ran during load()";
  }
  session.finish();
  EXPECT_EQ(runs, 1);
  EXPECT_TRUE(complete_when_run);
  EXPECT_EQ(session.counters().model_hook_runs, 1u);
  for (int reload = 0; reload < 3; ++reload) run_load(layout, LoadMode::kUpdate, {{views[3]}, {views[4]}});
  EXPECT_EQ(runs, 4);
  EXPECT_EQ(layout.model_hook_runs(), 4u);
  EXPECT_EQ(layout.loads_finished(), 4u);
}

TEST(ModelHook, NonRerunnableHookFailsAReloadAtBeginBeforeAnyWeightIsTouched) {
  MemoryCheckpoint first = synth_in_memory(synth_options("llama", 1));
  MemoryCheckpoint second = synth_in_memory(synth_options("llama", 2));
  ModelLayout layout = host_layout(first);
  int runs = 0;
  layout.add_hook(make_model_hook("repack_once", [&](ModelLayout&) { ++runs; }, /*rerunnable=*/false));
  run_load(layout, LoadMode::kCold, {first.views()});
  ModelLayout before = host_layout(first);
  run_load(before, LoadMode::kCold, {first.views()});
  for (LoadMode mode : {LoadMode::kReload, LoadMode::kUpdate, LoadMode::kCold}) {
    LoadSession session(layout);
    try {
      session.begin(mode);
      FAIL() << "expected an error";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kModel);
      EXPECT_THAT(error.what(), HasSubstr("model hook 'repack_once' declares that it cannot run twice"));
      EXPECT_THAT(error.what(), HasSubstr(std::string(load_mode_name(mode)) + " load of llama tp 1 rank 0"));
    }
    EXPECT_THROW(session.load(second.views()), Error);  // the session never began
  }
  EXPECT_EQ(runs, 1);
  EXPECT_EQ(compare_layouts(layout, before).mismatched, 0u);
}

TEST(ModelHook, TiedLmHeadIsRefreshedInPlace) {
  SynthOptions options = synth_options("llama", 1);
  options.tie_word_embeddings = true;
  MemoryCheckpoint first = synth_in_memory(options);
  options.seed = 2;
  MemoryCheckpoint second = synth_in_memory(options);
  ASSERT_TRUE(first.config.tie_word_embeddings);
  ModelLayout layout = host_layout(first, 2, 1);
  EXPECT_TRUE(layout.parameter("lm_head.weight").parts.empty());
  layout.add_hook(make_tied_lm_head_hook());
  run_load(layout, LoadMode::kCold, {first.views()});
  EXPECT_EQ(bytes_of(layout, "lm_head.weight"), bytes_of(layout, "model.embed_tokens.weight"));
  const std::byte* address = layout.parameter("lm_head.weight").data;
  run_load(layout, LoadMode::kUpdate, {{second.tensor("model.embed_tokens.weight").view()}});
  EXPECT_EQ(bytes_of(layout, "lm_head.weight"), bytes_of(layout, "model.embed_tokens.weight"));
  EXPECT_NE(bytes_of(layout, "lm_head.weight"), parameter_bytes(host_layout(first, 2, 1).parameter("lm_head.weight")));
  EXPECT_EQ(layout.parameter("lm_head.weight").data, address);
}

TEST(ModelHook, FusedKvBufferFollowsEveryLayerInPlace) {
  MemoryCheckpoint first = synth_in_memory(synth_options("qwen3", 1));
  MemoryCheckpoint second = synth_in_memory(synth_options("qwen3", 2));
  ModelLayout layout = host_layout(first, 4, 2);
  layout.add_hook(make_fused_kv_hook());
  ASSERT_EQ(layout.hooks()[0]->derived_buffers().size(), 1u);
  DerivedBuffer buffer = layout.hooks()[0]->derived_buffers()[0];
  auto check = [&] {
    std::vector<std::byte> expected;
    for (int64_t layer = 0; layer < 2; ++layer) {
      const Parameter& qkv = layout.parameter("model.layers." + std::to_string(layer) + ".self_attn.qkv_proj.weight");
      auto bytes = parameter_bytes(qkv);
      // k and v are the last rows of qkv_proj.
      expected.insert(expected.end(), bytes.begin() + static_cast<ptrdiff_t>(qkv.parts[1].element_offset * 2),
                      bytes.end());
    }
    ASSERT_EQ(expected.size(), buffer.bytes);
    EXPECT_EQ(std::memcmp(expected.data(), buffer.data, buffer.bytes), 0);
  };
  run_load(layout, LoadMode::kCold, {first.views()});
  check();
  uint64_t allocated = layout.allocated_bytes();
  run_load(layout, LoadMode::kReload, {second.views_except("v_proj"), second.views_matching("v_proj")});
  check();
  EXPECT_EQ(layout.hooks()[0]->derived_buffers()[0].data, buffer.data);
  EXPECT_EQ(layout.allocated_bytes(), allocated);
  ModelLayout plain = build_model_layout(synth_in_memory(synth_options("deepseek_v3")).config);
  plain.allocate(Device{});
  try {
    plain.add_hook(make_fused_kv_hook());
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), HasSubstr("has parts 'k' and 'v'"));
  }
  // MLA keeps one latent K/V per layer: the kv_a rows of fused_qkv_a_proj.
  plain.add_hook(make_fused_kv_hook("model.layers.{layer}.self_attn.fused_qkv_a_proj.weight", {"kv_a"}));
  EXPECT_GT(plain.hooks()[0]->derived_buffers()[0].bytes, 0u);
}

class Fp8Processing : public ::testing::Test {
 protected:
  static LayoutOptions quantized() {
    LayoutOptions options;
    options.quantize = Processing::kFp8PerTensor;
    return options;
  }
  /// Checks a quantized parameter against the checkpoint: scale = amax / 448 and every
  /// code is the E4M3 of value / scale.
  static void expect_quantized(const ModelLayout& layout, const MemoryCheckpoint& checkpoint, const std::string& name) {
    const Parameter& parameter = layout.parameter(name);
    ASSERT_EQ(parameter.dtype, Dtype::kF8E4M3);
    std::vector<float> values(parameter.elements());
    for (const ParameterPart& part : parameter.parts) {
      auto slice = testing::slice_of(checkpoint.tensor(part.tensor), part.row_begin, part.rows, part.column_begin,
                                     part.columns);
      convert_elements(reinterpret_cast<std::byte*>(values.data() + part.element_offset), Dtype::kF32, slice.data(),
                       Dtype::kBF16, part.elements());
    }
    float amax = 0;
    for (float value : values) amax = std::max(amax, std::fabs(value));
    float scale;
    std::memcpy(&scale, parameter_bytes(layout.parameter(parameter.scale)).data(), 4);
    EXPECT_EQ(scale, amax / 448.0f) << name;
    auto codes = parameter_bytes(parameter);
    for (size_t i = 0; i < values.size(); ++i) {
      ASSERT_EQ(static_cast<uint8_t>(codes[i]), float_to_e4m3(values[i] / scale)) << name << " element " << i;
    }
  }
};

TEST_F(Fp8Processing, QuantizesEachLayerWhenItsLastPartArrives) {
  MemoryCheckpoint checkpoint = synth_in_memory(synth_options("llama"));
  ModelLayout layout = host_layout(checkpoint, 2, 0, quantized());
  LoadSession session(layout);
  session.begin(LoadMode::kCold);
  session.load(checkpoint.views_except("layers.1."));
  EXPECT_EQ(session.counters().layer_processing_runs, 1u);  // layer 0 is complete, layer 1 is not
  EXPECT_EQ(session.completed_layers(), (std::vector<int64_t>{-1, 0}));
  session.load(checkpoint.views_matching("layers.1."));
  EXPECT_EQ(session.counters().layer_processing_runs, 2u);
  session.finish();
  EXPECT_EQ(session.counters().layer_processing_runs, 2u);
  for (const std::string& name : {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.down_proj.weight",
                                  "model.layers.1.self_attn.o_proj.weight"}) {
    expect_quantized(layout, checkpoint, name);
  }
}

TEST_F(Fp8Processing, UpdateInCheckpointFormatReprocessesOnlyItsLayer) {
  MemoryCheckpoint first = synth_in_memory(synth_options("llama", 1));
  MemoryCheckpoint second = synth_in_memory(synth_options("llama", 2));
  ModelLayout layout = host_layout(first, 1, 0, quantized());
  run_load(layout, LoadMode::kCold, {first.views()});
  ModelLayout before = host_layout(first, 1, 0, quantized());
  run_load(before, LoadMode::kCold, {first.views()});
  auto addresses = storage_addresses(layout);
  std::vector<TensorView> layer_one_attention;
  for (const char* name : {"q_proj", "k_proj", "v_proj"}) {
    layer_one_attention.push_back(second.tensor("model.layers.1.self_attn." + std::string(name) + ".weight").view());
  }
  LoadCounters counters = run_load(layout, LoadMode::kUpdate,
                                   {{layer_one_attention[2]}, {layer_one_attention[0], layer_one_attention[1]}});
  EXPECT_EQ(counters.layer_processing_runs, 1u);
  MemoryCheckpoint mixed = first;
  for (const char* name : {"q_proj", "k_proj", "v_proj"}) {
    std::string tensor = "model.layers.1.self_attn." + std::string(name) + ".weight";
    for (auto& entry : mixed.tensors) {
      if (entry.name == tensor) entry = second.tensor(tensor);
    }
  }
  expect_quantized(layout, mixed, "model.layers.1.self_attn.qkv_proj.weight");
  for (const Parameter& parameter : layout.parameters()) {
    if (parameter.name.starts_with("model.layers.1.self_attn.qkv_proj")) continue;
    EXPECT_EQ(parameter_bytes(parameter), bytes_of(before, parameter.name)) << parameter.name;
  }
  EXPECT_EQ(storage_addresses(layout), addresses);
}

TEST_F(Fp8Processing, PartialUpdateOfAQuantizedParameterFailsWithoutTouchingIt) {
  MemoryCheckpoint first = synth_in_memory(synth_options("llama", 1));
  MemoryCheckpoint second = synth_in_memory(synth_options("llama", 2));
  ModelLayout layout = host_layout(first, 1, 0, quantized());
  run_load(layout, LoadMode::kCold, {first.views()});
  auto before = bytes_of(layout, "model.layers.0.self_attn.qkv_proj.weight");
  LoadSession session(layout);
  session.begin(LoadMode::kUpdate);
  session.load(second.tensor("model.layers.0.self_attn.q_proj.weight").view());
  try {
    session.finish();
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), HasSubstr("FP8-processed parameters need every part"));
    EXPECT_THAT(error.what(), HasSubstr("model.layers.0.self_attn.qkv_proj.weight (missing "
                                        "model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.v_proj.weight)"));
  }
  EXPECT_EQ(bytes_of(layout, "model.layers.0.self_attn.qkv_proj.weight"), before);
}

}  // namespace
}  // namespace weightstream
