// FP8 E4M3 block quantization on the device, for a BF16 (F16, F32) update pushed into an FP8
// block-scaled model's parameters, so that the update's bytes never come back to the host to
// be quantized there one part at a time (bench/RESULTS.md has the rates). One thread block takes one quantization block (128 x 128 in the
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
__device__ float decode(uint32_t raw) {
  if constexpr (kElement == QuantizeElement::kF32) {
    return float_of(raw);
  } else if constexpr (kElement == QuantizeElement::kBF16) {
    return bf16_value(static_cast<uint16_t>(raw));
  } else {
    return f16_value(static_cast<uint16_t>(raw));
  }
}

/// Values a thread takes at once: one, or 16 bytes of them (8 BF16 or F16, 4 F32) where rows
/// and blocks are aligned to that (launch_e4m3_blocks decides).
template <QuantizeElement kElement, bool kWide>
constexpr unsigned kStep = kWide ? (kElement == QuantizeElement::kF32 ? 4 : 8) : 1;

/// The kStep values at `address` (aligned to their size).
template <QuantizeElement kElement, bool kWide>
__device__ void load_values(const std::byte* address, float (&values)[kStep<kElement, kWide>]) {
  if constexpr (!kWide) {
    if constexpr (kElement == QuantizeElement::kF32) {
      values[0] = *reinterpret_cast<const float*>(address);
    } else {
      values[0] = decode<kElement>(*reinterpret_cast<const uint16_t*>(address));
    }
  } else {
    const uint4 raw = *reinterpret_cast<const uint4*>(address);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (unsigned k = 0; k < 4; ++k) {
      if constexpr (kElement == QuantizeElement::kF32) {
        values[k] = float_of(words[k]);
      } else {
        // Little endian: the lower half of a word is the earlier element.
        values[2 * k] = decode<kElement>(words[k] & 0xFFFFu);
        values[2 * k + 1] = decode<kElement>(words[k] >> 16);
      }
    }
  }
}

/// Stores kStep codes at `address` (aligned to kStep bytes) in one store.
template <unsigned kCount>
__device__ void store_codes(uint8_t* address, const uint8_t (&codes)[kCount]) {
  if constexpr (kCount == 1) {
    *address = codes[0];
  } else {
    uint32_t words[kCount / 4];
#pragma unroll
    for (unsigned w = 0; w < kCount / 4; ++w) {
      words[w] = codes[4 * w] | (codes[4 * w + 1] << 8) | (codes[4 * w + 2] << 16) |
                 (static_cast<uint32_t>(codes[4 * w + 3]) << 24);
    }
    if constexpr (kCount == 8) {
      *reinterpret_cast<uint2*>(address) = make_uint2(words[0], words[1]);
    } else {
      *reinterpret_cast<uint32_t*>(address) = words[0];
    }
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

/// Quantizes block `block` (row-major over the job's grid of blocks, `grid_columns` wide) of
/// `work`, with all threads of the thread block.
template <QuantizeElement kElement, bool kWide>
__device__ void quantize_block(const E4m3BlockWork& work, uint64_t grid_columns, uint64_t block, float* partials) {
  constexpr unsigned step = kStep<kElement, kWide>;
  constexpr uint64_t element = kElement == QuantizeElement::kF32 ? 4 : 2;
  const uint64_t block_row = block / grid_columns, block_column = block % grid_columns;
  const uint64_t row0 = block_row * work.block_rows, column0 = block_column * work.block_columns;
  // Edge blocks are partial; sizes fit 32 bits (at most block_rows x block_columns). With
  // kWide, columns is a multiple of `step` (the launch checked).
  const auto rows = static_cast<uint32_t>(work.rows - row0 < work.block_rows ? work.rows - row0 : work.block_rows);
  const auto columns =
      static_cast<uint32_t>(work.columns - column0 < work.block_columns ? work.columns - column0 : work.block_columns);
  const uint32_t groups = columns / step;  // of `step` values in a row
  const uint32_t count = rows * groups;
  const std::byte* source = work.source + row0 * work.source_pitch + column0 * element;
  float amax = 0.0f;
  for (uint32_t i = threadIdx.x; i < count; i += kThreads) {
    const uint32_t r = i / groups, g = i % groups;
    float values[step];
    load_values<kElement, kWide>(source + r * work.source_pitch + g * step * element, values);
#pragma unroll
    for (unsigned k = 0; k < step; ++k) amax = amax_with(amax, values[k]);
  }
  const float scale = e4m3_block_scale(block_amax(amax, partials));
  if (threadIdx.x == 0) work.scales[block] = scale;
  // The second read of the block is served by L1/L2: a block is 32 KiB of BF16.
  for (uint32_t i = threadIdx.x; i < count; i += kThreads) {
    const uint32_t r = i / groups, g = i % groups;
    float values[step];
    load_values<kElement, kWide>(source + r * work.source_pitch + g * step * element, values);
    uint8_t codes[step];
#pragma unroll
    for (unsigned k = 0; k < step; ++k) codes[k] = e4m3_block_code(values[k], scale);
    store_codes(work.codes + (row0 + r) * work.columns + column0 + g * step, codes);
  }
  __syncthreads();  // partials are reused by the next block of this thread block
}

/// The jobs of one launch, of one element type and width, passed by value as the kernel's
/// parameter (within the 4 KiB every architecture takes): job j holds blocks
/// [first_block[j], first_block[j + 1]) of the launch.
constexpr unsigned kJobsPerLaunch = 44;
struct E4m3Launch {
  uint32_t count;
  uint64_t first_block[kJobsPerLaunch + 1];
  uint64_t grid_columns[kJobsPerLaunch];
  E4m3BlockWork jobs[kJobsPerLaunch];
};
static_assert(sizeof(E4m3Launch) <= 4000, "a launch's jobs must fit the kernel parameter space");

template <QuantizeElement kElement, bool kWide>
__global__ void __launch_bounds__(kThreads) quantize_e4m3_launch(const __grid_constant__ E4m3Launch launch) {
  __shared__ float partials[kWarps];
  const uint64_t blocks = launch.first_block[launch.count];
  uint32_t job = 0;
  for (uint64_t block = blockIdx.x; block < blocks; block += gridDim.x) {
    while (block >= launch.first_block[job + 1]) ++job;  // blocks only grow
    quantize_block<kElement, kWide>(launch.jobs[job], launch.grid_columns[job], block - launch.first_block[job],
                                    partials);
  }
}

/// Whether `work` takes 16-byte loads: every row of every block starts 16-byte aligned and
/// holds whole groups, and the codes' groups are aligned for their one store (2-byte loads
/// reach a fraction of the bandwidth).
bool wide_loads(const E4m3BlockWork& work) {
  const uint64_t element = work.element == QuantizeElement::kF32 ? 4 : 2;
  const unsigned step = work.element == QuantizeElement::kF32 ? 4 : 8;
  return reinterpret_cast<uintptr_t>(work.source) % 16 == 0 && work.source_pitch % 16 == 0 &&
         (work.block_columns * element) % 16 == 0 && work.columns % step == 0 &&
         reinterpret_cast<uintptr_t>(work.codes) % step == 0;
}

template <QuantizeElement kElement, bool kWide>
cudaError_t launch_jobs(const E4m3Launch& launch, cudaStream_t stream) {
  const auto grid = static_cast<unsigned>(std::min<uint64_t>(launch.first_block[launch.count], 1u << 20));
  quantize_e4m3_launch<kElement, kWide><<<grid, kThreads, 0, stream>>>(launch);
  return cudaGetLastError();
}

cudaError_t launch_jobs(const E4m3Launch& launch, QuantizeElement element, bool wide, cudaStream_t stream) {
  switch (element) {
    case QuantizeElement::kBF16:
      return wide ? launch_jobs<QuantizeElement::kBF16, true>(launch, stream)
                  : launch_jobs<QuantizeElement::kBF16, false>(launch, stream);
    case QuantizeElement::kF16:
      return wide ? launch_jobs<QuantizeElement::kF16, true>(launch, stream)
                  : launch_jobs<QuantizeElement::kF16, false>(launch, stream);
    case QuantizeElement::kF32:
      return wide ? launch_jobs<QuantizeElement::kF32, true>(launch, stream)
                  : launch_jobs<QuantizeElement::kF32, false>(launch, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_e4m3_blocks(const E4m3BlockWork* works, size_t count, cudaStream_t stream) {
  // Jobs of one element type and width share a launch, up to kJobsPerLaunch of them.
  for (QuantizeElement element : {QuantizeElement::kBF16, QuantizeElement::kF16, QuantizeElement::kF32}) {
    for (bool wide : {true, false}) {
      E4m3Launch launch{};
      auto flush = [&]() -> cudaError_t {
        if (launch.count == 0) return cudaSuccess;
        cudaError_t error = launch_jobs(launch, element, wide, stream);
        launch.count = 0;
        return error;
      };
      for (size_t i = 0; i < count; ++i) {
        const E4m3BlockWork& work = works[i];
        if (work.element != element || wide_loads(work) != wide || work.rows == 0 || work.columns == 0) continue;
        if (work.block_rows == 0 || work.block_columns == 0) return cudaErrorInvalidValue;
        const uint64_t grid_rows = (work.rows + work.block_rows - 1) / work.block_rows;
        const uint64_t grid_columns = (work.columns + work.block_columns - 1) / work.block_columns;
        launch.jobs[launch.count] = work;
        launch.grid_columns[launch.count] = grid_columns;
        launch.first_block[launch.count + 1] = launch.first_block[launch.count] + grid_rows * grid_columns;
        if (++launch.count == kJobsPerLaunch) {
          if (cudaError_t error = flush(); error != cudaSuccess) return error;
        }
      }
      if (cudaError_t error = flush(); error != cudaSuccess) return error;
    }
  }
  return cudaSuccess;
}

}  // namespace weightstream::detail
