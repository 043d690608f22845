// Synthetic checkpoints shaped like the Hugging Face releases of llama, qwen3, deepseek_v3
// and qwen3_next, for tests and benchmarks. Weights are a pure function of (seed, tensor
// name, byte offset), so a tensor's bytes do not depend on the shard layout, any range
// can be generated independently, and multi-GB shards stream to disk without being held.

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "format/json_text.hpp"
#include "format/output_file.hpp"
#include "weightstream/error.hpp"
#include "weightstream/format.hpp"
#include "weightstream/options.hpp"

namespace weightstream {
namespace {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

using OrderedJson = nlohmann::ordered_json;

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

// splitmix64's output function: a bijective 64-bit mix. Applied to a counter it gives a
// position-addressable stream (https://prng.di.unimi.it/splitmix64.c).
constexpr uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t name_hash(std::string_view name) {
  uint64_t hash = 0xcbf29ce484222325ull;  // FNV-1a
  for (char c : name) hash = (hash ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  return hash;
}

// Turns 64 random bits into 64 bits of finite values of a dtype, lane-parallel:
//   out = (bits & keep) | ((((bits >> shift) & field) + add) << shift) | set
// `keep` passes the random sign and mantissa bits, the middle term puts a small random
// exponent in each lane's exponent field, `set` forces constant bits (norms near 1.0).
struct LaneTransform {
  uint64_t keep = ~0ull;
  unsigned shift = 0;
  uint64_t field = 0;
  uint64_t add = 0;
  uint64_t set = 0;

  uint64_t operator()(uint64_t bits) const { return (bits & keep) | ((((bits >> shift) & field) + add) << shift) | set; }
};

constexpr uint64_t repeat16(uint64_t lane) { return lane * 0x0001000100010001ull; }
constexpr uint64_t repeat32(uint64_t lane) { return lane * 0x0000000100000001ull; }
constexpr uint64_t repeat8(uint64_t lane) { return lane * 0x0101010101010101ull; }

enum class ValueKind { kWeight, kNorm };

// Weights get magnitudes of about 2^-11 to 2^-4 (5e-4 to 0.12) with a random sign, norms
// values in [1, 1.125); never NaN, infinity or a subnormal.
LaneTransform lane_transform(Dtype dtype, ValueKind kind) {
  bool norm = kind == ValueKind::kNorm;
  switch (dtype) {
    case Dtype::kBF16:  // 1-8-7, bias 127
      return norm ? LaneTransform{repeat16(0x000f), 0, 0, 0, repeat16(0x3f80)}
                  : LaneTransform{repeat16(0x807f), 7, repeat16(7), repeat16(116), 0};
    case Dtype::kF16:  // 1-5-10, bias 15
      return norm ? LaneTransform{repeat16(0x007f), 0, 0, 0, repeat16(0x3c00)}
                  : LaneTransform{repeat16(0x83ff), 10, repeat16(7), repeat16(4), 0};
    case Dtype::kF32:  // 1-8-23, bias 127; C64 is two F32
    case Dtype::kC64:
      return norm ? LaneTransform{repeat32(0x000fffff), 0, 0, 0, repeat32(0x3f800000)}
                  : LaneTransform{repeat32(0x807fffff), 23, repeat32(7), repeat32(116), 0};
    case Dtype::kF64:  // 1-11-52, bias 1023
      return norm ? LaneTransform{0x0001ffffffffffffull, 0, 0, 0, 0x3ff0000000000000ull}
                  : LaneTransform{0x800fffffffffffffull, 52, 7, 1012, 0};
    case Dtype::kF8E4M3:  // 1-4-3, bias 7 (FNUZ: bias 8); exponents 1..4 avoid NaN and subnormals
    case Dtype::kF8E4M3Fnuz:
      return norm ? LaneTransform{repeat8(1), 0, 0, 0, repeat8(dtype == Dtype::kF8E4M3 ? 0x38 : 0x40)}
                  : LaneTransform{repeat8(0x87), 3, repeat8(3), repeat8(1), 0};
    case Dtype::kF8E5M2:  // 1-5-2, bias 15 (FNUZ: bias 16)
    case Dtype::kF8E5M2Fnuz:
      return norm ? LaneTransform{repeat8(1), 0, 0, 0, repeat8(dtype == Dtype::kF8E5M2 ? 0x3c : 0x40)}
                  : LaneTransform{repeat8(0x83), 2, repeat8(3), repeat8(8), 0};
    case Dtype::kF8E8M0:  // exponent only, bias 127, 0xff is NaN
      return norm ? LaneTransform{0, 0, 0, 0, repeat8(127)} : LaneTransform{0, 0, repeat8(7), repeat8(120), 0};
    case Dtype::kBool:
      return LaneTransform{repeat8(1), 0, 0, 0, 0};
    default:
      // Integers, and F4/F6 whose every bit pattern is a finite value (OCP MX spec).
      return LaneTransform{};
  }
}

// Fills bytes [offset, offset + out.size()) of the stream of a tensor whose key is `key`.
void fill_values(uint64_t key, const LaneTransform& transform, uint64_t offset, std::span<std::byte> out) {
  uint64_t word = offset / 8;
  size_t done = 0;
  if (size_t skip = offset % 8; skip != 0) {
    uint64_t value = transform(mix64(key + (word + 1) * kGolden));
    size_t length = std::min(out.size(), 8 - skip);
    std::memcpy(out.data(), reinterpret_cast<const char*>(&value) + skip, length);
    done = length;
    ++word;
  }
  for (; out.size() - done >= 8; done += 8, ++word) {
    uint64_t value = transform(mix64(key + (word + 1) * kGolden));
    std::memcpy(out.data() + done, &value, 8);
  }
  if (done < out.size()) {
    uint64_t value = transform(mix64(key + (word + 1) * kGolden));
    std::memcpy(out.data() + done, &value, out.size() - done);
  }
}

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

bool is_norm(std::string_view name) { return name.ends_with("norm.weight"); }

std::string_view torch_dtype_name(Dtype dtype) {
  switch (dtype) {
    case Dtype::kBF16: return "bfloat16";
    case Dtype::kF16: return "float16";
    case Dtype::kF32: return "float32";
    case Dtype::kF64: return "float64";
    case Dtype::kF8E4M3: return "float8_e4m3fn";
    case Dtype::kF8E5M2: return "float8_e5m2";
    case Dtype::kF8E4M3Fnuz: return "float8_e4m3fnuz";
    case Dtype::kF8E5M2Fnuz: return "float8_e5m2fnuz";
    default: return {};
  }
}

// The config of a synthetic model of `layers` layers and width `hidden`.
ModelConfig synth_config(const SynthOptions& options, int64_t layers, int64_t hidden) {
  ModelConfig config;
  config.model_type = options.arch;
  config.hidden_size = hidden;
  config.num_hidden_layers = layers;
  config.vocab_size = options.vocab;
  config.torch_dtype = std::string(torch_dtype_name(options.dtype));
  // Heads of 64 like the real models where the width allows, else two heads.
  config.num_attention_heads = hidden >= 128 && hidden % 64 == 0 ? hidden / 64 : 2;
  config.head_dim = hidden / config.num_attention_heads;
  // Grouped-query attention: the largest divisor of the head count not above a quarter of it.
  config.num_key_value_heads = std::max<int64_t>(1, config.num_attention_heads / 4);
  while (config.num_attention_heads % config.num_key_value_heads != 0) --config.num_key_value_heads;
  config.intermediate_size = round_up(hidden * 11 / 4, 64);
  config.tie_word_embeddings = options.tie_word_embeddings;
  if (options.arch == "deepseek_v3") {
    config.tie_word_embeddings = false;
    config.num_key_value_heads = config.num_attention_heads;  // MLA has no grouped heads
    config.q_lora_rank = hidden / 2;
    config.kv_lora_rank = hidden / 4;
    config.qk_nope_head_dim = 32;
    config.qk_rope_head_dim = 16;
    config.v_head_dim = 32;
    config.head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim;
    config.n_routed_experts = options.experts;
    config.n_shared_experts = options.shared_experts;
    config.num_experts_per_tok = options.experts_per_token;
    config.moe_intermediate_size = round_up(hidden / 2, 32);
    config.first_k_dense_replace = std::min(options.first_dense_layers, layers);
    config.moe_layer_freq = 1;
    config.num_nextn_predict_layers = options.mtp_layers;
  }
  if (options.arch == "qwen3_next") {
    config.tie_word_embeddings = false;
    // Gated DeltaNet heads as in the release (16 key and 32 value heads of half the
    // attention head size), scaled to the width.
    config.linear_num_key_heads = config.num_attention_heads;
    config.linear_num_value_heads = 2 * config.num_attention_heads;
    config.linear_key_head_dim = std::max<int64_t>(1, config.head_dim / 2);
    config.linear_value_head_dim = config.linear_key_head_dim;
    config.linear_conv_kernel_dim = 4;
    // Full attention every fourth layer as released, and at least once in a small model.
    config.full_attention_interval = std::min<int64_t>(4, layers);
    config.num_experts = options.experts;
    config.num_experts_per_tok = options.experts_per_token;
    config.moe_intermediate_size = round_up(hidden / 2, 32);
    config.shared_expert_intermediate_size = options.shared_experts > 0 ? config.moe_intermediate_size : 0;
    config.decoder_sparse_step = 1;
    config.num_nextn_predict_layers = options.mtp_layers;
  }
  return config;
}

bool is_full_attention_layer(const ModelConfig& c, int64_t layer) {
  return c.model_type != "qwen3_next" || (layer + 1) % c.full_attention_interval == 0;
}

bool has_qwen_experts(const ModelConfig& c, int64_t layer) {
  return c.num_experts > 0 && (layer + 1) % c.decoder_sparse_step == 0;
}

OrderedJson config_json(const ModelConfig& config) {
  OrderedJson json;
  if (config.model_type == "llama") {
    json["architectures"] = {"LlamaForCausalLM"};
  } else if (config.model_type == "qwen3") {
    json["architectures"] = {"Qwen3ForCausalLM"};
  } else if (config.model_type == "qwen3_next") {
    json["architectures"] = {"Qwen3NextForCausalLM"};
  } else {
    json["architectures"] = {"DeepseekV3ForCausalLM"};
  }
  json["model_type"] = config.model_type;
  json["hidden_size"] = config.hidden_size;
  json["intermediate_size"] = config.intermediate_size;
  json["num_hidden_layers"] = config.num_hidden_layers;
  json["num_attention_heads"] = config.num_attention_heads;
  json["num_key_value_heads"] = config.num_key_value_heads;
  if (config.model_type == "qwen3" || config.model_type == "qwen3_next") json["head_dim"] = config.head_dim;
  json["vocab_size"] = config.vocab_size;
  json["hidden_act"] = "silu";
  json["max_position_embeddings"] = 4096;
  json["rms_norm_eps"] = 1e-6;
  json["rope_theta"] = config.model_type == "llama"        ? 500000.0
                       : config.model_type == "qwen3"      ? 1000000.0
                       : config.model_type == "qwen3_next" ? 10000000.0
                                                           : 10000.0;
  json["tie_word_embeddings"] = config.tie_word_embeddings;
  json["torch_dtype"] = config.torch_dtype;
  if (config.model_type == "deepseek_v3") {
    json["q_lora_rank"] = config.q_lora_rank;
    json["kv_lora_rank"] = config.kv_lora_rank;
    json["qk_nope_head_dim"] = config.qk_nope_head_dim;
    json["qk_rope_head_dim"] = config.qk_rope_head_dim;
    json["v_head_dim"] = config.v_head_dim;
    json["n_routed_experts"] = config.n_routed_experts;
    json["n_shared_experts"] = config.n_shared_experts;
    json["num_experts_per_tok"] = config.num_experts_per_tok;
    json["moe_intermediate_size"] = config.moe_intermediate_size;
    json["first_k_dense_replace"] = config.first_k_dense_replace;
    json["moe_layer_freq"] = config.moe_layer_freq;
    json["num_nextn_predict_layers"] = config.num_nextn_predict_layers;
    json["n_group"] = 1;
    json["topk_group"] = 1;
    json["topk_method"] = "noaux_tc";
    json["scoring_func"] = "sigmoid";
    json["norm_topk_prob"] = true;
    json["routed_scaling_factor"] = 2.5;
  }
  if (config.model_type == "qwen3_next") {
    json["full_attention_interval"] = config.full_attention_interval;
    json["linear_num_key_heads"] = config.linear_num_key_heads;
    json["linear_num_value_heads"] = config.linear_num_value_heads;
    json["linear_key_head_dim"] = config.linear_key_head_dim;
    json["linear_value_head_dim"] = config.linear_value_head_dim;
    json["linear_conv_kernel_dim"] = config.linear_conv_kernel_dim;
    json["num_experts"] = config.num_experts;
    json["num_experts_per_tok"] = config.num_experts_per_tok;
    json["moe_intermediate_size"] = config.moe_intermediate_size;
    json["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size;
    json["decoder_sparse_step"] = config.decoder_sparse_step;
    json["mlp_only_layers"] = OrderedJson::array();
    json["norm_topk_prob"] = true;
    json["partial_rotary_factor"] = 0.25;
    // The MTP layer count under the name vLLM's Qwen3NextMTP reads.
    json["num_nextn_predict_layers"] = config.num_nextn_predict_layers;
  }
  return json;
}

void add_dense_mlp(std::vector<TensorSpec>& specs, const std::string& prefix, int64_t hidden, int64_t inner,
                   Dtype dtype) {
  specs.push_back({prefix + "gate_proj.weight", dtype, {inner, hidden}});
  specs.push_back({prefix + "up_proj.weight", dtype, {inner, hidden}});
  specs.push_back({prefix + "down_proj.weight", dtype, {hidden, inner}});
}

// One DeepSeek decoder layer: MLA attention, then a dense MLP or routed plus shared experts.
void add_deepseek_layer(std::vector<TensorSpec>& specs, const ModelConfig& c, const std::string& p, bool moe,
                        Dtype dtype) {
  int64_t h = c.hidden_size;
  int64_t heads = c.num_attention_heads;
  int64_t qk_head = c.qk_nope_head_dim + c.qk_rope_head_dim;
  specs.push_back({p + "input_layernorm.weight", dtype, {h}});
  if (c.q_lora_rank > 0) {
    specs.push_back({p + "self_attn.q_a_proj.weight", dtype, {c.q_lora_rank, h}});
    specs.push_back({p + "self_attn.q_a_layernorm.weight", dtype, {c.q_lora_rank}});
    specs.push_back({p + "self_attn.q_b_proj.weight", dtype, {heads * qk_head, c.q_lora_rank}});
  } else {
    specs.push_back({p + "self_attn.q_proj.weight", dtype, {heads * qk_head, h}});
  }
  specs.push_back({p + "self_attn.kv_a_proj_with_mqa.weight", dtype, {c.kv_lora_rank + c.qk_rope_head_dim, h}});
  specs.push_back({p + "self_attn.kv_a_layernorm.weight", dtype, {c.kv_lora_rank}});
  specs.push_back(
      {p + "self_attn.kv_b_proj.weight", dtype, {heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank}});
  specs.push_back({p + "self_attn.o_proj.weight", dtype, {h, heads * c.v_head_dim}});
  specs.push_back({p + "post_attention_layernorm.weight", dtype, {h}});
  if (!moe) {
    add_dense_mlp(specs, p + "mlp.", h, c.intermediate_size, dtype);
    return;
  }
  specs.push_back({p + "mlp.gate.weight", dtype, {c.n_routed_experts, h}});
  // The router's bias stays F32 in the released checkpoint, whatever the weights' dtype.
  specs.push_back({p + "mlp.gate.e_score_correction_bias", Dtype::kF32, {c.n_routed_experts}});
  for (int64_t e = 0; e < c.n_routed_experts; ++e) {
    add_dense_mlp(specs, p + "mlp.experts." + std::to_string(e) + ".", h, c.moe_intermediate_size, dtype);
  }
  if (c.n_shared_experts > 0) {
    add_dense_mlp(specs, p + "mlp.shared_experts.", h, c.moe_intermediate_size * c.n_shared_experts, dtype);
  }
}

// One Qwen3-Next layer: gated full attention or Gated DeltaNet, then routed experts with one
// gated shared expert, or a dense MLP. Shapes as in the Hugging Face release.
void add_qwen3_next_layer(std::vector<TensorSpec>& specs, const ModelConfig& c, const std::string& p,
                          bool full_attention, bool moe, Dtype dtype) {
  int64_t h = c.hidden_size;
  specs.push_back({p + "input_layernorm.weight", dtype, {h}});
  if (full_attention) {
    int64_t q_width = c.num_attention_heads * c.head_dim;
    int64_t kv_width = c.num_key_value_heads * c.head_dim;
    specs.push_back({p + "self_attn.q_proj.weight", dtype, {2 * q_width, h}});  // query and output gate
    specs.push_back({p + "self_attn.k_proj.weight", dtype, {kv_width, h}});
    specs.push_back({p + "self_attn.v_proj.weight", dtype, {kv_width, h}});
    specs.push_back({p + "self_attn.o_proj.weight", dtype, {h, q_width}});
    specs.push_back({p + "self_attn.q_norm.weight", dtype, {c.head_dim}});
    specs.push_back({p + "self_attn.k_norm.weight", dtype, {c.head_dim}});
  } else {
    int64_t key_dim = c.linear_num_key_heads * c.linear_key_head_dim;
    int64_t value_dim = c.linear_num_value_heads * c.linear_value_head_dim;
    specs.push_back({p + "linear_attn.in_proj_qkvz.weight", dtype, {2 * key_dim + 2 * value_dim, h}});
    specs.push_back({p + "linear_attn.in_proj_ba.weight", dtype, {2 * c.linear_num_value_heads, h}});
    specs.push_back({p + "linear_attn.conv1d.weight", dtype, {2 * key_dim + value_dim, 1, c.linear_conv_kernel_dim}});
    specs.push_back({p + "linear_attn.dt_bias", dtype, {c.linear_num_value_heads}});
    specs.push_back({p + "linear_attn.A_log", dtype, {c.linear_num_value_heads}});
    specs.push_back({p + "linear_attn.norm.weight", dtype, {c.linear_value_head_dim}});
    specs.push_back({p + "linear_attn.out_proj.weight", dtype, {h, value_dim}});
  }
  specs.push_back({p + "post_attention_layernorm.weight", dtype, {h}});
  if (!moe) {
    add_dense_mlp(specs, p + "mlp.", h, c.intermediate_size, dtype);
    return;
  }
  specs.push_back({p + "mlp.gate.weight", dtype, {c.num_experts, h}});
  for (int64_t e = 0; e < c.num_experts; ++e) {
    add_dense_mlp(specs, p + "mlp.experts." + std::to_string(e) + ".", h, c.moe_intermediate_size, dtype);
  }
  if (c.shared_expert_intermediate_size > 0) {
    add_dense_mlp(specs, p + "mlp.shared_expert.", h, c.shared_expert_intermediate_size, dtype);
    specs.push_back({p + "mlp.shared_expert_gate.weight", dtype, {1, h}});
  }
}

uint64_t total_bytes(std::span<const TensorSpec> specs) {
  uint64_t total = 0;
  for (const TensorSpec& spec : specs) total += tensor_byte_size(spec.dtype, spec.shape).value_or(0);
  return total;
}

// Shard of each tensor: consecutive runs of about total/shards bytes, none empty.
std::vector<size_t> assign_shards(std::span<const uint64_t> sizes, size_t shards) {
  uint64_t total = 0;
  for (uint64_t size : sizes) total += size;
  std::vector<size_t> shard_of(sizes.size());
  size_t shard = 0;
  uint64_t done = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    shard_of[i] = shard;
    done += sizes[i];
    size_t tensors_left = sizes.size() - i - 1;
    size_t shards_left = shards - shard - 1;
    // Boundary of shard s: (s + 1) / shards of the total, in 128-bit to avoid overflow.
    auto boundary = static_cast<uint64_t>(static_cast<unsigned __int128>(total) * (shard + 1) / shards);
    if (shards_left > 0 && (done >= boundary || tensors_left == shards_left)) ++shard;
  }
  return shard_of;
}

std::string shard_name(size_t index, size_t shards) {
  char name[64];
  std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", index + 1, shards);
  return name;
}

// Runs `work(worker, item)` for every item in [0, count) on up to `workers` threads; the
// first failure stops further work and is rethrown.
void run_parallel(size_t count, size_t workers, const std::function<void(size_t, size_t)>& work) {
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr first_error;
  std::mutex error_mutex;
  auto worker = [&](size_t id) {
    for (size_t item; !failed && (item = next++) < count;) {
      try {
        work(id, item);
      } catch (...) {
        std::lock_guard lock(error_mutex);
        if (!first_error) first_error = std::current_exception();
        failed = true;
      }
    }
  };
  workers = std::max<size_t>(1, std::min(workers, count));
  {
    std::vector<std::jthread> pool;
    for (size_t id = 1; id < workers; ++id) pool.emplace_back(worker, id);
    worker(0);
  }  // joins
  if (first_error) std::rethrow_exception(first_error);
}

// A piece of one tensor's bytes, generated and written independently of the others.
struct Chunk {
  size_t shard;
  size_t tensor;          // index in the shard
  uint64_t offset;        // in the tensor
  uint64_t length;
  uint64_t file_offset;
};

}  // namespace

std::vector<TensorSpec> checkpoint_tensor_specs(const ModelConfig& c, Dtype dtype) {
  WS_EXPECT(c.model_type == "llama" || c.model_type == "qwen3" || c.model_type == "deepseek_v3" ||
                c.model_type == "qwen3_next",
            ErrorCode::kInvalidArgument,
            "no tensor list for model_type " + detail::quoted_name(c.model_type) +
                ": llama, qwen3, deepseek_v3 or qwen3_next");
  std::vector<TensorSpec> specs;
  int64_t h = c.hidden_size;
  specs.push_back({"model.embed_tokens.weight", dtype, {c.vocab_size, h}});
  if (c.model_type == "deepseek_v3") {
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      bool moe = c.n_routed_experts > 0 && i >= c.first_k_dense_replace && i % c.moe_layer_freq == 0;
      add_deepseek_layer(specs, c, "model.layers." + std::to_string(i) + ".", moe, dtype);
    }
    // Multi-token prediction layers follow the decoder layers, as in DeepSeek-V3's release.
    for (int64_t i = 0; i < c.num_nextn_predict_layers; ++i) {
      std::string p = "model.layers." + std::to_string(c.num_hidden_layers + i) + ".";
      specs.push_back({p + "embed_tokens.weight", dtype, {c.vocab_size, h}});
      specs.push_back({p + "enorm.weight", dtype, {h}});
      specs.push_back({p + "hnorm.weight", dtype, {h}});
      specs.push_back({p + "eh_proj.weight", dtype, {h, 2 * h}});
      add_deepseek_layer(specs, c, p, c.n_routed_experts > 0, dtype);
      specs.push_back({p + "shared_head.norm.weight", dtype, {h}});
      specs.push_back({p + "shared_head.head.weight", dtype, {c.vocab_size, h}});
    }
  } else if (c.model_type == "qwen3_next") {
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      add_qwen3_next_layer(specs, c, "model.layers." + std::to_string(i) + ".", is_full_attention_layer(c, i),
                           has_qwen_experts(c, i), dtype);
    }
  } else {
    int64_t q_width = c.num_attention_heads * c.head_dim;
    int64_t kv_width = c.num_key_value_heads * c.head_dim;
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      std::string p = "model.layers." + std::to_string(i) + ".";
      specs.push_back({p + "input_layernorm.weight", dtype, {h}});
      specs.push_back({p + "self_attn.q_proj.weight", dtype, {q_width, h}});
      specs.push_back({p + "self_attn.k_proj.weight", dtype, {kv_width, h}});
      specs.push_back({p + "self_attn.v_proj.weight", dtype, {kv_width, h}});
      specs.push_back({p + "self_attn.o_proj.weight", dtype, {h, q_width}});
      if (c.model_type == "qwen3") {
        specs.push_back({p + "self_attn.q_norm.weight", dtype, {c.head_dim}});
        specs.push_back({p + "self_attn.k_norm.weight", dtype, {c.head_dim}});
      }
      specs.push_back({p + "post_attention_layernorm.weight", dtype, {h}});
      add_dense_mlp(specs, p + "mlp.", h, c.intermediate_size, dtype);
    }
  }
  specs.push_back({"model.norm.weight", dtype, {h}});
  if (!c.tie_word_embeddings) specs.push_back({"lm_head.weight", dtype, {c.vocab_size, h}});
  if (c.model_type == "qwen3_next") {
    // The MTP module last, as mtp.* sorts after the target's names in the release's index.
    // Its layers have full attention and, as vLLM numbers them, experts by their own index.
    specs.push_back({"mtp.fc.weight", dtype, {h, 2 * h}});
    specs.push_back({"mtp.pre_fc_norm_embedding.weight", dtype, {h}});
    specs.push_back({"mtp.pre_fc_norm_hidden.weight", dtype, {h}});
    for (int64_t i = 0; i < c.num_nextn_predict_layers; ++i) {
      add_qwen3_next_layer(specs, c, "mtp.layers." + std::to_string(i) + ".", true, has_qwen_experts(c, i), dtype);
    }
    specs.push_back({"mtp.norm.weight", dtype, {h}});
  }
  return specs;
}

SynthResult synthesize_checkpoint(const std::filesystem::path& directory, const SynthOptions& options) {
  auto invalid = [](bool ok, const std::string& rule) { WS_EXPECT(ok, ErrorCode::kInvalidArgument, "synth: " + rule); };
  invalid(options.arch == "llama" || options.arch == "qwen3" || options.arch == "deepseek_v3" ||
              options.arch == "qwen3_next",
          "arch " + detail::quoted_name(options.arch) + " is not one of llama, qwen3, deepseek_v3, qwen3_next");
  invalid(options.layers >= 1 && options.layers <= 65536, "layers must be from 1 to 65536");
  invalid(options.hidden >= 64 && options.hidden <= 65536 && options.hidden % 32 == 0,
          "hidden " + std::to_string(options.hidden) + " must be a multiple of 32 from 64 to 65536");
  invalid(options.vocab >= 1 && options.vocab <= (1 << 20), "vocab must be from 1 to 1048576");
  invalid(options.shards >= 1 && options.shards <= 99999, "shards must be from 1 to 99999");
  invalid(!torch_dtype_name(options.dtype).empty(),
          "dtype " + std::string(dtype_name(options.dtype)) + " is not a floating-point weight dtype");
  if (options.arch == "deepseek_v3" || options.arch == "qwen3_next") {
    invalid(options.experts >= 1 && options.experts <= 65536, "experts must be from 1 to 65536");
    invalid(options.shared_experts >= 0 && options.shared_experts <= 64, "shared_experts must be from 0 to 64");
    invalid(options.experts_per_token >= 1 && options.experts_per_token <= options.experts,
            "experts_per_token must be from 1 to experts");
    invalid(options.first_dense_layers >= 0, "first_dense_layers must not be negative");
    invalid(options.mtp_layers >= 0 && options.mtp_layers <= 16, "mtp_layers must be from 0 to 16");
  }

  int64_t layers = options.layers;
  int64_t hidden = options.hidden;
  if (options.target_bytes) {
    // Scaling only adds layers and width: a target below one layer cannot be met, and
    // writing the one-layer model instead would pass for what was asked.
    uint64_t smallest = total_bytes(checkpoint_tensor_specs(synth_config(options, 1, hidden), options.dtype));
    invalid(*options.target_bytes >= smallest,
            "size " + format_size(*options.target_bytes) + " is below the smallest " + options.arch +
                " checkpoint of hidden size " + std::to_string(hidden) + ": one layer is " + std::to_string(smallest) +
                " bytes (" + format_size(smallest) + "); ask for at least that, or a smaller hidden size");
    // Bytes grow linearly with layers: fit the line through 1 and 2 layers, and widen the
    // model instead when the target would take an unrealistic number of thin layers.
    for (;;) {
      uint64_t one = total_bytes(checkpoint_tensor_specs(synth_config(options, 1, hidden), options.dtype));
      uint64_t two = total_bytes(checkpoint_tensor_specs(synth_config(options, 2, hidden), options.dtype));
      uint64_t per_layer = std::max<uint64_t>(1, two - one);
      uint64_t wanted = *options.target_bytes > one ? (*options.target_bytes - one + per_layer / 2) / per_layer : 0;
      layers = static_cast<int64_t>(std::min<uint64_t>(wanted, 65535)) + 1;
      if (layers <= kSynthMaxScaledLayers || hidden * 2 > 16384) break;
      hidden *= 2;
    }
  }

  ModelConfig config = synth_config(options, layers, hidden);
  std::vector<TensorSpec> specs = checkpoint_tensor_specs(config, options.dtype);
  auto shards = static_cast<size_t>(options.shards);
  invalid(shards <= specs.size(), std::to_string(shards) + " shards for " + std::to_string(specs.size()) +
                                      " tensors: every shard must hold a tensor");

  std::error_code error;
  std::filesystem::create_directories(directory, error);
  WS_EXPECT(!error, ErrorCode::kIo, "cannot create directory " + directory.string() + ": " + error.message());

  std::vector<uint64_t> sizes;
  for (const TensorSpec& spec : specs) sizes.push_back(*tensor_byte_size(spec.dtype, spec.shape));
  std::vector<size_t> shard_of = assign_shards(sizes, shards);

  SynthResult result;
  std::string config_text = config_json(config).dump(2) + "\n";
  result.config = parse_model_config("config.json", config_text);
  detail::write_text_file(directory / "config.json", config_text);
  result.files.push_back((directory / "config.json").string());

  CheckpointIndex index;
  std::vector<std::vector<TensorSpec>> shard_specs(shards);
  std::vector<std::vector<uint64_t>> shard_keys(shards);
  uint64_t seed_key = mix64(options.seed + kGolden);
  for (size_t i = 0; i < specs.size(); ++i) {
    std::string name = shard_name(shard_of[i], shards);
    index.weight_map[specs[i].name] = name;
    shard_keys[shard_of[i]].push_back(mix64(seed_key ^ name_hash(specs[i].name)));
    shard_specs[shard_of[i]].push_back(std::move(specs[i]));
  }
  for (size_t s = 0; s < shards; ++s) index.shards.push_back(shard_name(s, shards));
  uint64_t bytes = 0;
  for (uint64_t size : sizes) bytes += size;
  index.total_size = bytes;
  detail::write_text_file(directory / std::string(kIndexFileName), index_json(index));
  result.files.push_back((directory / std::string(kIndexFileName)).string());

  // transformers refuses safetensors files whose metadata lacks a known "format".
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  // Every core fills chunks of any shard and pwrites them in place, so a few large shards
  // still use the whole machine; memory stays at one chunk per thread.
  std::vector<detail::OutputFile> files;
  files.reserve(shards);
  std::vector<Chunk> chunks;
  std::vector<std::vector<LaneTransform>> transforms(shards);
  for (size_t s = 0; s < shards; ++s) {
    std::string header = safetensors_header_bytes(shard_specs[s], metadata);
    files.emplace_back(directory / index.shards[s]);
    files.back().write(header.data(), header.size());
    uint64_t file_offset = header.size();
    for (size_t t = 0; t < shard_specs[s].size(); ++t) {
      const TensorSpec& spec = shard_specs[s][t];
      transforms[s].push_back(lane_transform(spec.dtype, is_norm(spec.name) ? ValueKind::kNorm : ValueKind::kWeight));
      uint64_t size = *tensor_byte_size(spec.dtype, spec.shape);
      for (uint64_t offset = 0; offset < size; offset += SafetensorsWriter::kStreamChunkBytes) {
        uint64_t length = std::min<uint64_t>(SafetensorsWriter::kStreamChunkBytes, size - offset);
        chunks.push_back(Chunk{s, t, offset, length, file_offset + offset});
      }
      file_offset += size;
    }
  }
  size_t workers = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::vector<std::byte>> buffers(std::min(workers, std::max<size_t>(chunks.size(), 1)));
  run_parallel(chunks.size(), buffers.size(), [&](size_t worker, size_t item) {
    const Chunk& chunk = chunks[item];
    std::vector<std::byte>& buffer = buffers[worker];
    buffer.resize(SafetensorsWriter::kStreamChunkBytes);
    std::span<std::byte> out(buffer.data(), static_cast<size_t>(chunk.length));
    fill_values(shard_keys[chunk.shard][chunk.tensor], transforms[chunk.shard][chunk.tensor], chunk.offset, out);
    files[chunk.shard].write_at(chunk.file_offset, out.data(), out.size());
  });
  for (detail::OutputFile& file : files) file.close();
  for (const std::string& shard : index.shards) result.files.push_back((directory / shard).string());
  result.tensors = sizes.size();
  result.bytes = bytes;
  return result;
}

}  // namespace weightstream
