// Synthetic checkpoints shaped like the Hugging Face releases of the supported
// architectures, for tests and benchmarks. The tensors are those of the architecture's
// mapping table (checkpoint_tensors), so synth and the layout builder read one table. Weights are a pure function of (seed, tensor
// name, byte offset), so a tensor's bytes do not depend on the shard layout, any range
// can be generated independently, and multi-GB shards stream to disk without being held.

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "base/parallel.hpp"
#include "format/shared/json_text.hpp"
#include "format/shared/output_file.hpp"
#include "model/checkpoint_tensors.hpp"
#include "weightstream/error.hpp"
#include "weightstream/model.hpp"
#include "weightstream/synth.hpp"
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

/// Rounds intermediate sizes up to this when weights are FP8 block-quantized, so the
/// synthetic model divides among up to 4 ranks in whole 128-row blocks, as real ones do.
constexpr int64_t kBlockAlignedSize = 512;

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
  const Architecture& architecture = *find_architecture(options.arch);
  bool fp8 = options.quantize == SynthOptions::Quantization::kFp8Block;
  bool aligned = fp8 || options.block_aligned;
  auto inner = [&](int64_t size, int64_t multiple) { return round_up(size, aligned ? kBlockAlignedSize : multiple); };
  ModelConfig config;
  config.model_type = options.arch;
  config.hidden_size = hidden;
  config.num_hidden_layers = layers;
  config.vocab_size = options.vocab;
  config.torch_dtype = std::string(torch_dtype_name(options.dtype));
  // Heads of 64 like the real models where the width allows, else two heads; FP8 models
  // (and block-aligned ones) have heads of 128 as the released ones, so that a K/V head is
  // whole scale blocks.
  int64_t head = aligned && hidden % 128 == 0 ? 128 : 64;
  config.num_attention_heads = hidden >= 2 * head && hidden % head == 0 ? hidden / head : 2;
  config.head_dim = hidden / config.num_attention_heads;
  // Grouped-query attention: the largest divisor of the head count not above a quarter of it.
  config.num_key_value_heads = std::max<int64_t>(1, config.num_attention_heads / 4);
  while (config.num_attention_heads % config.num_key_value_heads != 0) --config.num_key_value_heads;
  config.intermediate_size = inner(hidden * 11 / 4, 64);
  config.tie_word_embeddings = options.tie_word_embeddings;
  if (architecture.mla) {
    config.tie_word_embeddings = false;
    config.num_attention_heads = hidden >= 128 && hidden % 64 == 0 ? hidden / 64 : 2;
    config.num_key_value_heads = config.num_attention_heads;  // MLA has no grouped heads
    config.q_lora_rank = hidden / 2;
    config.kv_lora_rank = hidden / 4;
    // The release's head dims with FP8 (a head's rows are then whole blocks on a rank).
    config.qk_nope_head_dim = aligned ? 128 : 32;
    config.qk_rope_head_dim = aligned ? 64 : 16;
    config.v_head_dim = aligned ? 128 : 32;
    config.head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim;
  }
  int64_t moe_inner = inner(hidden / 2, 32);
  switch (architecture.experts) {
    case ExpertLayers::kNone: break;
    case ExpertLayers::kFirstKDense:  // deepseek_v3, kimi_k2, glm4_moe
      config.tie_word_embeddings = false;
      config.n_routed_experts = options.experts;
      config.n_shared_experts = options.shared_experts;
      config.moe_intermediate_size = moe_inner;
      config.first_k_dense_replace = std::min(options.first_dense_layers, layers);
      config.moe_layer_freq = 1;
      break;
    case ExpertLayers::kSparseStep:  // qwen3_moe, qwen3_next
      config.tie_word_embeddings = false;
      config.num_experts = options.experts;
      config.moe_intermediate_size = moe_inner;
      config.decoder_sparse_step = 1;
      if (!architecture.linear_attention) {
        for (int64_t layer = 0; layer < std::min(options.first_dense_layers, layers); ++layer) {
          config.mlp_only_layers.push_back(layer);
        }
      }
      break;
    case ExpertLayers::kEveryLayer:  // mixtral: experts of intermediate_size
      config.tie_word_embeddings = false;
      config.num_local_experts = options.experts;
      config.intermediate_size = moe_inner;
      break;
  }
  if (architecture.experts != ExpertLayers::kNone) config.num_experts_per_tok = options.experts_per_token;
  if (architecture.mtp != MtpPlacement::kNone) config.num_nextn_predict_layers = options.mtp_layers;
  if (options.arch == "glm4_moe") {
    config.attention_bias = true;  // as GLM-4.5 ships
    config.use_qk_norm = false;
  }
  if (architecture.linear_attention) {
    // Gated DeltaNet heads as in the release (16 key and 32 value heads of half the
    // attention head size), scaled to the width.
    config.linear_num_key_heads = config.num_attention_heads;
    config.linear_num_value_heads = 2 * config.num_attention_heads;
    config.linear_key_head_dim = std::max<int64_t>(1, config.head_dim / 2);
    config.linear_value_head_dim = config.linear_key_head_dim;
    config.linear_conv_kernel_dim = 4;
    // Full attention every fourth layer as released, and at least once in a small model.
    config.full_attention_interval = std::min<int64_t>(4, layers);
    config.shared_expert_intermediate_size = options.shared_experts > 0 ? config.moe_intermediate_size : 0;
  }
  if (fp8) {
    config.quantization.quant_method = "fp8";
    config.quantization.fmt = "e4m3";
    config.quantization.activation_scheme = "dynamic";
    config.quantization.weight_block_size = {128, 128};
    if (config.model_type == "qwen3_moe") {
      // Qwen3-MoE's router stays BF16 as released; vLLM's Qwen3-MoE quantizes it unless
      // modules_to_not_convert names it (whole module names: vLLM matches them exactly).
      for (int64_t layer = 0; layer < layers; ++layer) {
        if (std::find(config.mlp_only_layers.begin(), config.mlp_only_layers.end(), layer) != config.mlp_only_layers.end()) {
          continue;
        }
        config.quantization.modules_to_not_convert.push_back("model.layers." + std::to_string(layer) + ".mlp.gate");
      }
    }
  }
  return config;
}

OrderedJson config_json(const ModelConfig& config) {
  const Architecture& architecture = *find_architecture(config.model_type);
  OrderedJson json;
  json["architectures"] = {std::string(architecture.hf_class)};
  json["model_type"] = config.model_type;
  json["hidden_size"] = config.hidden_size;
  json["intermediate_size"] = config.intermediate_size;
  json["num_hidden_layers"] = config.num_hidden_layers;
  json["num_attention_heads"] = config.num_attention_heads;
  json["num_key_value_heads"] = config.num_key_value_heads;
  if (!architecture.mla && config.model_type != "llama" && config.model_type != "mixtral") {
    json["head_dim"] = config.head_dim;
  }
  json["vocab_size"] = config.vocab_size;
  json["hidden_act"] = "silu";
  json["max_position_embeddings"] = 4096;
  json["rms_norm_eps"] = 1e-6;
  json["rope_theta"] = config.model_type == "llama"                                    ? 500000.0
                       : config.model_type == "qwen3" || config.model_type == "qwen3_moe" ? 1000000.0
                       : config.model_type == "qwen3_next"                            ? 10000000.0
                       : config.model_type == "mixtral"                               ? 1000000.0
                                                                                      : 10000.0;
  json["tie_word_embeddings"] = config.tie_word_embeddings;
  json["torch_dtype"] = config.torch_dtype;
  if (architecture.mla) {
    json["q_lora_rank"] = config.q_lora_rank;
    json["kv_lora_rank"] = config.kv_lora_rank;
    json["qk_nope_head_dim"] = config.qk_nope_head_dim;
    json["qk_rope_head_dim"] = config.qk_rope_head_dim;
    json["v_head_dim"] = config.v_head_dim;
    json["topk_method"] = "noaux_tc";
    json["scoring_func"] = "sigmoid";
  }
  switch (architecture.experts) {
    case ExpertLayers::kNone: break;
    case ExpertLayers::kFirstKDense:
      json["n_routed_experts"] = config.n_routed_experts;
      json["n_shared_experts"] = config.n_shared_experts;
      json["num_experts_per_tok"] = config.num_experts_per_tok;
      json["moe_intermediate_size"] = config.moe_intermediate_size;
      json["first_k_dense_replace"] = config.first_k_dense_replace;
      if (architecture.mla) json["moe_layer_freq"] = config.moe_layer_freq;
      json["n_group"] = 1;
      json["topk_group"] = 1;
      json["norm_topk_prob"] = true;
      json["routed_scaling_factor"] = 2.5;
      break;
    case ExpertLayers::kSparseStep:
      json["num_experts"] = config.num_experts;
      json["num_experts_per_tok"] = config.num_experts_per_tok;
      json["moe_intermediate_size"] = config.moe_intermediate_size;
      json["decoder_sparse_step"] = config.decoder_sparse_step;
      json["mlp_only_layers"] = config.mlp_only_layers;
      json["norm_topk_prob"] = true;
      break;
    case ExpertLayers::kEveryLayer:
      json["num_local_experts"] = config.num_local_experts;
      json["num_experts_per_tok"] = config.num_experts_per_tok;
      break;
  }
  if (config.model_type == "glm4_moe") {
    json["attention_bias"] = config.attention_bias;
    json["use_qk_norm"] = config.use_qk_norm;
    json["partial_rotary_factor"] = 0.5;
  }
  if (architecture.linear_attention) {
    json["full_attention_interval"] = config.full_attention_interval;
    json["linear_num_key_heads"] = config.linear_num_key_heads;
    json["linear_num_value_heads"] = config.linear_num_value_heads;
    json["linear_key_head_dim"] = config.linear_key_head_dim;
    json["linear_value_head_dim"] = config.linear_value_head_dim;
    json["linear_conv_kernel_dim"] = config.linear_conv_kernel_dim;
    json["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size;
    json["partial_rotary_factor"] = 0.25;
  }
  // The MTP layer count, under the name vLLM's DeepSeek, GLM and Qwen3-Next MTP models read.
  if (architecture.mtp != MtpPlacement::kNone) json["num_nextn_predict_layers"] = config.num_nextn_predict_layers;
  const ModelConfig::Quantization& quantization = config.quantization;
  if (!quantization.quant_method.empty()) {
    json["quantization_config"] = {{"quant_method", quantization.quant_method},
                                   {"fmt", quantization.fmt},
                                   {"activation_scheme", quantization.activation_scheme},
                                   {"weight_block_size", quantization.weight_block_size}};
    if (!quantization.modules_to_not_convert.empty()) {
      json["quantization_config"]["modules_to_not_convert"] = quantization.modules_to_not_convert;
    }
  }
  return json;
}

// Quantizes rows [row_begin, row_end) (whole block-rows) of the random BF16 values of an
// FP8 block-quantized weight, block by block as DeepSeek-V3's release does: scale =
// amax / 448 (E4M3's largest value), code = E4M3(value / scale). Writes the codes of
// those rows to `codes` and the rows' block scales to `scales` (either may be null).
void quantize_block_rows(uint64_t key, const detail::CheckpointTensor& tensor, int64_t row_begin, int64_t row_end,
                         std::byte* codes, float* scales) {
  const LaneTransform transform = lane_transform(Dtype::kBF16, ValueKind::kWeight);
  int64_t columns = tensor.columns;
  int64_t block_columns = (columns + tensor.block_k - 1) / tensor.block_k;
  std::vector<std::byte> bf16;
  std::vector<float> values;
  for (int64_t row = row_begin; row < row_end; row += tensor.block_n) {
    int64_t rows = std::min(tensor.block_n, row_end - row);
    bf16.resize(static_cast<size_t>(rows * columns) * 2);
    fill_values(key, transform, static_cast<uint64_t>(row * columns) * 2, bf16);
    values.resize(static_cast<size_t>(rows * columns));
    for (size_t i = 0; i < values.size(); ++i) {
      uint16_t bits;
      std::memcpy(&bits, bf16.data() + 2 * i, 2);
      values[i] = std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
    }
    for (int64_t block = 0; block < block_columns; ++block) {
      int64_t begin = block * tensor.block_k, end = std::min(columns, begin + tensor.block_k);
      float amax = 0;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = begin; c < end; ++c) amax = std::max(amax, std::fabs(values[static_cast<size_t>(r * columns + c)]));
      }
      float scale = amax > 0 ? amax / 448.0f : 1.0f;
      if (scales != nullptr) scales[((row - row_begin) / tensor.block_n) * block_columns + block] = scale;
      if (codes == nullptr) continue;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = begin; c < end; ++c) {
          auto at = static_cast<size_t>(r * columns + c);
          codes[static_cast<size_t>((row - row_begin + r) * columns + c)] = std::byte{float_to_e4m3(values[at] / scale)};
        }
      }
    }
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

// A piece of one tensor's bytes, generated and written independently of the others.
struct Chunk {
  size_t shard;
  size_t tensor;          // index in the shard
  uint64_t offset;        // in the tensor
  uint64_t length;
  uint64_t file_offset;
};

/// The files of a checkpoint in `directory`: config.json, the index and every *.safetensors,
/// sorted; none when it does not exist.
std::vector<std::filesystem::path> checkpoint_files_in(const std::filesystem::path& directory) {
  std::vector<std::filesystem::path> files;
  std::error_code error;
  if (!std::filesystem::is_directory(directory, error)) return files;
  for (const auto& entry : std::filesystem::directory_iterator(directory, error)) {
    std::string name = entry.path().filename().string();
    if (name == "config.json" || name == kIndexFileName || (name.ends_with(".safetensors") && !name.starts_with("."))) {
      files.push_back(entry.path());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

/// "config.json, model.safetensors.index.json and 3 .safetensors files".
std::string files_text(const std::vector<std::filesystem::path>& files) {
  std::vector<std::string> named;
  size_t shards = 0;
  for (const std::filesystem::path& file : files) {
    std::string name = file.filename().string();
    if (name.ends_with(".safetensors")) ++shards;
    else named.push_back(name);
  }
  if (shards > 0) named.push_back(std::to_string(shards) + (shards == 1 ? " .safetensors file" : " .safetensors files"));
  std::string text;
  for (size_t i = 0; i < named.size(); ++i) {
    text += (i == 0 ? "" : i + 1 == named.size() ? " and " : ", ") + named[i];
  }
  return text;
}

/// Throws Error(kInvalidArgument) naming the first option out of its range; returns the
/// options' architecture.
const Architecture& expect_valid_options(const SynthOptions& options) {
  auto invalid = [](bool ok, const std::string& rule) { WS_EXPECT(ok, ErrorCode::kInvalidArgument, "synth: " + rule); };
  const Architecture* architecture = find_architecture(options.arch);
  invalid(architecture != nullptr,
          "arch " + detail::quoted_name(options.arch) + " is not one of " + supported_model_types());
  invalid(options.layers >= 1 && options.layers <= 65536, "layers must be from 1 to 65536");
  invalid(options.hidden >= 64 && options.hidden <= 65536 && options.hidden % 32 == 0,
          "hidden " + std::to_string(options.hidden) + " must be a multiple of 32 from 64 to 65536");
  invalid(options.vocab >= 1 && options.vocab <= (1 << 20), "vocab must be from 1 to 1048576");
  invalid(options.shards >= 1 && options.shards <= 99999, "shards must be from 1 to 99999");
  invalid(!torch_dtype_name(options.dtype).empty(),
          "dtype " + std::string(dtype_name(options.dtype)) + " is not a floating-point weight dtype");
  invalid(options.quantize == SynthOptions::Quantization::kNone || options.dtype == Dtype::kBF16,
          "quantize fp8-block quantizes BF16 weights: dtype must be BF16, not " + std::string(dtype_name(options.dtype)));
  if (architecture->experts != ExpertLayers::kNone) {
    invalid(options.experts >= 1 && options.experts <= 65536, "experts must be from 1 to 65536");
    invalid(options.shared_experts >= 0 && options.shared_experts <= 64, "shared_experts must be from 0 to 64");
    invalid(options.experts_per_token >= 1 && options.experts_per_token <= options.experts,
            "experts_per_token must be from 1 to experts");
    invalid(options.first_dense_layers >= 0, "first_dense_layers must not be negative");
  }
  if (architecture->mtp != MtpPlacement::kNone) {
    invalid(options.mtp_layers >= 0 && options.mtp_layers <= 16, "mtp_layers must be from 0 to 16");
  }
  return *architecture;
}

/// The config of the checkpoint to write: the options' layers and hidden size, or, with
/// target_bytes, as many layers (and as wide) as come closest to that size.
ModelConfig sized_config(const SynthOptions& options) {
  int64_t layers = options.layers;
  int64_t hidden = options.hidden;
  if (!options.target_bytes) return synth_config(options, layers, hidden);
  // Scaling only adds layers and width: a target below one layer cannot be met, and
  // writing the one-layer model instead would pass for what was asked.
  uint64_t smallest = total_bytes(checkpoint_tensor_specs(synth_config(options, 1, hidden), options.dtype));
  WS_EXPECT(*options.target_bytes >= smallest, ErrorCode::kInvalidArgument,
            "synth: size " + format_size(*options.target_bytes) + " is below the smallest " + options.arch +
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
  return synth_config(options, layers, hidden);
}

/// The tensors of a checkpoint divided among its shards, with the index that names them and
/// the seed of each tensor's values.
struct ShardedTensors {
  CheckpointIndex index;
  std::vector<std::vector<detail::CheckpointTensor>> tensors;  ///< per shard, in file order
  std::vector<std::vector<uint64_t>> keys;                     ///< per shard and tensor: its values' seed
  uint64_t tensor_count = 0;
};

ShardedTensors shard_tensors(std::vector<detail::CheckpointTensor> tensors, size_t shards, uint64_t seed) {
  std::vector<uint64_t> sizes;
  for (const detail::CheckpointTensor& tensor : tensors) {
    sizes.push_back(*tensor_byte_size(tensor.spec.dtype, tensor.spec.shape));
  }
  std::vector<size_t> shard_of = assign_shards(sizes, shards);
  ShardedTensors sharded;
  sharded.tensors.resize(shards);
  sharded.keys.resize(shards);
  sharded.tensor_count = tensors.size();
  uint64_t seed_key = mix64(seed + kGolden);
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::string name = shard_name(shard_of[i], shards);
    sharded.index.weight_map[tensors[i].spec.name] = name;
    // Codes and scales of a quantized weight both come from the random BF16 values of the weight's name.
    const std::string& source = tensors[i].source.empty() ? tensors[i].spec.name : tensors[i].source;
    sharded.keys[shard_of[i]].push_back(mix64(seed_key ^ name_hash(source)));
    sharded.tensors[shard_of[i]].push_back(std::move(tensors[i]));
  }
  for (size_t s = 0; s < shards; ++s) sharded.index.shards.push_back(shard_name(s, shards));
  uint64_t bytes = 0;
  for (uint64_t size : sizes) bytes += size;
  sharded.index.total_size = bytes;
  return sharded;
}

/// The shards' files, their headers written, and the chunks of every tensor's bytes with the
/// transform that makes each tensor's values.
struct ShardFiles {
  std::vector<detail::OutputFile> files;
  std::vector<Chunk> chunks;
  std::vector<std::vector<LaneTransform>> transforms;  ///< per shard and tensor
};

ShardFiles open_shard_files(const std::filesystem::path& directory, const ShardedTensors& sharded) {
  using Values = detail::CheckpointTensor::Values;
  // transformers refuses safetensors files whose metadata lacks a known "format".
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  const size_t shards = sharded.tensors.size();
  ShardFiles out;
  out.files.reserve(shards);
  out.transforms.resize(shards);
  for (size_t s = 0; s < shards; ++s) {
    std::vector<TensorSpec> specs;
    for (const detail::CheckpointTensor& tensor : sharded.tensors[s]) specs.push_back(tensor.spec);
    std::string header = safetensors_header_bytes(specs, metadata);
    out.files.emplace_back(directory / sharded.index.shards[s]);
    out.files.back().write(header.data(), header.size());
    uint64_t file_offset = header.size();
    for (size_t t = 0; t < specs.size(); ++t) {
      const TensorSpec& spec = specs[t];
      const detail::CheckpointTensor& tensor = sharded.tensors[s][t];
      out.transforms[s].push_back(lane_transform(spec.dtype, is_norm(spec.name) ? ValueKind::kNorm : ValueKind::kWeight));
      uint64_t size = *tensor_byte_size(spec.dtype, spec.shape);
      // FP8 codes are made whole block-rows at a time, scales all at once (they are small).
      uint64_t step = SafetensorsWriter::kStreamChunkBytes;
      if (tensor.values == Values::kFp8Codes) {
        uint64_t block_row = static_cast<uint64_t>(tensor.block_n * tensor.columns);
        step = std::max<uint64_t>(1, SafetensorsWriter::kStreamChunkBytes / block_row) * block_row;
      } else if (tensor.values == Values::kFp8Scales) {
        step = std::max<uint64_t>(size, 1);
      }
      for (uint64_t offset = 0; offset < size; offset += step) {
        uint64_t length = std::min<uint64_t>(step, size - offset);
        out.chunks.push_back(Chunk{s, t, offset, length, file_offset + offset});
      }
      file_offset += size;
    }
  }
  return out;
}

/// Fills every chunk and writes it in place. Every core fills chunks of any shard and pwrites
/// them in place, so a few large shards still use the whole machine; memory stays at one
/// chunk per thread.
void write_chunks(ShardFiles& out, const ShardedTensors& sharded) {
  using Values = detail::CheckpointTensor::Values;
  size_t workers = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::vector<std::byte>> buffers(std::min(workers, std::max<size_t>(out.chunks.size(), 1)));
  detail::run_parallel(out.chunks.size(), buffers.size(), [&](size_t worker, size_t item) {
    const Chunk& chunk = out.chunks[item];
    const detail::CheckpointTensor& tensor = sharded.tensors[chunk.shard][chunk.tensor];
    uint64_t key = sharded.keys[chunk.shard][chunk.tensor];
    std::vector<std::byte>& buffer = buffers[worker];
    buffer.resize(std::max<size_t>(buffer.size(), static_cast<size_t>(chunk.length)));
    std::span<std::byte> bytes(buffer.data(), static_cast<size_t>(chunk.length));
    switch (tensor.values) {
      case Values::kRandom:
        fill_values(key, out.transforms[chunk.shard][chunk.tensor], chunk.offset, bytes);
        break;
      case Values::kFp8Codes: {
        auto row_begin = static_cast<int64_t>(chunk.offset / static_cast<uint64_t>(tensor.columns));
        auto row_end = row_begin + static_cast<int64_t>(chunk.length / static_cast<uint64_t>(tensor.columns));
        quantize_block_rows(key, tensor, row_begin, row_end, bytes.data(), nullptr);
        break;
      }
      case Values::kFp8Scales: {
        std::vector<float> scales(bytes.size() / sizeof(float));
        quantize_block_rows(key, tensor, 0, tensor.rows, nullptr, scales.data());
        std::memcpy(bytes.data(), scales.data(), bytes.size());
        break;
      }
    }
    out.files[chunk.shard].write_at(chunk.file_offset, bytes.data(), bytes.size());
  });
}

/// Removes the shards of the checkpoint replaced that the new one (`index`) does not name.
void remove_old_shards(const std::vector<std::filesystem::path>& existing, const CheckpointIndex& index) {
  std::error_code error;
  for (const std::filesystem::path& old_file : existing) {
    std::string name = old_file.filename().string();
    if (name == "config.json" || name == kIndexFileName) continue;
    if (std::find(index.shards.begin(), index.shards.end(), name) != index.shards.end()) continue;
    std::filesystem::remove(old_file, error);
    WS_EXPECT(!error, ErrorCode::kIo,
              "cannot remove " + old_file.string() + ", a shard of the checkpoint replaced: " + error.message());
  }
}

}  // namespace

SynthResult synthesize_checkpoint(const std::filesystem::path& directory, const SynthOptions& options) {
  expect_valid_options(options);
  ModelConfig config = sized_config(options);
  std::vector<detail::CheckpointTensor> tensors = detail::checkpoint_tensors(config, options.dtype);
  auto shards = static_cast<size_t>(options.shards);
  WS_EXPECT(shards <= tensors.size(), ErrorCode::kInvalidArgument,
            "synth: " + std::to_string(shards) + " shards for " + std::to_string(tensors.size()) +
                " tensors: every shard must hold a tensor");

  std::vector<std::filesystem::path> existing = checkpoint_files_in(directory);
  WS_EXPECT(existing.empty() || options.replace, ErrorCode::kInvalidArgument,
            "synth: " + directory.string() + " holds a checkpoint already (" + files_text(existing) +
                "): it is replaced only when asked (SynthOptions::replace; synth --force)");

  std::error_code error;
  std::filesystem::create_directories(directory, error);
  WS_EXPECT(!error, ErrorCode::kIo, "cannot create directory " + directory.string() + ": " + error.message());

  SynthResult result;
  std::string config_text = config_json(config).dump(2) + "\n";
  result.config = parse_model_config("config.json", config_text);
  ShardedTensors sharded = shard_tensors(std::move(tensors), shards, options.seed);
  ShardFiles files = open_shard_files(directory, sharded);
  write_chunks(files, sharded);
  // Each file is written whole under a temporary name and renamed into place (a process
  // that has the old one mapped keeps its bytes). The shards come first, then the index that
  // names them and the config; the old checkpoint's shards the new one lacks go in between,
  // so the folder never holds two checkpoints' shards beside one index.
  for (detail::OutputFile& file : files.files) file.close();
  const CheckpointIndex& index = sharded.index;
  remove_old_shards(existing, index);
  detail::write_text_file(directory / std::string(kIndexFileName), index_json(index));
  detail::write_text_file(directory / "config.json", config_text);
  result.files.push_back((directory / "config.json").string());
  result.files.push_back((directory / std::string(kIndexFileName)).string());
  for (const std::string& shard : index.shards) result.files.push_back((directory / shard).string());
  result.tensors = sharded.tensor_count;
  result.bytes = *index.total_size;
  return result;
}

}  // namespace weightstream
