#pragma once
// CUDA IPC: exporting a device allocation to another process and mapping one. Internal to the library (not installed): the layers
// above the device layer use it; src/device/ipc_cuda.cpp implements it, with a host
// fallback in device_cuda_fallback.cpp.

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "weightstream/device.hpp"

namespace weightstream {

/// Bytes of a CUDA IPC memory handle (cudaIpcMemHandle_t).
inline constexpr size_t kIpcHandleBytes = 64;
/// A handle by which another process maps a device allocation of this one.
using IpcHandle = std::array<std::byte, kIpcHandleBytes>;

/// Exports the device allocation that starts at `data` on `device` to other processes
/// (cudaIpcGetMemHandle). Throws Error(kUnsupported) without CUDA in the build,
/// Error(kDevice) naming the device, `what` and the CUDA error.
IpcHandle export_ipc_handle(const Device& device, const void* data, std::string_view what);
/// As export_ipc_handle(), or std::nullopt when CUDA refuses to export the allocation
/// (memory of cudaMallocAsync pools or of virtual-memory mappings), which is not an error.
std::optional<IpcHandle> try_export_ipc_handle(const Device& device, const void* data);

/// The allocation of device memory that holds a pointer: where it starts and its size.
struct DeviceAllocation {
  uintptr_t base = 0;
  uint64_t bytes = 0;
};
/// The allocation holding `pointer` (the driver's cuMemGetAddressRange), or std::nullopt
/// when the driver cannot tell: not device memory, a driver without the call, no CUDA.
std::optional<DeviceAllocation> device_allocation_of(const void* pointer) noexcept;

/// Another process's device allocation mapped into this one on `device`
/// (cudaIpcOpenMemHandle, peer access enabled lazily), unmapped on destruction. Move-only.
class IpcMapping {
 public:
  IpcMapping() = default;
  /// Maps `handle` on `device`. Throws Error(kUnsupported) without CUDA in the build,
  /// Error(kDevice) naming the device, `what` and the CUDA error.
  IpcMapping(const Device& device, const IpcHandle& handle, std::string_view what);
  ~IpcMapping();
  IpcMapping(IpcMapping&& other) noexcept;
  IpcMapping& operator=(IpcMapping&& other) noexcept;
  IpcMapping(const IpcMapping&) = delete;
  IpcMapping& operator=(const IpcMapping&) = delete;

  /// Where the allocation is mapped here (null for an empty mapping).
  std::byte* data() const noexcept { return data_; }

 private:
  Device device_;
  std::byte* data_ = nullptr;
};

}  // namespace weightstream
