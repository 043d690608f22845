// FP8 E4M3 block quantization on the device, for a BF16 (F16, F32) update pushed into an FP8
// block-scaled model's parameters: on the host it ran at 0.17 GB/s, one part at a time on the
// receiver's thread. One thread block takes one quantization block (128 x 128 in the
// checkpoints we load): its threads find the block's amax by a reduction, one writes the
// scale, all write the codes. Every value goes through e4m3_rule.hpp, the rule the CPU tests
// hold against the host quantizer; this file only arranges the work.
#include <algorithm>

#include "device/e4m3_rule.hpp"
#include "device/quantize_kernels.hpp"

namespace weightstream::detail {
namespace {

constexpr unsigned kThreads = 256;
constexpr unsigned kWarps = kThreads / 32;

template <QuantizeElement kElement>
__device__ float load_value(const std::byte* row, uint64_t column) {
  if constexpr (kElement == QuantizeElement::kF32) {
    return reinterpret_cast<const float*>(row)[column];
  } else if constexpr (kElement == QuantizeElement::kBF16) {
    return bf16_value(reinterpret_cast<const uint16_t*>(row)[column]);
  } else {
    return f16_value(reinterpret_cast<const uint16_t*>(row)[column]);
  }
}

/// The block's amax, in every thread: per-thread maxima, then a warp and a block reduction,
/// all with amax_with (exact and order-free, so equal to the host's sequential maximum).
__device__ float block_amax(float amax, float* partials) {
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (unsigned offset = 16; offset > 0; offset /= 2) amax = amax_with(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
  if (lane == 0) partials[warp] = amax;
  __syncthreads();
  amax = lane < kWarps ? partials[lane] : 0.0f;
  for (unsigned offset = 16; offset > 0; offset /= 2) amax = amax_with(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
  return amax;
}

template <QuantizeElement kElement>
__global__ void __launch_bounds__(kThreads) quantize_e4m3_blocks(E4m3BlockWork work, uint64_t grid_columns,
                                                                 uint64_t blocks) {
  __shared__ float partials[kWarps];
  for (uint64_t block = blockIdx.x; block < blocks; block += gridDim.x) {
    const uint64_t block_row = block / grid_columns, block_column = block % grid_columns;
    const uint64_t row0 = block_row * work.block_rows, column0 = block_column * work.block_columns;
    // Edge blocks are partial; sizes fit 32 bits (at most block_rows x block_columns).
    const auto rows = static_cast<uint32_t>(work.rows - row0 < work.block_rows ? work.rows - row0 : work.block_rows);
    const auto columns =
        static_cast<uint32_t>(work.columns - column0 < work.block_columns ? work.columns - column0 : work.block_columns);
    const uint32_t count = rows * columns;
    const std::byte* source = work.source + row0 * work.source_pitch;
    float amax = 0.0f;
    for (uint32_t i = threadIdx.x; i < count; i += kThreads) {
      const uint32_t r = i / columns, c = i % columns;
      amax = amax_with(amax, load_value<kElement>(source + r * work.source_pitch, column0 + c));
    }
    const float scale = e4m3_block_scale(block_amax(amax, partials));
    if (threadIdx.x == 0) work.scales[block] = scale;
    // The second read of the block is served by L1/L2: a block is 32 KiB of BF16.
    for (uint32_t i = threadIdx.x; i < count; i += kThreads) {
      const uint32_t r = i / columns, c = i % columns;
      const float value = load_value<kElement>(source + r * work.source_pitch, column0 + c);
      work.codes[(row0 + r) * work.columns + column0 + c] = e4m3_block_code(value, scale);
    }
    __syncthreads();  // partials are reused by the next block of this thread block
  }
}

}  // namespace

cudaError_t launch_e4m3_blocks(const E4m3BlockWork& work, cudaStream_t stream) {
  if (work.rows == 0 || work.columns == 0) return cudaSuccess;
  if (work.block_rows == 0 || work.block_columns == 0) return cudaErrorInvalidValue;
  const uint64_t grid_rows = (work.rows + work.block_rows - 1) / work.block_rows;
  const uint64_t grid_columns = (work.columns + work.block_columns - 1) / work.block_columns;
  const uint64_t blocks = grid_rows * grid_columns;
  const auto grid = static_cast<unsigned>(std::min<uint64_t>(blocks, 1u << 20));
  switch (work.element) {
    case QuantizeElement::kBF16:
      quantize_e4m3_blocks<QuantizeElement::kBF16><<<grid, kThreads, 0, stream>>>(work, grid_columns, blocks);
      break;
    case QuantizeElement::kF16:
      quantize_e4m3_blocks<QuantizeElement::kF16><<<grid, kThreads, 0, stream>>>(work, grid_columns, blocks);
      break;
    case QuantizeElement::kF32:
      quantize_e4m3_blocks<QuantizeElement::kF32><<<grid, kThreads, 0, stream>>>(work, grid_columns, blocks);
      break;
  }
  return cudaGetLastError();
}

}  // namespace weightstream::detail
