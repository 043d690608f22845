#pragma once
// XXH64 of device memory on the device: what a puller checks GPU parameters with, piece by
// piece against a peer's manifest, without reading them back to the host. Internal to the
// library (not installed), like copies.hpp; the kernel is digest_kernels.cu (the xxHash
// specification's XXH64, seed 0, equal to the host library's), device_cuda.cpp runs it,
// device_cuda_fallback.cpp refuses it.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "weightstream/device.hpp"

namespace weightstream {

/// One range of device memory hashed by xxh64_on_device().
struct DeviceDigestRange {
  const std::byte* data = nullptr;
  uint64_t bytes = 0;
};

/// True where xxh64_on_device() runs: a build with CUDA kernels.
bool device_hashes_xxh64() noexcept;

/// XXH64 (seed 0) of every range, all in memory of `device` (a GPU), one GPU thread a range:
/// ranges of a few hundred KiB keep the device busy. Returns the digests in order, once
/// computed. Throws Error(kDevice) naming the device and the CUDA error, Error(kUnsupported)
/// where device_hashes_xxh64() is false.
std::vector<uint64_t> xxh64_on_device(const Device& device, std::span<const DeviceDigestRange> ranges);

}  // namespace weightstream
