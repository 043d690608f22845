#pragma once
/// @file format.hpp
/// The format layer: safetensors headers (parse and write), the dtype table,
/// model.safetensors.index.json and the config.json fields weightstream uses.
/// Knows nothing of storage or devices: it parses bytes it is given and writes local files.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace weightstream {

/// Every dtype of the safetensors format.
enum class Dtype : uint8_t {
  kBool, kU8, kI8, kI16, kU16, kF16, kBF16, kI32, kU32, kF32, kF64, kI64, kU64, kC64,
  kF8E4M3, kF8E5M2, kF8E8M0, kF8E4M3Fnuz, kF8E5M2Fnuz, kF4, kF6E2M3, kF6E3M2,
};

/// The safetensors spelling of a dtype, e.g. "BF16", "F8_E4M3".
std::string_view dtype_name(Dtype dtype) noexcept;
/// Parses a safetensors dtype name; nullopt when unknown.
std::optional<Dtype> dtype_from_name(std::string_view name) noexcept;
/// Bits per element (1 byte BOOL = 8; F4 = 4; F6_* = 6).
unsigned dtype_bits(Dtype dtype) noexcept;
/// Byte size of a tensor of `shape`; nullopt when the element count overflows 64 bits,
/// a dimension is negative, or the bit count is not a whole number of bytes.
std::optional<uint64_t> tensor_byte_size(Dtype dtype, std::span<const int64_t> shape) noexcept;
/// Number of elements of a tensor of `shape` (1 for a scalar); nullopt when a dimension
/// is negative or the product overflows 64 bits.
std::optional<uint64_t> tensor_element_count(std::span<const int64_t> shape) noexcept;
/// "[4096, 11008]".
std::string shape_text(std::span<const int64_t> shape);

/// Most dimensions a tensor may have. The reference implementation sets no limit, but
/// numpy stops at 64 and a longer shape only serves to make a hostile header expensive.
inline constexpr size_t kMaxTensorRank = 64;

/// One tensor of a safetensors file.
struct TensorInfo {
  std::string name;
  Dtype dtype = Dtype::kU8;
  std::vector<int64_t> shape;
  /// Offsets relative to the start of the data section (after the header), as in the file.
  uint64_t data_begin = 0;
  uint64_t data_end = 0;
  uint64_t bytes() const noexcept { return data_end - data_begin; }
};

/// Largest header accepted, as in the reference implementation.
inline constexpr uint64_t kMaxHeaderLength = 100'000'000;

/// A parsed safetensors header.
struct SafetensorsHeader {
  /// Length of the JSON header in bytes (the 8-byte little-endian prefix).
  uint64_t header_length = 0;
  /// Tensors sorted by data_begin.
  std::vector<TensorInfo> tensors;
  /// The `__metadata__` string map.
  std::map<std::string, std::string> metadata;
  /// Offset of the data section in the file: 8 + header_length.
  uint64_t data_offset() const noexcept { return 8 + header_length; }
};

/// Validates the 8-byte prefix of `object` (a path or URI used in messages) of
/// `file_size` bytes and returns the header length. Throws Error(kFormat).
uint64_t parse_header_length(std::string_view object, std::span<const std::byte> prefix, uint64_t file_size);

/// Parses and validates the JSON header of `object` against every rule of the format
/// (JSON object; `__metadata__` a string map; known dtypes; non-negative shapes with
/// overflow-checked products; end - begin equal to the dtype byte size; offsets sorted,
/// contiguous, without gaps or overlaps; data ending exactly at the end of the file).
/// Throws Error(kFormat) naming the object, the tensor and the rule broken.
SafetensorsHeader parse_safetensors_header(std::string_view object, std::string_view header_json, uint64_t file_size);

/// Parses the prefix and header of a complete safetensors file held in memory (tests,
/// fuzzing, small files). Same rules and errors as parse_header_length() followed by
/// parse_safetensors_header().
SafetensorsHeader parse_safetensors_bytes(std::string_view object, std::span<const std::byte> file);

/// Name, dtype and shape of a tensor to be written.
struct TensorSpec {
  std::string name;
  Dtype dtype = Dtype::kU8;
  std::vector<int64_t> shape;
};

/// Fills `out` with bytes [offset, offset + out.size()) of tensor `index` of a streamed
/// write. Called in file order with consecutive ranges; `offset` is a multiple of 8.
using TensorFill = std::function<void(size_t index, uint64_t offset, std::span<std::byte> out)>;

/// The serialized header of a file holding `specs` in that order: the 8-byte
/// little-endian length followed by the JSON padded with spaces to a multiple of 8, as the
/// reference writer does. Throws Error(kInvalidArgument) on a duplicate or reserved name,
/// a negative dimension, or a size that is not a whole number of bytes.
std::string safetensors_header_bytes(std::span<const TensorSpec> specs,
                                     const std::map<std::string, std::string>& metadata = {});

/// Writes safetensors files. Tensors are written in the order added.
class SafetensorsWriter {
 public:
  /// Bytes asked of a TensorFill at once by write_streaming().
  static constexpr size_t kStreamChunkBytes = 4 << 20;

  /// Writes a file of `specs` without holding it in memory: the header, then each
  /// tensor's bytes in chunks of kStreamChunkBytes produced by `fill`. Throws
  /// Error(kInvalidArgument) for bad specs and Error(kIo) naming the path and the errno.
  static void write_streaming(const std::filesystem::path& path, std::span<const TensorSpec> specs,
                              const TensorFill& fill, const std::map<std::string, std::string>& metadata = {});

  /// Adds a tensor; `data` must be exactly tensor_byte_size(dtype, shape) bytes.
  void add(std::string name, Dtype dtype, std::vector<int64_t> shape, std::span<const std::byte> data);
  /// Adds a `__metadata__` entry.
  void set_metadata(std::string key, std::string value);
  /// The serialized header (8-byte prefix plus JSON padded to a multiple of 8).
  std::string header_bytes() const;
  /// Total file size that write() produces.
  uint64_t file_size() const;
  /// Writes the file. Throws Error(kIo) naming the path.
  void write(const std::filesystem::path& path) const;

 private:
  struct Entry {
    std::string name;
    Dtype dtype;
    std::vector<int64_t> shape;
    std::vector<std::byte> data;
  };
  std::vector<Entry> entries_;
  std::set<std::string, std::less<>> names_;  // to reject a duplicate at add(), not at write()
  std::map<std::string, std::string> metadata_;
};

/// model.safetensors.index.json.
struct CheckpointIndex {
  /// Tensor name to shard file name.
  std::map<std::string, std::string> weight_map;
  /// Distinct shard file names, in natural sort order.
  std::vector<std::string> shards;
  /// metadata.total_size when present.
  std::optional<uint64_t> total_size;
};

inline constexpr std::string_view kIndexFileName = "model.safetensors.index.json";

/// Parses an index file. Shard names must be plain file names (no '/', no '..', not
/// absolute, ending in .safetensors). Throws Error(kFormat) naming `object` and the rule.
CheckpointIndex parse_checkpoint_index(std::string_view object, std::string_view json);

/// Serializes an index (used by synth and tests).
std::string index_json(const CheckpointIndex& index);

/// True when `a` sorts before `b` in natural order ("model-2" < "model-10").
bool natural_less(std::string_view a, std::string_view b) noexcept;

/// The config.json fields weightstream uses (Hugging Face names).
struct ModelConfig {
  std::string model_type;  ///< "llama", "qwen3", "deepseek_v3", ...
  /// Where the config was read from (the `object` given to parse_model_config, such as
  /// s3://bucket/model/config.json); empty for a config built in code. Named by errors.
  std::string source;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;  ///< explicit head_dim, else hidden_size / num_attention_heads
  int64_t vocab_size = 0;
  bool tie_word_embeddings = false;
  std::string torch_dtype;  ///< "bfloat16", ...
  // DeepSeek-V3 (MLA attention and MoE).
  int64_t q_lora_rank = 0;  ///< 0 when absent (q_proj is a plain projection)
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  int64_t n_routed_experts = 0;
  int64_t n_shared_experts = 0;
  int64_t moe_intermediate_size = 0;
  int64_t first_k_dense_replace = 0;
  int64_t moe_layer_freq = 1;
  /// MTP layers shipped with the checkpoint; Qwen3-Next's config may call it
  /// mtp_num_hidden_layers (both given and different is an error).
  int64_t num_nextn_predict_layers = 0;
  int64_t num_experts_per_tok = 0;  ///< routed experts per token (0 when absent)
  // Qwen3-MoE style experts (num_experts) where present.
  int64_t num_experts = 0;
  // Qwen3-Next: Gated DeltaNet (linear attention) layers between full-attention layers, and
  // MoE layers with one shared expert.
  int64_t full_attention_interval = 0;  ///< every this many layers is full attention; 0 when absent
  std::vector<std::string> layer_types;  ///< per layer ("full_attention", "linear_attention"), when given
  int64_t linear_num_key_heads = 0;
  int64_t linear_num_value_heads = 0;
  int64_t linear_key_head_dim = 0;
  int64_t linear_value_head_dim = 0;
  int64_t linear_conv_kernel_dim = 0;
  int64_t shared_expert_intermediate_size = 0;
  int64_t decoder_sparse_step = 1;      ///< layer i has experts when (i + 1) % decoder_sparse_step == 0
  std::vector<int64_t> mlp_only_layers;  ///< layers with a dense MLP instead of experts
  int64_t num_local_experts = 0;  ///< Mixtral's routed experts (each of intermediate_size)
  bool attention_bias = false;    ///< GLM-4.5: q_proj, k_proj and v_proj have biases
  bool use_qk_norm = false;       ///< GLM-4.5: per-head q_norm and k_norm
  /// quantization_config, as checkpoints that ship quantized weights declare it.
  struct Quantization {
    std::string quant_method;       ///< "fp8", ...; empty when config.json has no quantization_config
    std::string fmt;                ///< "e4m3" (DeepSeek-V3 writes it; absent means e4m3)
    std::string activation_scheme;  ///< "dynamic" or "static"
    /// [block_n, block_k]: rows (output features) and columns (input features) of one scale
    /// block; empty for one scale per tensor.
    std::vector<int64_t> weight_block_size;
    /// Modules left unquantized (modules_to_not_convert, or vLLM's ignored_layers), e.g.
    /// "lm_head" or "model.layers.0.mlp.gate".
    std::vector<std::string> modules_to_not_convert;
  } quantization;
};

/// Parses config.json. Sizes are validated (positive where required, at most 2^20 for
/// dimensions and 2^16 for layer and head counts). Throws Error(kFormat) naming the field.
ModelConfig parse_model_config(std::string_view object, std::string_view json);


}  // namespace weightstream
