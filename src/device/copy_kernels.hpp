#pragma once
// Internal: the device layer's own CUDA kernels (copy_kernels.cu), built where nvcc works
// (WS_HAVE_CUDA_KERNELS). Called only from device_cuda.cpp and copier_cuda.cpp.

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

/// One rectangle of a scatter out of a landing buffer: `rows` rows of `width` bytes, source
/// rows `source_pitch` bytes apart from `source_offset` in the landing buffer, destination
/// rows `destination_pitch` bytes apart from `destination` (a contiguous run: one row).
struct ScatterWork {
  std::byte* destination;
  uint64_t source_offset;
  uint32_t width;
  uint32_t rows;
  uint32_t destination_pitch;
  uint32_t source_pitch;
};

/// The items of one scatter launch, passed by value as the kernel's parameter (no upload,
/// no device array to keep alive): within the 4 KiB every CUDA architecture takes.
constexpr size_t kScatterItemsPerLaunch = 120;
struct ScatterBatch {
  const std::byte* landing;
  uint32_t count;
  ScatterWork items[kScatterItemsPerLaunch];
};

/// Launches one kernel on `stream` that writes every item of `batch` out of its landing buffer.
cudaError_t launch_scatter_work(const ScatterBatch& batch, cudaStream_t stream);

}  // namespace weightstream::detail
