#pragma once
// Internal to the CUDA sources of the device layer (device_cuda.cpp, copier_cuda.cpp,
// ipc_cuda.cpp; compiled only with the CUDA toolkit): the runtime's error text and making a
// device current, defined in device_cuda.cpp.

#include <cuda_runtime.h>

#include <string>

#include "weightstream/device.hpp"

namespace weightstream::detail {

/// "out of memory (cudaErrorMemoryAllocation)". Also clears the runtime's last error, which
/// a failed call leaves set for the next unrelated cudaGetLastError() to find.
std::string cuda_error_text(cudaError_t error);

/// Makes `device` current on this thread (CUDA's current device is per thread); throws
/// Error(kDevice) naming the device and how many the machine has when it cannot.
void set_device(const Device& device);

}  // namespace weightstream::detail
