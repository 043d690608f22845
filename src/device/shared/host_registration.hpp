#pragma once
// Page-locking mapped host memory for the copy engine (the mapped GPU path). Internal to the library (not installed): the layers
// above the device layer use it; src/device/device_cuda.cpp implements it, with a host
// fallback in device_cuda_fallback.cpp.

#include <cstddef>

#include "weightstream/device.hpp"

namespace weightstream {

/// Page-locks an existing host range (typically a read-only mmap of a file) for the
/// copy engine of `device`, so that async copies read it directly instead of through a
/// pageable bounce. Registering faults in every page of the range, which on a cold page
/// cache reads the file. Unregisters on destruction. Move-only.
class HostRegistration {
 public:
  HostRegistration() = default;
  /// Registers [data, data + bytes) read-only (cudaHostRegisterReadOnly) where `read_only`,
  /// so a PROT_READ mapping is accepted. Throws Error(kUnsupported) without CUDA in the
  /// build and Error(kDevice) naming the device, the size and the CUDA error otherwise.
  HostRegistration(const Device& device, const void* data, size_t bytes, bool read_only = true);
  HostRegistration(HostRegistration&& other) noexcept;
  HostRegistration& operator=(HostRegistration&& other) noexcept;
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;
  ~HostRegistration();

  const void* data() const noexcept { return data_; }
  size_t size() const noexcept { return size_; }

 private:
  void release() noexcept;
  const void* data_ = nullptr;
  size_t size_ = 0;
  Device device_;
};

}  // namespace weightstream
