#include "stream/staging_pool.hpp"

#include <mutex>
#include <optional>

#include "weightstream/error.hpp"

namespace weightstream {
namespace {

/// Pinned buffers kept between streams. Never destroyed (a leaked singleton): unpinning at
/// static destruction could run after the CUDA runtime has shut down.
struct PinnedCache {
  std::mutex mutex;
  std::vector<Buffer> buffers;
  uint64_t bytes = 0;

  static PinnedCache& instance() {
    static auto* cache = new PinnedCache;
    return *cache;
  }
  std::optional<Buffer> take(size_t size) {
    std::lock_guard lock(mutex);
    for (size_t i = 0; i < buffers.size(); ++i) {
      if (buffers[i].size() != size) continue;
      Buffer buffer = std::move(buffers[i]);
      buffers.erase(buffers.begin() + static_cast<ptrdiff_t>(i));
      bytes -= size;
      return buffer;
    }
    return std::nullopt;
  }
  void give(Buffer&& buffer) {
    std::lock_guard lock(mutex);
    if (!buffer.pinned() || bytes + buffer.size() > kPinnedCacheBytes) return;  // freed by the caller
    bytes += buffer.size();
    buffers.push_back(std::move(buffer));
  }
};

}  // namespace

std::shared_ptr<StagingPool> StagingPool::create(size_t buffer_bytes, size_t max_buffers, HostMemory memory) {
  WS_EXPECT(buffer_bytes > 0 && max_buffers > 0, ErrorCode::kInvalidArgument, "staging pool needs at least one non-empty buffer");
  return std::shared_ptr<StagingPool>(new StagingPool(buffer_bytes, max_buffers, memory));
}

StagingPool::Lease StagingPool::lease(std::byte* data) {
  auto self = shared_from_this();
  return {data, std::shared_ptr<const void>(data, [self](const void* pointer) {
            self->give_back(static_cast<std::byte*>(const_cast<void*>(pointer)));
          })};
}

StagingPool::Lease StagingPool::try_acquire() {
  std::byte* data = nullptr;
  {
    std::lock_guard lock(mutex_);
    if (free_.empty()) return {};
    data = free_.back();
    free_.pop_back();
    ++leased_;
    peak_leased_ = std::max(peak_leased_, leased_);
  }
  return lease(data);
}

bool StagingPool::try_reserve() {
  std::lock_guard lock(mutex_);
  if (reserved_ >= max_buffers_) return false;
  ++reserved_;
  ++leased_;
  peak_leased_ = std::max(peak_leased_, leased_);
  return true;
}

StagingPool::Lease StagingPool::allocate_reserved() {
  Buffer buffer;
  try {
    std::optional<Buffer> cached;
    if (memory_ == HostMemory::kPinned) cached = PinnedCache::instance().take(buffer_bytes_);
    buffer = cached ? std::move(*cached) : Buffer(Device{}, buffer_bytes_, memory_);
  } catch (...) {
    std::lock_guard lock(mutex_);
    --reserved_;
    --leased_;
    throw;
  }
  std::byte* data = buffer.data();
  {
    std::lock_guard lock(mutex_);
    buffers_.push_back(std::move(buffer));
  }
  return lease(data);
}

StagingPool::~StagingPool() {
  if (memory_ != HostMemory::kPinned) return;
  for (Buffer& buffer : buffers_) PinnedCache::instance().give(std::move(buffer));
}

void StagingPool::give_back(std::byte* data) {
  std::function<void()> callback;
  {
    std::lock_guard lock(mutex_);
    free_.push_back(data);
    --leased_;
    callback = on_release_;
  }
  if (callback) callback();
}

void StagingPool::set_on_release(std::function<void()> callback) {
  std::lock_guard lock(mutex_);
  on_release_ = std::move(callback);
}

uint64_t StagingPool::peak_bytes() const {
  std::lock_guard lock(mutex_);
  return static_cast<uint64_t>(peak_leased_) * buffer_bytes_;
}

uint64_t StagingPool::leased_bytes() const {
  std::lock_guard lock(mutex_);
  return static_cast<uint64_t>(leased_) * buffer_bytes_;
}

}  // namespace weightstream
