// Streams and CUDA IPC for the update transports: a stream of copies of their own, exporting
// a device allocation to another process and mapping one. Compiled only where CMake found
// the CUDA toolkit (device_cuda.cpp says more); device_cuda_fallback.cpp otherwise.
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstring>
#include <optional>
#include <string>
#include <utility>

#include "device/cuda_device.hpp"
#include "device/shared/copies.hpp"
#include "device/shared/ipc.hpp"
#include "weightstream/device.hpp"
#include "weightstream/error.hpp"

namespace weightstream {

using detail::cuda_error_text;
using detail::set_device;

static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes, "kIpcHandleBytes is the size of cudaIpcMemHandle_t");

DeviceStream::DeviceStream(const Device& device) : device_(device) {
  WS_EXPECT(device.is_cuda(), ErrorCode::kInvalidArgument, "a device stream needs a CUDA device, not " + device.name());
  require_device(device);
  cudaStream_t stream = nullptr;
  cudaError_t error = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  WS_EXPECT(error == cudaSuccess, ErrorCode::kDevice, device.name() + ": cudaStreamCreate failed: " + cuda_error_text(error));
  stream_ = stream;
}

DeviceStream::~DeviceStream() {
  if (stream_ == nullptr) return;
  cudaSetDevice(device_.index);
  cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

DeviceStream::DeviceStream(DeviceStream&& other) noexcept
    : device_(other.device_), stream_(std::exchange(other.stream_, nullptr)) {}

DeviceStream& DeviceStream::operator=(DeviceStream&& other) noexcept {
  std::swap(device_, other.device_);
  std::swap(stream_, other.stream_);
  return *this;
}

void DeviceStream::copy_async(void* destination, const void* source, size_t bytes, std::string_view what) {
  if (bytes == 0) return;
  set_device(device_);
  // Unified addressing lets the runtime tell host from device memory by the pointers.
  cudaError_t error = cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream_));
  WS_EXPECT(error == cudaSuccess, ErrorCode::kDevice,
            device_.name() + ": " + std::string(what) + " (" + std::to_string(bytes) +
                " bytes) failed: cudaMemcpyAsync: " + cuda_error_text(error));
}

void DeviceStream::synchronize(std::string_view what) {
  set_device(device_);
  cudaError_t error = cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  WS_EXPECT(error == cudaSuccess, ErrorCode::kDevice,
            device_.name() + ": " + std::string(what) + ": " + cuda_error_text(error));
}

void synchronize_device(const Device& device, std::string_view what) {
  if (!device.is_cuda()) return;
  require_device(device);
  cudaError_t error = cudaDeviceSynchronize();
  WS_EXPECT(error == cudaSuccess, ErrorCode::kDevice, device.name() + ": " + std::string(what) + ": " + cuda_error_text(error));
}

IpcHandle export_ipc_handle(const Device& device, const void* data, std::string_view what) {
  require_device(device);
  cudaIpcMemHandle_t handle;
  cudaError_t error = cudaIpcGetMemHandle(&handle, const_cast<void*>(data));
  WS_EXPECT(error == cudaSuccess, ErrorCode::kDevice,
            device.name() + ": cudaIpcGetMemHandle of " + std::string(what) + ": " + cuda_error_text(error));
  IpcHandle exported;
  std::memcpy(exported.data(), &handle, kIpcHandleBytes);
  return exported;
}

std::optional<IpcHandle> try_export_ipc_handle(const Device& device, const void* data) {
  require_device(device);
  cudaIpcMemHandle_t handle;
  cudaError_t error = cudaIpcGetMemHandle(&handle, const_cast<void*>(data));
  if (error != cudaSuccess) {
    cudaGetLastError();  // a refused export leaves the runtime's last error set
    return std::nullopt;
  }
  IpcHandle exported;
  std::memcpy(exported.data(), &handle, kIpcHandleBytes);
  return exported;
}

namespace {

/// cuMemGetAddressRange from the driver the runtime has loaded: the allocation that holds
/// a device pointer (the runtime API has no equivalent). Null when the driver lacks it.
using AddressRangeFunction = int (*)(unsigned long long* base, size_t* size, unsigned long long pointer);
AddressRangeFunction address_range_function() {
  static const AddressRangeFunction function = [] {
    void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (driver == nullptr) return AddressRangeFunction{nullptr};
    return reinterpret_cast<AddressRangeFunction>(dlsym(driver, "cuMemGetAddressRange_v2"));
  }();
  return function;
}

}  // namespace

std::optional<DeviceAllocation> device_allocation_of(const void* pointer) noexcept {
  AddressRangeFunction range = address_range_function();
  if (range == nullptr) return std::nullopt;
  unsigned long long base = 0;
  size_t size = 0;
  if (range(&base, &size, reinterpret_cast<unsigned long long>(pointer)) != 0 || size == 0) return std::nullopt;
  return DeviceAllocation{static_cast<uintptr_t>(base), size};
}

IpcMapping::IpcMapping(const Device& device, const IpcHandle& handle, std::string_view what) : device_(device) {
  // The handle maps into the current device.
  require_device(device);
  cudaIpcMemHandle_t native;
  std::memcpy(&native, handle.data(), kIpcHandleBytes);
  void* pointer = nullptr;
  cudaError_t error = cudaIpcOpenMemHandle(&pointer, native, cudaIpcMemLazyEnablePeerAccess);
  WS_EXPECT(error == cudaSuccess, ErrorCode::kDevice,
            device.name() + ": cudaIpcOpenMemHandle of " + std::string(what) + ": " + cuda_error_text(error));
  data_ = static_cast<std::byte*>(pointer);
}

IpcMapping::~IpcMapping() {
  if (data_ == nullptr) return;
  cudaSetDevice(device_.index);
  cudaIpcCloseMemHandle(data_);
}

IpcMapping::IpcMapping(IpcMapping&& other) noexcept : device_(other.device_), data_(std::exchange(other.data_, nullptr)) {}

IpcMapping& IpcMapping::operator=(IpcMapping&& other) noexcept {
  std::swap(device_, other.device_);
  std::swap(data_, other.data_);
  return *this;
}

}  // namespace weightstream
