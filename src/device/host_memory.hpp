#pragma once
// Internal to the device layer: page-aligned host allocations, shared by the CUDA build
// and its fallback (pinned memory falls back to these where no GPU can pin it).

#include <cstddef>

namespace weightstream::detail {

/// Page-aligned host memory of `bytes` (nullptr for 0). Throws Error(kDevice) naming the
/// size when the allocation fails.
std::byte* allocate_host(size_t bytes);
/// Frees what allocate_host returned.
void free_host(std::byte* data) noexcept;

}  // namespace weightstream::detail
