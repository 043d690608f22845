#pragma once
/// @file synth.hpp
/// Synthetic checkpoints (`weightstream synth`): config.json, index and shards named and
/// shaped like the Hugging Face checkpoints of a supported architecture, expanded from the
/// same mapping tables the layouts use (architectures.hpp), with weights from a seed.

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "weightstream/format.hpp"

namespace weightstream {

/// Options of the synthetic checkpoint generator (`weightstream synth`).
struct SynthOptions {
  std::string arch = "llama";  ///< a supported model_type (architectures()): llama, qwen3, qwen3_moe, mixtral, ...
  int64_t layers = 2;   ///< decoder layers (num_hidden_layers), 1 to 65536
  int64_t hidden = 256; ///< hidden_size, a multiple of 32 from 64 to 65536
  int64_t shards = 2;   ///< shard files, 1 to 99999 and at most the number of tensors
  uint64_t seed = 0;
  Dtype dtype = Dtype::kBF16;  ///< dtype of the weights (the DeepSeek router bias stays F32)
  /// When set, scale the model to about this many bytes (`layers` is then ignored): layers
  /// grow, and hidden doubles (up to 16384) while more than kSynthMaxScaledLayers layers
  /// would be needed. A target below the one-layer model (at `hidden`) throws
  /// Error(kInvalidArgument) naming the smallest size that can be met.
  std::optional<uint64_t> target_bytes;
  int64_t vocab = 4096;  ///< vocab_size
  bool tie_word_embeddings = false;  ///< llama and qwen3: omit lm_head.weight
  /// Quantized weights as checkpoints ship them: kFp8Block writes every quantized linear
  /// weight as F8_E4M3 codes of its random BF16 values with an F32 X.weight_scale_inv per
  /// 128 x 128 block (amax / 448), and quantization_config {"quant_method": "fp8", "fmt":
  /// "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}.
  enum class Quantization { kNone, kFp8Block } quantize = Quantization::kNone;
  /// The shapes of the FP8 block-scaled model (heads of 128, inner sizes multiples of 512, so
  /// that up to 4 ranks hold whole 128 x 128 blocks) with unquantized weights: the BF16
  /// checkpoint a trainer pushes into an FP8 model of the same options. Implied by kFp8Block.
  bool block_aligned = false;
  // MoE families only (deepseek_v3, kimi_k2, glm4_moe, qwen3_moe, qwen3_next, mixtral).
  int64_t experts = 8;             ///< routed experts (n_routed_experts, num_experts or num_local_experts)
  int64_t shared_experts = 1;      ///< n_shared_experts (qwen3_next: one shared expert when above 0; qwen3_moe, mixtral: none)
  int64_t experts_per_token = 2;   ///< num_experts_per_tok (qwen3_next too)
  int64_t first_dense_layers = 1;  ///< first_k_dense_replace (qwen3_moe: mlp_only_layers 0..n-1; capped at layers)
  int64_t mtp_layers = 1;          ///< num_nextn_predict_layers (deepseek_v3, kimi_k2, glm4_moe, qwen3_next)
  /// A folder that holds a checkpoint already (config.json, the index or *.safetensors):
  /// false, it is refused (Error(kInvalidArgument) naming its files); true, it is replaced,
  /// and its shards the new checkpoint does not have are removed.
  bool replace = false;
};

/// Most layers target_bytes grows a synthetic model to before it widens hidden instead.
inline constexpr int64_t kSynthMaxScaledLayers = 256;

/// Summary of a synthesized checkpoint.
struct SynthResult {
  uint64_t tensors = 0;  ///< tensors written
  uint64_t bytes = 0;    ///< tensor bytes written (metadata.total_size of the index)
  /// Paths of the files written: config.json, the index, then the shards in order.
  std::vector<std::string> files;
  ModelConfig config;  ///< the config written, as parse_model_config() reads it back
};

/// Names, dtypes and shapes of the tensors of a Hugging Face checkpoint of `config` (a
/// supported model_type), expanded from the architecture's mapping table, with weights in
/// `dtype` (F8_E4M3 plus F32 X.weight_scale_inv for quantized linear weights when the
/// config is FP8 block-quantized), in file order: the embedding, the decoder layers, the
/// final norm and lm_head, then the MTP layers. Throws Error(kInvalidArgument) for another model_type.
std::vector<TensorSpec> checkpoint_tensor_specs(const ModelConfig& config, Dtype dtype);

/// Writes config.json, model.safetensors.index.json and shards named and shaped like the
/// Hugging Face checkpoints of `options.arch`, with pseudo-random weights from the seed.
/// Each file is written under a temporary name, flushed and renamed into place: the shards
/// first, then the index, then config.json (see SynthOptions::replace for a folder that
/// holds a checkpoint already).
/// deepseek_v3 includes routed and shared MoE experts and num_nextn_predict_layers MTP
/// layers named model.layers.{num_hidden_layers+i}.*; qwen3_next has Gated DeltaNet layers
/// with a full-attention layer every full_attention_interval (4, or the layer count when
/// smaller), MoE layers with one shared expert, and its MTP module under mtp.* (mtp.fc,
/// mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.layers.{i}.*, mtp.norm) after
/// every other tensor.
SynthResult synthesize_checkpoint(const std::filesystem::path& directory, const SynthOptions& options);

}  // namespace weightstream
