#pragma once
// Internal to the device layer: page-aligned host allocations, shared by the CUDA build
// and its fallback (pinned memory falls back to these where no GPU can pin it).

#include <cstddef>

namespace weightstream::detail {

/// Zero-filled, page-aligned host memory of `bytes` (nullptr for 0), 2 MiB aligned from
/// 2 MiB up: an anonymous mapping, whose pages the kernel zeroes at first touch. Throws
/// Error(kDevice) naming the size when the allocation fails.
std::byte* allocate_host(size_t bytes);
/// Frees what allocate_host(bytes) returned.
void free_host(std::byte* data, size_t bytes) noexcept;

}  // namespace weightstream::detail
