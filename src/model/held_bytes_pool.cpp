#include "model/held_bytes_pool.hpp"

#include <algorithm>

#include "weightstream/error.hpp"

namespace weightstream::model {

std::shared_ptr<std::byte> HeldBytesPool::take(uint64_t bytes) {
  const uint64_t capacity = (std::max<uint64_t>(bytes, 1) + kGranule - 1) / kGranule * kGranule;
  std::shared_ptr<Block> buffer;
  {
    std::lock_guard lock(mutex_);
    // The smallest free buffer that fits, unless it is much larger than the piece.
    auto found = free_.lower_bound(capacity);
    if (found != free_.end() && found->first <= 2 * capacity) {
      buffer = std::move(found->second);
      free_bytes_ -= found->first;
      free_.erase(found);
    } else if (device_.is_cuda() && in_use_bytes_ + free_bytes_ + capacity > most_bytes_) {
      return nullptr;
    }
    in_use_bytes_ += buffer ? buffer->size : capacity;
    peak_in_use_bytes_ = std::max(peak_in_use_bytes_, in_use_bytes_);
  }
  if (!buffer) buffer = allocate(capacity);
  if (!buffer) return nullptr;
  std::byte* data = buffer->data();
  return std::shared_ptr<std::byte>(data, [pool = shared_from_this(), buffer](std::byte*) { pool->give_back(buffer); });
}

void HeldBytesPool::release() {
  std::lock_guard lock(mutex_);
  free_.clear();
  free_bytes_ = 0;
  peak_in_use_bytes_ = in_use_bytes_;
}

std::shared_ptr<HeldBytesPool::Block> HeldBytesPool::allocate(uint64_t capacity) {
  auto block = std::make_shared<Block>();
  block->size = capacity;
  try {
    // Host: malloc's memory, not the device layer's mapped host buffers: those ask for
    // transparent huge pages, whose first faults stall here.
    if (device_.is_cuda()) {
      block->device = Buffer(device_, capacity);
    } else {
      block->host.reset(new std::byte[capacity]);
    }
    return block;
  } catch (const Error& error) {
    std::lock_guard lock(mutex_);
    in_use_bytes_ -= capacity;
    if (!device_.is_cuda() || error.code() != ErrorCode::kDevice) throw;
    most_bytes_ = 0;
    return nullptr;
  } catch (...) {
    std::lock_guard lock(mutex_);
    in_use_bytes_ -= capacity;
    throw;
  }
}

void HeldBytesPool::give_back(const std::shared_ptr<Block>& buffer) {
  std::lock_guard lock(mutex_);
  in_use_bytes_ -= buffer->size;
  if (free_bytes_ + buffer->size > peak_in_use_bytes_) return;  // freed with its last reference
  free_bytes_ += buffer->size;
  free_.emplace(buffer->size, buffer);
}

}  // namespace weightstream::model
