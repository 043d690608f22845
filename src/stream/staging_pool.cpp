#include "stream/staging_pool.hpp"

#include "weightstream/error.hpp"

namespace weightstream {

std::shared_ptr<StagingPool> StagingPool::create(size_t buffer_bytes, size_t max_buffers, HostMemory memory) {
  WS_EXPECT(buffer_bytes > 0 && max_buffers > 0, ErrorCode::kInvalidArgument, "staging pool needs at least one non-empty buffer");
  return std::shared_ptr<StagingPool>(new StagingPool(buffer_bytes, max_buffers, memory));
}

StagingPool::Lease StagingPool::take_locked() {
  std::byte* data = nullptr;
  if (!free_.empty()) {
    data = free_.back();
    free_.pop_back();
  } else if (buffers_.size() < max_buffers_) {
    buffers_.emplace_back(Device{}, buffer_bytes_, memory_);
    data = buffers_.back().data();
  } else {
    return {};
  }
  ++leased_;
  peak_leased_ = std::max(peak_leased_, leased_);
  auto self = shared_from_this();
  return {data, std::shared_ptr<const void>(data, [self](const void* pointer) {
            self->give_back(static_cast<std::byte*>(const_cast<void*>(pointer)));
          })};
}

StagingPool::Lease StagingPool::try_acquire() {
  std::lock_guard lock(mutex_);
  return take_locked();
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
