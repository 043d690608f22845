#pragma once
/// @file device.hpp
/// The device layer: host, pinned-host and CUDA memory, and copies between them. Built
/// with CUDA where the toolkit is found; otherwise every CUDA request throws
/// Error(kUnsupported) naming the device. Knows nothing of storage.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace weightstream {

/// Where memory lives.
struct Device {
  enum class Kind { kCpu, kCuda };
  Kind kind = Kind::kCpu;
  int index = 0;
  bool is_cuda() const noexcept { return kind == Kind::kCuda; }
  /// "cpu" or "cuda:N".
  std::string name() const;
  friend bool operator==(const Device&, const Device&) = default;
};

/// Parses "cpu", "cuda" or "cuda:N". Throws Error(kInvalidArgument).
Device parse_device(std::string_view text);

/// True when this build has CUDA support compiled in.
bool cuda_compiled() noexcept;
/// Number of CUDA devices visible (0 without CUDA support, a driver or a GPU).
int cuda_device_count() noexcept;
/// Throws Error(kDevice) naming `device` when it cannot be used (no CUDA in the build, no
/// GPU on the machine, index out of range).
void require_device(const Device& device);

/// Kinds of host memory.
enum class HostMemory {
  kPageable,  ///< page-aligned ordinary memory
  kPinned,    ///< page-locked (cudaHostAlloc) where CUDA is available, else page-aligned
};

/// An owning, move-only block of memory on a device. Host memory is page-aligned.
class Buffer {
 public:
  Buffer() = default;
  /// Allocates `bytes` on `device` (host memory of kind `host` for a CPU device).
  /// Throws Error(kDevice) naming the device and the CUDA error on failure.
  Buffer(Device device, size_t bytes, HostMemory host = HostMemory::kPageable);
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  std::byte* data() const noexcept { return data_; }
  size_t size() const noexcept { return size_; }
  const Device& device() const noexcept { return device_; }
  bool pinned() const noexcept { return pinned_; }

 private:
  void release() noexcept;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  Device device_;
  bool pinned_ = false;
};

/// Copies `bytes` between any two of host and device memory, synchronously.
/// Throws Error(kDevice) with the CUDA error string.
void copy_bytes(void* destination, const Device& destination_device, const void* source,
                const Device& source_device, size_t bytes);

}  // namespace weightstream
