#pragma once
// The memory a LoadSession holds pieces of incomplete layers in (whole-layer commits).

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "weightstream/device.hpp"

namespace weightstream::model {

/// Memory for held pieces, reused within a load: host memory, or a GPU's when the pieces go
/// to that GPU. A held piece's copy in fresh host memory costs more than the copy itself: the
/// kernel faults in and zero-fills every page first, and a pushed update holds most of its
/// bytes (bench/HISTORY.md, "Held pieces"). On a GPU, a piece held in host memory would later
/// cross from pageable memory at a fraction of the link's rate: held in the GPU's memory it
/// crosses once from the pinned staging at the link's rate and lands by a device-to-device
/// copy. Memory comes back when its last holder lets go; free memory is kept up to the most
/// ever in use at once, so the pool stays within twice the peak of held bytes, and release()
/// gives it all back when the load ends.
/// A GPU's pool holds at most `most_bytes` in use: take() then gives nothing, and the piece
/// is held in host memory. (The stream's StagingPool does not fit: its buffers are of one
/// size and capped, and a held piece may neither wait nor be refused.)
class HeldBytesPool : public std::enable_shared_from_this<HeldBytesPool> {
 public:
  HeldBytesPool() = default;
  HeldBytesPool(Device device, uint64_t most_bytes) : device_(std::move(device)), most_bytes_(most_bytes) {}

  const Device& device() const noexcept { return device_; }

  /// `bytes` of the pool's memory, unwritten (or holding an earlier piece's bytes); null when
  /// a GPU's pool would go past its bound.
  std::shared_ptr<std::byte> take(uint64_t bytes);

  /// Frees the memory no piece holds now.
  void release();

 private:
  static constexpr uint64_t kGranule = 64 * 1024;
  struct Block {
    std::unique_ptr<std::byte[]> host;
    Buffer device;
    uint64_t size = 0;
    std::byte* data() const { return host ? host.get() : device.data(); }
  };

  /// A new block; null when the GPU has no memory left for it (the pool then takes no more,
  /// and pieces are held in host memory).
  std::shared_ptr<Block> allocate(uint64_t capacity);

  void give_back(const std::shared_ptr<Block>& buffer);

  Device device_;
  uint64_t most_bytes_ = 0;
  std::mutex mutex_;
  std::multimap<uint64_t, std::shared_ptr<Block>> free_;  ///< by size
  uint64_t free_bytes_ = 0;
  uint64_t in_use_bytes_ = 0;
  uint64_t peak_in_use_bytes_ = 0;
};

}  // namespace weightstream::model
