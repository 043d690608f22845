#pragma once
// Internal: the device layer's own CUDA kernels (copy_kernels.cu), built where nvcc works
// (WS_HAVE_CUDA_KERNELS). Called only from device_cuda.cpp.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace weightstream::detail {

/// One piece of a device-to-device copy; copy_within_device() splits ranges into pieces of
/// at most kCopyWorkBytes so that one large tensor spreads over many blocks.
struct CopyWork {
  std::byte* destination;
  const std::byte* source;
  uint64_t bytes;
};
constexpr uint64_t kCopyWorkBytes = 1ull << 20;

/// Launches one kernel on `stream` that copies every item; `items` is in device memory.
cudaError_t launch_copy_work(const CopyWork* items, size_t count, cudaStream_t stream);

}  // namespace weightstream::detail
