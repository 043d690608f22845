// The CUDA half of the device layer: the one place weightstream calls the CUDA runtime, in
// three files: this one (devices, memory, copies, host registration, device digests),
// copier_cuda.cpp (the DeviceCopier and the work on its lanes: scatters, FP8 quantization)
// and ipc_cuda.cpp (streams and CUDA IPC for the update transports). Compiled only where
// CMake found the CUDA toolkit; device_cuda_fallback.cpp otherwise.
// The runtime is linked statically, so a binary of this build starts on a machine without
// a driver or a GPU and reports it when a device is asked for.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <utility>
#include <vector>

#include "device/cuda_device.hpp"
#include "device/host_memory.hpp"
#include "device/shared/copies.hpp"
#include "device/shared/digests.hpp"
#include "device/shared/host_registration.hpp"
#ifdef WS_HAVE_CUDA_KERNELS
#include "device/copy_kernels.hpp"
#include "device/digest_kernels.hpp"
#endif
#include "weightstream/device.hpp"
#include "weightstream/error.hpp"
#include "weightstream/options.hpp"

namespace weightstream {

using detail::cuda_error_text;
using detail::set_device;

std::string detail::cuda_error_text(cudaError_t error) {
  cudaGetLastError();
  return std::string(cudaGetErrorString(error)) + " (" + cudaGetErrorName(error) + ")";
}

namespace {

/// The device count and, when it is 0, why.
struct DeviceCensus {
  int count = 0;
  std::string reason;
};

const DeviceCensus& census() {
  // Asked once: without a driver cudaGetDeviceCount fails the same way every time, and the
  // set of visible devices (CUDA_VISIBLE_DEVICES) is fixed for the life of the process.
  static const DeviceCensus result = [] {
    DeviceCensus census;
    cudaError_t error = cudaGetDeviceCount(&census.count);
    if (error != cudaSuccess) {
      census.count = 0;
      census.reason = cuda_error_text(error);
      // Without a driver at all the runtime says "driver version is insufficient", which
      // sends a user to upgrade a driver that a machine without a GPU does not have.
      std::error_code ignored;
      if (error == cudaErrorInsufficientDriver && !std::filesystem::exists("/proc/driver/nvidia/version", ignored)) {
        census.reason = "this machine has no GPU, or its NVIDIA driver is not loaded (no /proc/driver/nvidia/version; "
                        "the CUDA runtime says: " + census.reason + ")";
      } else if (error == cudaErrorNoDevice) {
        census.reason = "this machine has no GPU (" + census.reason + ")";
      }
    } else if (census.count == 0) {
      census.reason = "no CUDA device is visible";
    }
    return census;
  }();
  return result;
}

std::string device_count_text() {
  int count = census().count;
  return "this machine has " + std::to_string(count) + " CUDA device" + (count == 1 ? "" : "s");
}

}  // namespace

void detail::set_device(const Device& device) {
  cudaError_t error = cudaSetDevice(device.index);
  WS_EXPECT(error == cudaSuccess, ErrorCode::kDevice,
            device.name() + ": cudaSetDevice failed: " + cuda_error_text(error) + " (" + device_count_text() + ")");
}

bool cuda_compiled() noexcept { return true; }

int cuda_device_count() noexcept { return census().count; }

void require_device(const Device& device) {
  if (!device.is_cuda()) return;
  const auto& devices = census();
  WS_EXPECT(devices.count > 0, ErrorCode::kDevice,
            device.name() + ": no usable CUDA device on this machine: " + devices.reason);
  WS_EXPECT(device.index < devices.count, ErrorCode::kDevice,
            device.name() + ": invalid device ordinal (" + device_count_text() + ")");
  set_device(device);
}

Buffer::Buffer(Device device, size_t bytes, HostMemory host) : device_(device) {
  if (bytes == 0) return;
  if (device.is_cuda()) {
    require_device(device);
    void* data = nullptr;
    cudaError_t error = cudaMalloc(&data, bytes);
    WS_EXPECT(error == cudaSuccess, ErrorCode::kDevice,
              device.name() + ": cannot allocate " + format_size(bytes) + " of device memory: cudaMalloc failed: " +
                  cuda_error_text(error));
    data_ = static_cast<std::byte*>(data);
  } else if (host == HostMemory::kPinned && cuda_device_count() > 0) {
    // Pinned memory is the host allocator's (2 MiB aligned) then registered, rather than
    // cudaHostAlloc'd: cudaHostAlloc faults and pins 4 KiB pages one by one, which is slower
    // (bench/HISTORY.md, "Figures once in source comments"), and a load allocates its
    // staging buffers inside the timed part. Portable: pinned for every device.
    std::byte* data = detail::allocate_host(bytes);
    cudaError_t error = cudaHostRegister(data, bytes, cudaHostRegisterPortable);
    if (error != cudaSuccess) {
      detail::free_host(data, bytes);
      WS_FAIL(ErrorCode::kDevice, "cpu: cannot pin " + format_size(bytes) +
                                      " of host memory: cudaHostRegister failed: " + cuda_error_text(error));
    }
    data_ = data;
    pinned_ = true;
  } else {
    // Pinning needs a driver; without one, page-aligned memory serves the same reads.
    data_ = detail::allocate_host(bytes);
  }
  size_ = bytes;
}

void Buffer::release() noexcept {
  if (!data_) return;
  if (device_.is_cuda()) {
    cudaSetDevice(device_.index);
    cudaFree(data_);
  } else if (pinned_) {
    cudaHostUnregister(data_);
    detail::free_host(data_, size_);
  } else {
    detail::free_host(data_, size_);
  }
  data_ = nullptr;
  size_ = 0;
  pinned_ = false;
}

void copy_bytes(void* destination, const Device& destination_device, const void* source, const Device& source_device,
                size_t bytes) {
  if (bytes == 0) return;
  if (!destination_device.is_cuda() && !source_device.is_cuda()) {
    std::memcpy(destination, source, bytes);
    return;
  }
  const Device& device = source_device.is_cuda() ? source_device : destination_device;
  require_device(device);
  // Unified addressing lets the runtime tell host from device memory by the pointers.
  cudaError_t error = cudaMemcpy(destination, source, bytes, cudaMemcpyDefault);
  WS_EXPECT(error == cudaSuccess, ErrorCode::kDevice,
            device.name() + ": copy of " + std::to_string(bytes) + " bytes from " + source_device.name() + " to " +
                destination_device.name() + " failed: cudaMemcpy: " + cuda_error_text(error));
}

void fill_zero(void* destination, const Device& device, size_t bytes) {
  if (bytes == 0) return;
  if (!device.is_cuda()) {
    std::memset(destination, 0, bytes);
    return;
  }
  require_device(device);
  cudaError_t error = cudaMemset(destination, 0, bytes);
  if (error == cudaSuccess) error = cudaDeviceSynchronize();
  WS_EXPECT(error == cudaSuccess, ErrorCode::kDevice,
            device.name() + ": zeroing " + std::to_string(bytes) + " bytes failed: cudaMemset: " + cuda_error_text(error));
}

namespace {

/// A non-blocking stream of its own for one batch of copies (batches are not allowed on the
/// legacy default stream), destroyed with the handle.
using OwnedStream = std::unique_ptr<CUstream_st, decltype(&cudaStreamDestroy)>;
OwnedStream batch_stream(const Device& device) {
  cudaStream_t stream = nullptr;
  cudaError_t error = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  WS_EXPECT(error == cudaSuccess, ErrorCode::kDevice,
            device.name() + ": cudaStreamCreate for a batch of copies failed: " + cuda_error_text(error));
  return OwnedStream(stream, &cudaStreamDestroy);
}

}  // namespace

void copy_batch(const Device& device, std::span<const CopyRange> ranges) {
  if (!device.is_cuda()) {
    for (const CopyRange& range : ranges) {
      if (range.bytes) std::memcpy(range.destination, range.source, range.bytes);
    }
    return;
  }
  if (ranges.empty()) return;
  require_device(device);
  std::vector<void*> destinations;
  std::vector<const void*> sources;
  std::vector<size_t> sizes;
  destinations.reserve(ranges.size());
  sources.reserve(ranges.size());
  sizes.reserve(ranges.size());
  for (const CopyRange& range : ranges) {
    if (range.bytes == 0) continue;
    destinations.push_back(range.destination);
    sources.push_back(range.source);
    sizes.push_back(range.bytes);
  }
  if (sizes.empty()) return;
  OwnedStream owned = batch_stream(device);
  cudaStream_t stream = owned.get();
  cudaError_t error = cudaSuccess;
  // Every copy reads its source in stream order (the sources were written before the call).
  cudaMemcpyAttributes attributes{};
  attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t first_attribute = 0;
  error = cudaMemcpyBatchAsync(destinations.data(), sources.data(), sizes.data(), sizes.size(), &attributes,
                               &first_attribute, 1, stream);
  if (error == cudaErrorNotSupported || error == cudaErrorInvalidValue) {
    // A driver without batches (or refusing this mix): one async copy each, still one wait.
    cudaGetLastError();
    error = cudaSuccess;
    for (size_t i = 0; i < sizes.size() && error == cudaSuccess; ++i) {
      error = cudaMemcpyAsync(destinations[i], sources[i], sizes[i], cudaMemcpyDefault, stream);
    }
  }
  if (error == cudaSuccess) error = cudaStreamSynchronize(stream);
  WS_EXPECT(error == cudaSuccess, ErrorCode::kDevice,
            device.name() + ": batch of " + std::to_string(sizes.size()) + " copies failed: " + cuda_error_text(error));
}

#ifdef WS_HAVE_CUDA_KERNELS
namespace {

/// Pieces of at most kCopyWorkBytes (a multiple of 16, so aligned ranges stay aligned): a
/// 1 GiB tensor spreads over a thousand blocks instead of crawling through one.
void append_work(std::span<const CopyRange> ranges, std::vector<detail::CopyWork>& work) {
  for (const CopyRange& range : ranges) {
    auto* destination = static_cast<std::byte*>(range.destination);
    const auto* source = static_cast<const std::byte*>(range.source);
    for (uint64_t done = 0; done < range.bytes; done += detail::kCopyWorkBytes) {
      work.push_back({destination + done, source + done, std::min<uint64_t>(detail::kCopyWorkBytes, range.bytes - done)});
    }
  }
}

}  // namespace
#endif

void copy_within_device(const Device& device, std::span<const CopyRange> ranges) {
#ifdef WS_HAVE_CUDA_KERNELS
  if (!device.is_cuda()) return copy_batch(device, ranges);
  std::vector<detail::CopyWork> work;
  append_work(ranges, work);
  if (work.empty()) return;
  require_device(device);
  OwnedStream owned = batch_stream(device);
  cudaStream_t stream = owned.get();
  cudaError_t error = cudaSuccess;
  const size_t work_bytes = work.size() * sizeof(detail::CopyWork);
  void* items = nullptr;
  error = cudaMallocAsync(&items, work_bytes, stream);
  if (error == cudaSuccess) {
    error = cudaMemcpyAsync(items, work.data(), work_bytes, cudaMemcpyHostToDevice, stream);
    if (error == cudaSuccess) error = detail::launch_copy_work(static_cast<const detail::CopyWork*>(items), work.size(), stream);
    cudaError_t freed = cudaFreeAsync(items, stream);
    if (error == cudaSuccess) error = freed;
  }
  if (error == cudaSuccess) error = cudaStreamSynchronize(stream);
  WS_EXPECT(error == cudaSuccess, ErrorCode::kDevice,
            device.name() + ": copy of " + std::to_string(ranges.size()) + " ranges (" + std::to_string(work.size()) +
                " pieces) within the device failed: " + cuda_error_text(error));
#else
  copy_batch(device, ranges);
#endif
}

// The queue keeps its work items in a pinned host array and a device array of the same
// size: a gather appends its items to both (one async upload, one launch); wait() empties
// them. Arrays too small are replaced by larger ones without waiting (a wait here would
// drain the pipeline the queue exists for); the old ones, still read by gathers in flight,
// are freed at the next wait(). A queue reused across loads keeps its grown arrays.
struct CopyQueue::State {
#ifdef WS_HAVE_CUDA_KERNELS
  /// One pair of work-item arrays.
  struct Items {
    detail::CopyWork* host = nullptr;    // pinned (cudaMallocHost)
    detail::CopyWork* device = nullptr;  // cudaMalloc
    size_t capacity = 0;
    void release() noexcept {
      if (host != nullptr) cudaFreeHost(host);
      if (device != nullptr) cudaFree(device);
      *this = Items{};
    }
  };
  Items items;                         // the arrays gathers append to
  std::vector<Items> retired;          // replaced arrays, freed at the next wait()
  size_t used = 0;                     // items of `items` used since the last wait()
  std::vector<detail::CopyWork> work;  // scratch of one gather
#endif
  Device device;
  OwnedStream stream{nullptr, &cudaStreamDestroy};
  bool pending = false;

  ~State() {
    if (pending) cudaStreamSynchronize(stream.get());
#ifdef WS_HAVE_CUDA_KERNELS
    items.release();
    for (Items& old : retired) old.release();
#endif
  }

  void check(cudaError_t error, const std::string& what) const {
    WS_EXPECT(error == cudaSuccess, ErrorCode::kDevice, device.name() + ": copy queue: " + what + ": " + cuda_error_text(error));
  }

#ifdef WS_HAVE_CUDA_KERNELS
  /// Room for `count` more work items: new, larger arrays when these are full.
  void reserve(size_t count) {
    if (used + count <= items.capacity) return;
    // An update of 16 GB in 1 MiB pieces takes 16,384 items: the first arrays hold that.
    Items grown;
    grown.capacity = std::max<size_t>({count, 2 * items.capacity, size_t{1} << 15});
    check(cudaMallocHost(reinterpret_cast<void**>(&grown.host), grown.capacity * sizeof(detail::CopyWork)),
          "cudaMallocHost of " + std::to_string(grown.capacity) + " work items");
    cudaError_t error = cudaMalloc(reinterpret_cast<void**>(&grown.device), grown.capacity * sizeof(detail::CopyWork));
    if (error != cudaSuccess) grown.release();
    check(error, "cudaMalloc of " + std::to_string(grown.capacity) + " work items");
    if (items.capacity > 0) retired.push_back(items);
    items = grown;
    used = 0;
  }
#endif
};

CopyQueue::CopyQueue() : CopyQueue(Device{}) {}

CopyQueue::CopyQueue(const Device& device) : state_(std::make_unique<State>()) {
  state_->device = device;
  if (device.is_cuda()) {
    require_device(device);
    state_->stream = batch_stream(device);
  }
}

CopyQueue::~CopyQueue() = default;
CopyQueue::CopyQueue(CopyQueue&&) noexcept = default;
CopyQueue& CopyQueue::operator=(CopyQueue&&) noexcept = default;

void CopyQueue::gather(std::span<const CopyRange> ranges) {
  State& state = *state_;
  if (!state.device.is_cuda()) return copy_batch(state.device, ranges);
#ifdef WS_HAVE_CUDA_KERNELS
  state.work.clear();
  append_work(ranges, state.work);
  if (state.work.empty()) return;
  require_device(state.device);
  state.reserve(state.work.size());
  detail::CopyWork* host = state.items.host + state.used;
  detail::CopyWork* on_device = state.items.device + state.used;
  std::copy(state.work.begin(), state.work.end(), host);
  const size_t bytes = state.work.size() * sizeof(detail::CopyWork);
  state.check(cudaMemcpyAsync(on_device, host, bytes, cudaMemcpyHostToDevice, state.stream.get()),
              "upload of " + std::to_string(state.work.size()) + " work items");
  state.pending = true;
  state.used += state.work.size();
  state.check(detail::launch_copy_work(on_device, state.work.size(), state.stream.get()),
              "launch of a copy of " + std::to_string(ranges.size()) + " ranges");
#else
  copy_batch(state.device, ranges);
#endif
}

void CopyQueue::wait() {
  State& state = *state_;
  if (!state.pending) return;
  state.pending = false;
  cudaError_t error = cudaStreamSynchronize(state.stream.get());
#ifdef WS_HAVE_CUDA_KERNELS
  state.used = 0;
  for (State::Items& old : state.retired) old.release();
  state.retired.clear();
#endif
  state.check(error, "waiting for its copies");
}

bool CopyQueue::pending() const noexcept { return state_ && state_->pending; }

void wait_for_copies(const Device& device) {
  if (!device.is_cuda()) return;
  require_device(device);
  // copy_bytes() issues cudaMemcpy, which runs on the legacy default stream.
  cudaError_t error = cudaStreamSynchronize(cudaStreamLegacy);
  WS_EXPECT(error == cudaSuccess, ErrorCode::kDevice,
            device.name() + ": waiting for device-to-device copies failed: " + cuda_error_text(error));
}

HostRegistration::HostRegistration(const Device& device, const void* data, size_t bytes, bool read_only)
    : device_(device) {
  if (bytes == 0) return;
  WS_EXPECT(device.is_cuda(), ErrorCode::kInvalidArgument,
            "host memory can be registered only for a CUDA device, not " + device.name());
  require_device(device);
  unsigned flags = cudaHostRegisterPortable | (read_only ? cudaHostRegisterReadOnly : 0u);
  // The runtime takes a non-const pointer but, with cudaHostRegisterReadOnly, never writes.
  cudaError_t error = cudaHostRegister(const_cast<void*>(data), bytes, flags);
  WS_EXPECT(error == cudaSuccess, ErrorCode::kDevice,
            device.name() + ": cannot register " + format_size(bytes) + " of host memory" +
                (read_only ? " read-only" : "") + ": cudaHostRegister failed: " + cuda_error_text(error));
  data_ = data;
  size_ = bytes;
}

void HostRegistration::release() noexcept {
  if (!data_) return;
  cudaSetDevice(device_.index);
  cudaHostUnregister(const_cast<void*>(data_));
  data_ = nullptr;
  size_ = 0;
}

bool device_hashes_xxh64() noexcept {
#ifdef WS_HAVE_CUDA_KERNELS
  return true;
#else
  return false;
#endif
}

std::vector<uint64_t> xxh64_on_device(const Device& device, std::span<const DeviceDigestRange> ranges) {
  std::vector<uint64_t> digests(ranges.size());
  if (ranges.empty()) return digests;
#ifdef WS_HAVE_CUDA_KERNELS
  require_device(device);
  OwnedStream owned = batch_stream(device);
  cudaStream_t stream = owned.get();
  std::vector<detail::DigestWork> work;
  work.reserve(ranges.size());
  for (const DeviceDigestRange& range : ranges) work.push_back({range.data, range.bytes});
  const size_t range_bytes = work.size() * sizeof(detail::DigestWork);
  const size_t digest_bytes = ranges.size() * sizeof(uint64_t);
  void* on_device = nullptr;
  cudaError_t error = cudaMallocAsync(&on_device, range_bytes + digest_bytes, stream);
  if (error == cudaSuccess) {
    auto* device_ranges = static_cast<detail::DigestWork*>(on_device);
    auto* device_digests = reinterpret_cast<uint64_t*>(static_cast<std::byte*>(on_device) + range_bytes);
    error = cudaMemcpyAsync(device_ranges, work.data(), range_bytes, cudaMemcpyHostToDevice, stream);
    if (error == cudaSuccess) error = detail::launch_xxh64(device_ranges, device_digests, ranges.size(), stream);
    if (error == cudaSuccess) {
      error = cudaMemcpyAsync(digests.data(), device_digests, digest_bytes, cudaMemcpyDeviceToHost, stream);
    }
    cudaError_t freed = cudaFreeAsync(on_device, stream);
    if (error == cudaSuccess) error = freed;
  }
  if (error == cudaSuccess) error = cudaStreamSynchronize(stream);
  WS_EXPECT(error == cudaSuccess, ErrorCode::kDevice,
            device.name() + ": xxh64 of " + std::to_string(ranges.size()) + " ranges on the device failed: " +
                cuda_error_text(error));
  return digests;
#else
  WS_FAIL(ErrorCode::kUnsupported, device.name() + ": cannot hash " + std::to_string(ranges.size()) +
                                       " ranges on the device: this build has no CUDA kernels (nvcc was not found at build time)");
#endif
}

}  // namespace weightstream
