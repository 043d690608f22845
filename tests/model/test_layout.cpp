// Layouts built from config.json: fused parameters, tensor-parallel shapes, vocabulary
// padding, K/V head replication, MLA, stacked experts, MTP layers, expert parallelism;
// engine memory bound to parameters (the checks of bind, and loads writing into it in place).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "model/model_fixtures.hpp"
#include "weightstream/error.hpp"

namespace weightstream {
namespace {

using ::testing::HasSubstr;
using testing::bytes_of;
using testing::cached_checkpoint;
using testing::cold_loaded_layout;
using testing::MemoryCheckpoint;
using testing::run_load;
using testing::synth_in_memory;
using testing::synth_options;

ModelConfig llama_config(int64_t heads, int64_t kv_heads) {
  ModelConfig config;
  config.model_type = "llama";
  config.hidden_size = 64 * heads;
  config.intermediate_size = 256;
  config.num_hidden_layers = 2;
  config.num_attention_heads = heads;
  config.num_key_value_heads = kv_heads;
  config.head_dim = 64;
  config.vocab_size = 1000;
  config.torch_dtype = "bfloat16";
  return config;
}

const ParameterPart& part_of(const Parameter& parameter, std::string_view id) {
  for (const ParameterPart& part : parameter.parts) {
    if (part.id == id) return part;
  }
  throw std::runtime_error("no part " + std::string(id) + " in " + parameter.name);
}

TEST(ModelLayout, LlamaFusesQkvAndGateUp) {
  ModelLayout layout = build_model_layout(llama_config(8, 2));
  const Parameter& qkv = layout.parameter("model.layers.0.self_attn.qkv_proj.weight");
  EXPECT_EQ(qkv.shape, (std::vector<int64_t>{512 + 2 * 128, 512}));
  ASSERT_EQ(qkv.parts.size(), 3u);
  EXPECT_EQ(part_of(qkv, "q").tensor, "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(part_of(qkv, "k").element_offset, 512u * 512u);
  EXPECT_EQ(part_of(qkv, "v").element_offset, 640u * 512u);
  const Parameter& gate_up = layout.parameter("model.layers.1.mlp.gate_up_proj.weight");
  EXPECT_EQ(gate_up.shape, (std::vector<int64_t>{512, 512}));
  EXPECT_EQ(part_of(gate_up, "1").tensor, "model.layers.1.mlp.up_proj.weight");
  EXPECT_EQ(layout.route("model.layers.0.self_attn.rotary_emb.inv_freq").kind, TensorRoute::Kind::kIgnored);
  EXPECT_EQ(layout.route("model.layers.0.self_attn.unknown").kind, TensorRoute::Kind::kUnmatched);
  EXPECT_EQ(layout.description(), "llama tp 1 rank 0");
}

TEST(ModelLayout, TensorParallelShardsColumnsRowsAndVocabulary) {
  LayoutOptions options;
  options.parallel = {4, 3};
  ModelLayout layout = build_model_layout(llama_config(8, 4), options);
  const Parameter& qkv = layout.parameter("model.layers.0.self_attn.qkv_proj.weight");
  // 2 of 8 query heads and 1 of 4 K/V heads per rank.
  EXPECT_EQ(qkv.shape, (std::vector<int64_t>{128 + 64 + 64, 512}));
  EXPECT_EQ(part_of(qkv, "q").row_begin, 3 * 128);
  EXPECT_TRUE(part_of(qkv, "q").contiguous());
  EXPECT_EQ(part_of(qkv, "k").row_begin, 3 * 64);
  const Parameter& o_proj = layout.parameter("model.layers.0.self_attn.o_proj.weight");
  EXPECT_EQ(o_proj.shape, (std::vector<int64_t>{512, 128}));
  EXPECT_EQ(o_proj.parts[0].column_begin, 3 * 128);
  EXPECT_FALSE(o_proj.parts[0].contiguous());
  // 1000 rows padded to 1024, 256 per rank: rank 3 holds rows 768..999 and 24 zero rows.
  const Parameter& embedding = layout.parameter("model.embed_tokens.weight");
  EXPECT_EQ(embedding.shape, (std::vector<int64_t>{256, 512}));
  EXPECT_EQ(embedding.parts[0].row_begin, 768);
  EXPECT_EQ(embedding.parts[0].rows, 232);
  ASSERT_EQ(embedding.padding.size(), 1u);
  EXPECT_EQ(embedding.padding[0], std::make_pair(uint64_t{232 * 512 * 2}, uint64_t{256 * 512 * 2}));
}

TEST(ModelLayout, KvHeadsReplicateWhenTpSizeExceedsThem) {
  for (int64_t rank = 0; rank < 8; ++rank) {
    LayoutOptions options;
    options.parallel = {8, rank};
    ModelLayout layout = build_model_layout(llama_config(8, 2), options);
    const Parameter& qkv = layout.parameter("model.layers.1.self_attn.qkv_proj.weight");
    EXPECT_EQ(qkv.shape, (std::vector<int64_t>{64 + 64 + 64, 512}));
    // Ranks 0-3 hold K/V head 0, ranks 4-7 head 1.
    EXPECT_EQ(part_of(qkv, "k").row_begin, rank / 4 * 64) << "rank " << rank;
    EXPECT_EQ(part_of(qkv, "v").rows, 64);
  }
}

TEST(ModelLayout, RejectsShardingThatDoesNotDivide) {
  LayoutOptions options;
  options.parallel = {3, 0};
  try {
    build_model_layout(llama_config(6, 2), options);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kModel);
    EXPECT_THAT(error.what(), HasSubstr("padded to a multiple of 64"));
    EXPECT_THAT(error.what(), HasSubstr("model.embed_tokens.weight"));
  }
  options.parallel = {2, 2};
  EXPECT_THROW(build_model_layout(llama_config(8, 2), options), Error);
  ModelConfig config = llama_config(8, 2);
  config.model_type = "gpt2";
  try {
    build_model_layout(config);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), HasSubstr("model_type 'gpt2' has no mapping table"));
  }
}

TEST(ModelLayout, Qwen3AddsQueryAndKeyNorms) {
  auto checkpoint = synth_in_memory(synth_options("qwen3"));
  ModelLayout layout = build_model_layout(checkpoint.config);
  EXPECT_EQ(layout.parameter("model.layers.1.self_attn.k_norm.weight").shape,
            (std::vector<int64_t>{checkpoint.config.head_dim}));
  for (const auto& tensor : checkpoint.tensors) {
    EXPECT_EQ(layout.route(tensor.name).kind, TensorRoute::Kind::kParameter) << tensor.name;
  }
}

TEST(ModelLayout, DeepSeekMlaExpertsAndMtp) {
  auto checkpoint = synth_in_memory(synth_options("deepseek_v3"));
  const ModelConfig& config = checkpoint.config;
  LayoutOptions options;
  options.parallel = {2, 1};
  ModelLayout layout = build_model_layout(config, options);
  LayoutOptions draft_options = options;
  draft_options.modules = LayoutModules::kDraft;
  ModelLayout draft = build_model_layout(config, draft_options);
  // Every checkpoint tensor has a home: the target's layers, or the draft's MTP layers.
  int64_t mtp = config.num_hidden_layers;
  std::string mtp_prefix = "model.layers." + std::to_string(mtp) + ".";
  for (const auto& tensor : checkpoint.tensors) {
    bool draft_tensor = tensor.name.starts_with(mtp_prefix);
    EXPECT_EQ(layout.route(tensor.name).kind, draft_tensor ? TensorRoute::Kind::kSkipped : TensorRoute::Kind::kParameter)
        << tensor.name;
    if (draft_tensor) EXPECT_EQ(draft.route(tensor.name).kind, TensorRoute::Kind::kParameter) << tensor.name;
  }
  const Parameter& fused = layout.parameter("model.layers.0.self_attn.fused_qkv_a_proj.weight");
  EXPECT_EQ(fused.shape[0], config.q_lora_rank + config.kv_lora_rank + config.qk_rope_head_dim);
  const Parameter& w13 = layout.parameter("model.layers.1.mlp.experts.w13_weight");
  EXPECT_EQ(w13.shape, (std::vector<int64_t>{config.n_routed_experts, config.moe_intermediate_size,
                                             config.hidden_size}));
  EXPECT_EQ(w13.parts.size(), static_cast<size_t>(2 * config.n_routed_experts));
  const Parameter& w2 = layout.parameter("model.layers.1.mlp.experts.w2_weight");
  EXPECT_EQ(w2.shape, (std::vector<int64_t>{config.n_routed_experts, config.hidden_size,
                                            config.moe_intermediate_size / 2}));
  EXPECT_EQ(layout.parameter("model.layers.1.mlp.gate.e_score_correction_bias").dtype, Dtype::kF32);
  EXPECT_EQ(draft.layer_kind(mtp), LayerKind::kMtp);
  EXPECT_EQ(layer_label(draft, mtp), "MTP layer " + std::to_string(mtp));
  EXPECT_TRUE(draft.find("model.layers." + std::to_string(mtp) + ".eh_proj.weight"));
  EXPECT_FALSE(layout.find("model.layers." + std::to_string(mtp) + ".eh_proj.weight"));
  EXPECT_TRUE(layout.find("model.layers.0.mlp.gate_up_proj.weight"));  // first_k_dense_replace
}

TEST(ModelLayout, ExpertParallelRanksHoldWholeExperts) {
  auto checkpoint = synth_in_memory(synth_options("deepseek_v3"));
  const ModelConfig& config = checkpoint.config;
  LayoutOptions options;
  options.parallel = {1, 0, 2, 1};
  ModelLayout layout = build_model_layout(config, options);
  int64_t local = config.n_routed_experts / 2;
  const Parameter& w13 = layout.parameter("model.layers.1.mlp.experts.w13_weight");
  EXPECT_EQ(w13.shape, (std::vector<int64_t>{local, 2 * config.moe_intermediate_size, config.hidden_size}));
  EXPECT_EQ(w13.parts[0].tensor, "model.layers.1.mlp.experts." + std::to_string(local) + ".gate_proj.weight");
  TensorRoute route = layout.route("model.layers.1.mlp.experts.0.down_proj.weight");
  EXPECT_EQ(route.kind, TensorRoute::Kind::kSkipped);
  EXPECT_THAT(route.reason, HasSubstr("expert-parallel rank 0"));
}

TEST(ModelLayout, DraftModuleIsALayoutOfItsOwn) {
  auto checkpoint = synth_in_memory(synth_options("deepseek_v3"));
  LayoutOptions options;
  options.modules = LayoutModules::kDraft;
  ModelLayout draft = build_model_layout(checkpoint.config, options);
  for (const Parameter& parameter : draft.parameters()) {
    EXPECT_EQ(draft.layer_kind(parameter.layer), LayerKind::kMtp) << parameter.name;
  }
  EXPECT_EQ(draft.route("model.layers.0.input_layernorm.weight").kind, TensorRoute::Kind::kSkipped);
  options.modules = LayoutModules::kTarget;
  ModelLayout target = build_model_layout(checkpoint.config, options);
  EXPECT_EQ(target.route("model.layers.2.eh_proj.weight").kind, TensorRoute::Kind::kSkipped);
  // The default layout is the target: layers 0 to num_hidden_layers - 1 only.
  ModelLayout plain = build_model_layout(checkpoint.config);
  EXPECT_EQ(target.parameters().size(), plain.parameters().size());
  for (const Parameter& parameter : plain.parameters()) {
    EXPECT_NE(plain.layer_kind(parameter.layer), LayerKind::kMtp) << parameter.name;
  }
}

TEST(ModelLayout, QuantizedLayoutStoresFp8WithScales) {
  LayoutOptions options;
  options.quantize = Processing::kFp8PerTensor;
  ModelLayout layout = build_model_layout(llama_config(8, 2), options);
  const Parameter& qkv = layout.parameter("model.layers.0.self_attn.qkv_proj.weight");
  EXPECT_EQ(qkv.dtype, Dtype::kF8E4M3);
  EXPECT_EQ(qkv.load_dtype, Dtype::kBF16);
  EXPECT_EQ(qkv.scale, "model.layers.0.self_attn.qkv_proj.weight_scale");
  EXPECT_EQ(layout.parameter(qkv.scale).dtype, Dtype::kF32);
  EXPECT_EQ(layout.parameter("model.layers.0.input_layernorm.weight").dtype, Dtype::kBF16);
}

TEST(ModelLayout, CustomLayoutThroughTheApi) {
  ModelLayout layout;
  layout.set_description("custom");
  Parameter parameter;
  parameter.name = "w";
  parameter.dtype = Dtype::kF32;
  parameter.shape = {4, 2};
  parameter.parts.push_back({"a", "", {2, 2}, 0, 2, 0, 2, 0, "a"});
  parameter.parts.push_back({"b", "", {2, 2}, 0, 2, 0, 2, 3, "b"});
  try {
    layout.add_parameter(parameter);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), HasSubstr("two parts fill element 3"));
  }
  parameter.parts[1].element_offset = 4;
  layout.add_parameter(parameter);
  EXPECT_THROW(layout.add_parameter(parameter), Error);
  EXPECT_EQ(layout.route("b").targets, (std::vector<std::pair<size_t, size_t>>{{0, 1}}));
}

/// The message of the Error that `bind` throws, or "" when it throws none.
template <typename Call>
std::string bind_error(Call&& call) {
  try {
    call();
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

/// Engine-owned host memory for parameter `name`: a view of `memory`, resized to fit.
TensorView engine_view(const ModelLayout& layout, std::string_view name, std::vector<std::byte>& memory) {
  const Parameter& parameter = layout.parameter(name);
  memory.assign(parameter.bytes(), std::byte{0x5A});
  TensorView view;
  view.name = name;
  view.dtype = parameter.dtype;
  view.shape = parameter.shape;
  view.data = memory.data();
  view.bytes = memory.size();
  return view;
}

TEST(ModelLayout, AColdLoadSkipsZeroingOnlyWhereEveryUnallocatedParameterHasParts) {
  ModelLayout layout = build_model_layout(cached_checkpoint("llama").config);
  EXPECT_EQ(layout.cold_load_contents(), ModelLayout::ArenaContents::kUnwritten)
      << "every parameter of a family's layout is filled by its parts, its padding zeroed by the load";
  Parameter computed;  // filled by no checkpoint tensor (a hook's, say): must read as zero
  computed.name = "computed";
  computed.dtype = Dtype::kF32;
  computed.shape = {2};
  layout.add_parameter(computed);
  EXPECT_EQ(layout.cold_load_contents(), ModelLayout::ArenaContents::kZeroed);
  std::vector<std::byte> memory;  // once bound it is the engine's memory, never allocated
  layout.bind("computed", engine_view(layout, "computed", memory));
  EXPECT_EQ(layout.cold_load_contents(), ModelLayout::ArenaContents::kUnwritten);
}

TEST(ModelLayout, BindChecksDtypeShapeSizeDeviceAlignmentAndOverlap) {
  ModelLayout layout = build_model_layout(llama_config(8, 2));
  const std::string name = "model.layers.0.mlp.down_proj.weight";
  const std::string other = "model.layers.1.mlp.down_proj.weight";
  const std::string prefix = "cannot bind parameter " + name + " of llama tp 1 rank 0: ";
  std::vector<std::byte> memory;
  TensorView good = engine_view(layout, name, memory);  // BF16 [512, 256]

  TensorView wrong = good;
  wrong.dtype = Dtype::kF16;
  EXPECT_THAT(bind_error([&] { layout.bind(name, wrong); }), HasSubstr(prefix + "expected dtype BF16, given F16"));
  std::vector<int64_t> transposed{256, 512};
  wrong = good;
  wrong.shape = transposed;
  EXPECT_THAT(bind_error([&] { layout.bind(name, wrong); }),
              HasSubstr(prefix + "expected shape [512, 256], given [256, 512]"));
  wrong = good;
  wrong.bytes -= 2;
  EXPECT_THAT(bind_error([&] { layout.bind(name, wrong); }),
              HasSubstr(prefix + "expected 262144 bytes from offset 0, given 262142 bytes from offset 0"));
  wrong = good;
  wrong.data = nullptr;
  EXPECT_THAT(bind_error([&] { layout.bind(name, wrong); }), HasSubstr(prefix + "expected memory, given a null address"));
  wrong = good;
  wrong.data = memory.data() + 1;
  EXPECT_THAT(bind_error([&] { layout.bind(name, wrong); }),
              HasSubstr(prefix + "expected an address aligned to 2 bytes (BF16 elements), given 0x"));
  EXPECT_THAT(bind_error([&] { layout.bind("model.nope", good); }),
              HasSubstr("cannot bind parameter model.nope: it is not in llama tp 1 rank 0"));
  EXPECT_TRUE(layout.bound_names().empty());

  // The first bind fixes the device: a CUDA address is refused without touching it.
  layout.bind(name, good);
  EXPECT_EQ(layout.bound_names(), (std::vector<std::string>{name}));
  EXPECT_EQ(layout.parameter(name).data, memory.data());
  std::vector<std::byte> more;
  TensorView on_gpu = engine_view(layout, other, more);
  on_gpu.device = Device{Device::Kind::kCuda, 0};
  EXPECT_THAT(bind_error([&] { layout.bind(other, on_gpu); }),
              HasSubstr("cannot bind parameter " + other +
                        " of llama tp 1 rank 0: expected memory on cpu (where the layout's storage lives), given "
                        "memory on cuda:0"));
  EXPECT_THAT(bind_error([&] { layout.allocate(Device{Device::Kind::kCuda, 0}); }),
              HasSubstr("cannot place the storage of llama tp 1 rank 0 on cuda:0: it already lives on cpu"));
  EXPECT_THAT(bind_error([&] { layout.bind(name, good); }), HasSubstr(prefix + "it is already bound"));
  TensorView overlapping = engine_view(layout, other, more);
  overlapping.data = memory.data() + 1024;
  // other has name's shape: its bytes from 1 KiB into name's memory overlap it (never touched).
  EXPECT_THAT(bind_error([&] { layout.bind(other, overlapping); }),
              HasSubstr("cannot bind parameter " + other + " of llama tp 1 rank 0: expected memory of its own, given "
                        "memory at 0x"));
  EXPECT_THAT(bind_error([&] { layout.bind(other, overlapping); }), HasSubstr("overlaps parameter " + name + "'s"));
  EXPECT_EQ(layout.bound_names(), (std::vector<std::string>{name}));
}

TEST(ModelLayout, BindOfSeveralTensorsChecksThemAllFirst) {
  ModelLayout layout = build_model_layout(llama_config(8, 2));
  std::vector<std::byte> a, b;
  std::vector<TensorView> views{engine_view(layout, "model.norm.weight", a),
                                engine_view(layout, "model.layers.0.mlp.down_proj.weight", b)};
  std::vector<int64_t> wrong{1, 2};
  views[1].shape = wrong;
  EXPECT_THAT(bind_error([&] { layout.bind(views); }), HasSubstr("expected shape [512, 256], given [1, 2]"));
  EXPECT_TRUE(layout.bound_names().empty()) << "a failed bind binds nothing";
  views[1] = views[0];
  EXPECT_THAT(bind_error([&] { layout.bind(views); }),
              HasSubstr("cannot bind parameter model.norm.weight of llama tp 1 rank 0: two tensors are given for it"));
  views.pop_back();
  layout.bind(views);
  EXPECT_EQ(layout.bound_names(), (std::vector<std::string>{"model.norm.weight"}));
  EXPECT_EQ(layout.unbound_names().size(), layout.parameters().size() - 1);
}

TEST(ModelLayout, AllocateFillsOnlyWhatIsUnboundAndBindComesBeforeIt) {
  const MemoryCheckpoint& checkpoint = cached_checkpoint("llama");
  ModelLayout layout = build_model_layout(checkpoint.config);
  std::vector<std::byte> memory;
  const std::string name = "model.layers.0.self_attn.qkv_proj.weight";
  layout.bind(name, engine_view(layout, name, memory));
  layout.allocate(Device{});
  EXPECT_EQ(layout.parameter(name).data, memory.data());
  uint64_t expected = 0;
  for (const Parameter& parameter : layout.parameters()) expected += parameter.name == name ? 0 : parameter.bytes();
  EXPECT_EQ(layout.allocated_bytes(), expected) << "bound memory is the engine's: never allocated";
  const std::string other = "model.layers.1.self_attn.qkv_proj.weight";
  std::vector<std::byte> more;
  EXPECT_THAT(bind_error([&] { layout.bind(other, engine_view(layout, other, more)); }),
              HasSubstr("it already has storage (allocated by the layout, or shared); bind before allocate()"));
}

TEST(ModelLayout, BoundMemoryReceivesEveryLoadInPlace) {
  const MemoryCheckpoint& first = cached_checkpoint("llama", 1);
  const MemoryCheckpoint& second = cached_checkpoint("llama", 2);
  LayoutOptions options;
  options.parallel = {2, 1};
  ModelLayout layout = build_model_layout(first.config, options);
  std::map<std::string, std::vector<std::byte>> memory;
  std::vector<TensorView> views;
  for (const Parameter& parameter : layout.parameters()) views.push_back(engine_view(layout, parameter.name, memory[parameter.name]));
  layout.bind(views);
  EXPECT_EQ(layout.unbound_names(), std::vector<std::string>{});
  auto addresses = storage_addresses(layout);

  run_load(layout, LoadMode::kCold, {first.views()});
  ModelLayout reference = cold_loaded_layout(first, 2, 1);
  for (const Parameter& parameter : reference.parameters()) {
    EXPECT_EQ(memory.at(parameter.name), bytes_of(reference, parameter.name)) << parameter.name;
  }
  run_load(layout, LoadMode::kReload, {second.views()});
  ModelLayout reloaded = cold_loaded_layout(second, 2, 1);
  for (const Parameter& parameter : reloaded.parameters()) {
    EXPECT_EQ(memory.at(parameter.name), bytes_of(reloaded, parameter.name)) << parameter.name;
  }
  EXPECT_EQ(storage_addresses(layout), addresses);
  EXPECT_EQ(layout.allocated_bytes(), 0u);
  std::vector<std::byte> late;
  EXPECT_THAT(bind_error([&] { layout.bind("model.norm.weight", engine_view(layout, "model.norm.weight", late)); }),
              HasSubstr("the layout has been loaded, and storage never moves after the first load"));
}

// An engine that fills a parameter by its own loader: the layout drops it, never allocates it,
// and routes the tensors that fed only it as skipped; a load completes without them.
TEST(ModelLayout, ARemovedParameterIsNeitherAllocatedNorFilledNorRequired) {
  const MemoryCheckpoint& checkpoint = cached_checkpoint("llama");
  ModelLayout layout = build_model_layout(checkpoint.config);
  const std::string qkv = "model.layers.0.self_attn.qkv_proj.weight";
  const uint64_t parameters = layout.parameters().size();
  const uint64_t qkv_bytes = layout.parameter(qkv).bytes();
  layout.remove_parameter(qkv, "loaded by the engine");
  EXPECT_EQ(layout.parameters().size(), parameters - 1);
  EXPECT_FALSE(layout.find(qkv).has_value());
  for (const char* tensor : {"q_proj", "k_proj", "v_proj"}) {
    TensorRoute route = layout.route(std::string("model.layers.0.self_attn.") + tensor + ".weight");
    EXPECT_EQ(route.kind, TensorRoute::Kind::kSkipped) << tensor;
    EXPECT_EQ(route.reason, "loaded by the engine");
  }
  EXPECT_EQ(layout.route("model.layers.1.self_attn.q_proj.weight").kind, TensorRoute::Kind::kParameter);
  layout.allocate(Device{});
  ModelLayout whole = build_model_layout(checkpoint.config);
  whole.allocate(Device{});
  EXPECT_GE(whole.allocated_bytes() - layout.allocated_bytes(), qkv_bytes) << "the removed parameter is not allocated";
  LoadCounters counters = run_load(layout, LoadMode::kCold, {checkpoint.views()});
  EXPECT_EQ(counters.tensors_skipped, 3u);
  ModelLayout reference = cold_loaded_layout(checkpoint);
  for (const Parameter& parameter : layout.parameters()) {
    EXPECT_EQ(bytes_of(layout, parameter.name), bytes_of(reference, parameter.name)) << parameter.name;
  }
  EXPECT_THAT(bind_error([&] { layout.remove_parameter("model.norm.weight", "late"); }),
              HasSubstr("cannot remove parameter model.norm.weight from llama tp 1 rank 0: storage was bound or "
                        "allocated, a hook added or a load run already"));
  EXPECT_THAT(bind_error([&] { ModelLayout fresh = build_model_layout(checkpoint.config);
                               fresh.remove_parameter("model.nothing", "why"); }),
              HasSubstr("cannot remove parameter model.nothing: it is not in llama tp 1 rank 0"));
}

// An engine that keeps a BF16 checkpoint's parameter in F32 (SGLang's GLM-4.5 router): the
// layout holds it in F32, a load converts its parts as it writes them, and its values are
// the BF16 ones widened exactly.
TEST(ModelLayout, AParameterHeldInAWiderFloatDtypeLoadsConverted) {
  const MemoryCheckpoint& checkpoint = cached_checkpoint("llama");
  ModelLayout layout = build_model_layout(checkpoint.config);
  const std::string norm = "model.layers.0.input_layernorm.weight";
  const uint64_t bf16_bytes = layout.parameter(norm).bytes();
  layout.hold_as(norm, Dtype::kF32);
  EXPECT_EQ(layout.parameter(norm).dtype, Dtype::kF32);
  EXPECT_EQ(layout.parameter(norm).bytes(), 2 * bf16_bytes);
  layout.allocate(Device{});
  run_load(layout, LoadMode::kCold, {checkpoint.views()});
  ModelLayout reference = cold_loaded_layout(checkpoint);
  std::vector<std::byte> bf16 = bytes_of(reference, norm);
  std::vector<std::byte> widened(bf16.size() * 2);
  convert_elements(widened.data(), Dtype::kF32, bf16.data(), Dtype::kBF16, bf16.size() / 2);
  EXPECT_EQ(bytes_of(layout, norm), widened);
  for (const Parameter& parameter : layout.parameters()) {
    if (parameter.name != norm) EXPECT_EQ(bytes_of(layout, parameter.name), bytes_of(reference, parameter.name));
  }
  EXPECT_THAT(bind_error([&] { layout.hold_as("model.norm.weight", Dtype::kF32); }),
              HasSubstr("cannot hold parameter model.norm.weight of llama tp 1 rank 0 in F32: storage was bound or "
                        "allocated, a hook added or a load run already"));
  ModelLayout fresh = build_model_layout(checkpoint.config);
  EXPECT_THAT(bind_error([&] { fresh.hold_as("model.norm.weight", Dtype::kI32); }),
              HasSubstr("cannot hold parameter model.norm.weight of llama tp 1 rank 0 (BF16) in I32: only an "
                        "unprocessed float parameter, neither FP8 block-scaled nor a block scale, is held in another "
                        "of F16, BF16 and F32"));
  EXPECT_THAT(bind_error([&] { fresh.hold_as("model.nothing", Dtype::kF32); }),
              HasSubstr("cannot hold parameter model.nothing in another dtype: it is not in llama tp 1 rank 0"));
}

}  // namespace
}  // namespace weightstream
