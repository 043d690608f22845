#pragma once
// Internal: the FP8 block quantization kernel (quantize_kernels.cu), built where nvcc works
// (WS_HAVE_CUDA_KERNELS). Called only from copier_cuda.cpp.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace weightstream::detail {

/// Element types the kernel reads.
enum class QuantizeElement : uint8_t { kBF16, kF16, kF32 };

/// One matrix quantized block by block (e4m3_rule.hpp): `rows` x `columns` values at
/// `source`, rows `source_pitch` bytes apart; codes compact (`columns` a row), scales compact
/// (ceil(rows / block_rows) x ceil(columns / block_columns)). All in device memory.
struct E4m3BlockWork {
  const std::byte* source;
  uint64_t source_pitch;
  QuantizeElement element;
  uint64_t rows, columns;
  uint32_t block_rows, block_columns;
  uint8_t* codes;
  float* scales;
};

/// Launches the kernel on `stream` for every job of `works` (host memory): one thread block
/// per quantization block, up to 44 jobs of one element type a launch, so that thousands of
/// experts cost tens of launches, not thousands.
cudaError_t launch_e4m3_blocks(const E4m3BlockWork* works, size_t count, cudaStream_t stream);

}  // namespace weightstream::detail
