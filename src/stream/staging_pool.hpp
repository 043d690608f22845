#pragma once
// Internal: a pool of reusable, equally sized staging buffers with a hard cap on the bytes
// held at once. A lease is a shared_ptr whose deleter returns the buffer to the pool, so a
// sink that finishes with bytes later (an async device copy) just keeps its copy.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "weightstream/device.hpp"

namespace weightstream {

/// The most pinned staging memory kept between streams for the next one.
inline constexpr uint64_t kPinnedCacheBytes = uint64_t{1} << 30;

class StagingPool : public std::enable_shared_from_this<StagingPool> {
 public:
  /// A pool of at most `max_buffers` buffers of `buffer_bytes` each, allocated on demand.
  static std::shared_ptr<StagingPool> create(size_t buffer_bytes, size_t max_buffers, HostMemory memory);

  /// A leased buffer; the lease returns it to the pool when the last copy is dropped.
  struct Lease {
    std::byte* data = nullptr;
    std::shared_ptr<const void> keepalive;
  };

  /// Takes a buffer if one is free now, else returns an empty lease. Never allocates.
  Lease try_acquire();
  /// Reserves the right to allocate one more buffer (false when the cap is reached).
  /// Cheap, so callers may hold their own locks; allocate_reserved() does the slow part.
  bool try_reserve();
  /// Allocates the buffer a successful try_reserve() promised and leases it. Pinned
  /// allocations are slow (every page is faulted in and pinned), so this runs outside
  /// every lock and several readers can allocate at once.
  Lease allocate_reserved();
  /// Pinned buffers go back to a process-wide cache (at most kPinnedCacheBytes), so the
  /// next stream takes them instead of pinning anew: a reload in 8 batches streams 8 times,
  /// and pinning costs far more than reusing a buffer (bench/HISTORY.md, "Figures once in
  /// source comments").
  ~StagingPool();

  size_t buffer_bytes() const noexcept { return buffer_bytes_; }
  size_t max_buffers() const noexcept { return max_buffers_; }
  /// Most bytes leased at once so far.
  uint64_t peak_bytes() const;
  /// Bytes leased now.
  uint64_t leased_bytes() const;
  /// Called (without the pool's lock) whenever a buffer comes back.
  void set_on_release(std::function<void()> callback);

 private:
  StagingPool(size_t buffer_bytes, size_t max_buffers, HostMemory memory)
      : buffer_bytes_(buffer_bytes), max_buffers_(max_buffers), memory_(memory) {}
  Lease lease(std::byte* data);
  void give_back(std::byte* data);

  size_t buffer_bytes_;
  size_t max_buffers_;
  HostMemory memory_;
  mutable std::mutex mutex_;
  std::vector<Buffer> buffers_;      // every buffer ever allocated
  size_t reserved_ = 0;              // buffers allocated or promised
  std::vector<std::byte*> free_;     // buffers not leased
  size_t leased_ = 0;
  size_t peak_leased_ = 0;
  std::function<void()> on_release_;
};

}  // namespace weightstream
