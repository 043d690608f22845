#pragma once
// Internal: the XXH64 kernel behind xxh64_on_device() (digests.hpp), built where nvcc works
// (WS_HAVE_CUDA_KERNELS). Called only from device_cuda.cpp.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace weightstream::detail {

/// One range hashed (DeviceDigestRange of digests.hpp, which this C++17 file cannot include).
struct DigestWork {
  const std::byte* data;
  uint64_t bytes;
};

/// Launches one kernel on `stream` that writes the XXH64 of `ranges[i]` to `digests[i]`;
/// both arrays are in device memory.
cudaError_t launch_xxh64(const DigestWork* ranges, uint64_t* digests, size_t count, cudaStream_t stream);

}  // namespace weightstream::detail
