#pragma once
// The tensors of a checkpoint of a supported architecture, expanded from its mapping
// table, with what synth writes into each: the model layer's internal interface between
// the tables (architectures.cpp) and the synthetic checkpoint writer (synth.cpp).

#include <string>
#include <vector>

#include "weightstream/model.hpp"
#include "weightstream/synth.hpp"

namespace weightstream::detail {

/// One checkpoint tensor and how its values are made.
struct CheckpointTensor {
  TensorSpec spec;
  enum class Values {
    kRandom,     ///< pseudo-random values of spec.dtype from (seed, name, offset)
    kFp8Codes,   ///< E4M3 codes of the random BF16 values of `spec.name`, per block
    kFp8Scales,  ///< the F32 block scales (amax / 448) of the random BF16 values of `source`
  } values = Values::kRandom;
  std::string source;  ///< the quantized weight (for kFp8Codes and kFp8Scales)
  int64_t rows = 0, columns = 0;  ///< the weight's two-dimensional view
  int64_t block_n = 0, block_k = 0;
};

/// Every tensor of a Hugging Face checkpoint of `config` with weights in `dtype`, in file
/// order (see checkpoint_tensor_specs). Throws Error(kInvalidArgument) for an unsupported model_type.
std::vector<CheckpointTensor> checkpoint_tensors(const ModelConfig& config, Dtype dtype);

}  // namespace weightstream::detail
