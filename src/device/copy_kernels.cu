// The gather copy behind copy_within_device(): one launch copies thousands of tensors, where
// one cudaMemcpy (or one entry of cudaMemcpyBatchAsync) each costs about 10 us of driver
// time on an H200, more than copying a 1.6 MB tensor at 2 TB/s takes.
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

}  // namespace

cudaError_t launch_copy_work(const CopyWork* items, size_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>(std::min<size_t>(count, 65535));
  copy_work_items<<<blocks, kThreads, 0, stream>>>(items, count);
  return cudaGetLastError();
}

}  // namespace weightstream::detail
