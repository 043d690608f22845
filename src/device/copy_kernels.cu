// The gather copy behind copy_within_device(): one launch copies thousands of tensors, where
// one cudaMemcpy (or one entry of cudaMemcpyBatchAsync) each costs more driver time than
// copying a small tensor takes (bench/HISTORY.md, "Figures once in source comments"). The
// scatter behind land_and_scatter(): a read's small tensors and narrow column windows
// written out of the one copy that landed them.
#include <algorithm>

#include "device/copy_kernels.hpp"

namespace weightstream::detail {
namespace {

constexpr unsigned kThreads = 512;
constexpr unsigned kUnroll = 4;  // 16-byte words in flight per thread per step

__global__ void copy_work_items(const CopyWork* items, size_t count) {
  for (size_t index = blockIdx.x; index < count; index += gridDim.x) {
    const CopyWork item = items[index];
    const auto destination_address = reinterpret_cast<uintptr_t>(item.destination);
    const auto source_address = reinterpret_cast<uintptr_t>(item.source);
    uint64_t vector_bytes = 0;
    if (((destination_address | source_address) & 15) == 0) {
      const uint64_t words = item.bytes / 16;
      const auto* from = reinterpret_cast<const uint4*>(item.source);
      auto* to = reinterpret_cast<uint4*>(item.destination);
      uint64_t word = threadIdx.x;
      for (; word + (kUnroll - 1) * kThreads < words; word += kUnroll * kThreads) {
        uint4 values[kUnroll];
#pragma unroll
        for (unsigned k = 0; k < kUnroll; ++k) values[k] = from[word + k * kThreads];
#pragma unroll
        for (unsigned k = 0; k < kUnroll; ++k) to[word + k * kThreads] = values[k];
      }
      for (; word < words; word += kThreads) to[word] = from[word];
      vector_bytes = words * 16;
    }
    for (uint64_t byte = vector_bytes + threadIdx.x; byte < item.bytes; byte += kThreads) {
      item.destination[byte] = item.source[byte];
    }
  }
}

constexpr unsigned kScatterThreads = 256;
/// Bytes one block of a scatter launch takes of its item (a grid-stride loop covers the rest).
constexpr uint64_t kScatterBlockBytes = 64 * 1024;
constexpr unsigned kMostScatterBlocksPerItem = 64;

/// Copies the item's rows in words of `Word`: the widest that every address, width and
/// pitch of it is a multiple of.
template <typename Word>
__device__ void scatter_rows(const ScatterWork& item, const std::byte* source) {
  const uint64_t row_words = item.width / sizeof(Word), words = row_words * item.rows;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t word = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; word < words; word += stride) {
    const uint64_t row = word / row_words, column = (word - row * row_words) * sizeof(Word);
    *reinterpret_cast<Word*>(item.destination + row * item.destination_pitch + column) =
        *reinterpret_cast<const Word*>(source + row * item.source_pitch + column);
  }
}

__global__ void scatter_work_items(const __grid_constant__ ScatterBatch batch) {
  const ScatterWork& item = batch.items[blockIdx.y];
  const std::byte* source = batch.landing + item.source_offset;
  const uint64_t alignment = reinterpret_cast<uintptr_t>(item.destination) | reinterpret_cast<uintptr_t>(source) |
                             item.width | item.destination_pitch | item.source_pitch;
  if (alignment % 16 == 0) return scatter_rows<uint4>(item, source);
  if (alignment % 8 == 0) return scatter_rows<uint2>(item, source);
  if (alignment % 4 == 0) return scatter_rows<uint32_t>(item, source);
  if (alignment % 2 == 0) return scatter_rows<uint16_t>(item, source);
  scatter_rows<uint8_t>(item, source);
}

}  // namespace

cudaError_t launch_scatter_work(const ScatterBatch& batch, cudaStream_t stream) {
  if (batch.count == 0) return cudaSuccess;
  uint64_t largest = 0;
  for (uint32_t i = 0; i < batch.count; ++i) {
    largest = std::max<uint64_t>(largest, static_cast<uint64_t>(batch.items[i].width) * batch.items[i].rows);
  }
  const auto blocks = static_cast<unsigned>(
      std::clamp<uint64_t>((largest + kScatterBlockBytes - 1) / kScatterBlockBytes, 1, kMostScatterBlocksPerItem));
  scatter_work_items<<<dim3(blocks, batch.count), kScatterThreads, 0, stream>>>(batch);
  return cudaGetLastError();
}

cudaError_t launch_copy_work(const CopyWork* items, size_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>(std::min<size_t>(count, 65535));
  copy_work_items<<<blocks, kThreads, 0, stream>>>(items, count);
  return cudaGetLastError();
}

}  // namespace weightstream::detail
