// The CUDA half of the device layer: the one place weightstream calls the CUDA runtime.
// Compiled only where CMake found the CUDA toolkit; device_cuda_fallback.cpp otherwise.
// The runtime is linked statically, so a binary of this build starts on a machine without
// a driver or a GPU and reports it when a device is asked for.
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "device/host_memory.hpp"
#include "device/shared/copies.hpp"
#include "device/shared/digests.hpp"
#include "device/shared/host_registration.hpp"
#include "device/shared/ipc.hpp"
#include "device/shared/quantize.hpp"
#ifdef WS_HAVE_CUDA_KERNELS
#include "device/copy_kernels.hpp"
#include "device/digest_kernels.hpp"
#include "device/quantize_kernels.hpp"
#endif
#include "weightstream/device.hpp"
#include "weightstream/error.hpp"
#include "weightstream/options.hpp"

namespace weightstream {
namespace {

/// "out of memory (cudaErrorMemoryAllocation)". Also clears the runtime's last error, which
/// a failed call leaves set for the next unrelated cudaGetLastError() to find.
std::string cuda_error_text(cudaError_t error) {
  cudaGetLastError();
  return std::string(cudaGetErrorString(error)) + " (" + cudaGetErrorName(error) + ")";
}

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

/// Makes `device` current on this thread (CUDA's current device is per thread).
void set_device(const Device& device) {
  cudaError_t error = cudaSetDevice(device.index);
  WS_EXPECT(error == cudaSuccess, ErrorCode::kDevice,
            device.name() + ": cudaSetDevice failed: " + cuda_error_text(error) + " (" + device_count_text() + ")");
}

std::string copy_text(std::string_view what, size_t bytes) {
  return (what.empty() ? std::string() : "tensor '" + std::string(what) + "': ") + "copy of " + std::to_string(bytes) +
         " bytes";
}

/// What a copier's lane runs: a copy, a scatter out of landed bytes, or the FP8 quantization of a part.
enum class LaneWork : uint8_t { kCopy, kScatter, kQuantize };

/// "tensor 'x': copy of N bytes to the device", or its quantization.
std::string lane_work_text(LaneWork work, std::string_view what, size_t bytes) {
  if (work == LaneWork::kCopy) return copy_text(what, bytes) + " to the device";
  if (work == LaneWork::kScatter) {
    return (what.empty() ? std::string() : std::string(what) + ": ") + "scatter of " + std::to_string(bytes) +
           " bytes out of their landing copy on the device";
  }
  return (what.empty() ? std::string() : std::string(what) + ": ") + "FP8 E4M3 block quantization of " +
         std::to_string(bytes) + " bytes on the device";
}

/// A copier's streams and the memory pool of its scratch, destroyed once neither the copier
/// nor a LaneScratch on them needs them. The pool keeps what it was given back (up to the
/// most in use at once) until it is destroyed: the default pool hands freed memory back to
/// the driver at every synchronization, and a load that lands each read in scratch would map
/// and unmap device memory for every read.
struct LaneStreams {
  Device device;
  std::vector<cudaStream_t> streams;
  cudaMemPool_t pool = nullptr;
  ~LaneStreams() {
    if (streams.empty() && pool == nullptr) return;
    cudaSetDevice(device.index);
    for (auto stream : streams) cudaStreamDestroy(stream);
    if (pool != nullptr) cudaMemPoolDestroy(pool);  // its memory goes back once the last free has run
  }
};

}  // namespace

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
    // Pinned memory is the host allocator's (2 MiB aligned) then
    // registered, rather than cudaHostAlloc'd: on the GPU machines cudaHostAlloc of 1 GiB
    // took 0.59 s (it faults and pins 4 KiB pages one by one), and a load allocates its
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

struct DeviceCopier::State {
  /// A copy enqueued and not yet seen finished.
  struct Pending {
    cudaEvent_t done = nullptr;
    std::shared_ptr<const void> keepalive;
    uint64_t bytes = 0;
    std::string what;  // for an error found when the copy is waited on
    LaneWork work = LaneWork::kCopy;
  };

  Device device;
  std::shared_ptr<LaneStreams> lanes = std::make_shared<LaneStreams>();
  std::vector<cudaStream_t>& streams = lanes->streams;
  std::mutex mutex;
  std::condition_variable changed;  // pending gained an entry, lost one, or an error was set
  std::deque<Pending> pending;
  std::vector<cudaEvent_t> spare_events;
  uint64_t in_flight = 0;
  unsigned releasing = 0;  // finished copies whose keepalives are being dropped
  std::optional<std::string> error;
  bool stopping = false;
  std::thread reaper;

  ~State() {
    for (auto event : spare_events) cudaEventDestroy(event);
  }

  void fail_locked(std::string message) {
    if (!error) error = std::move(message);
    changed.notify_all();
  }

  void throw_if_failed_locked() const {
    if (error) WS_FAIL(ErrorCode::kDevice, *error);
  }

  cudaEvent_t take_event_locked() {
    if (!spare_events.empty()) {
      auto event = spare_events.back();
      spare_events.pop_back();
      return event;
    }
    // Blocking sync: the reaper sleeps in the driver instead of spinning a core that the
    // reader threads need. Timing is off because only completion matters.
    cudaEvent_t event = nullptr;
    cudaError_t status = cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventBlockingSync);
    WS_EXPECT(status == cudaSuccess, ErrorCode::kDevice,
              device.name() + ": cudaEventCreate failed: " + cuda_error_text(status));
    return event;
  }

  /// Issues one copy on lane `lane` through `issue` (a cudaMemcpy*Async call on the stream
  /// it is given) and records its completion; the copy's keepalive is dropped once done.
  template <typename Issue>
  void enqueue(size_t bytes, std::shared_ptr<const void> keepalive, unsigned lane, std::string_view what, Issue&& issue,
               LaneWork work = LaneWork::kCopy) {
    cudaStream_t stream = streams[lane % streams.size()];
    std::unique_lock lock(mutex);
    throw_if_failed_locked();
    cudaEvent_t done = take_event_locked();
    lock.unlock();
    set_device(device);
    cudaError_t status = issue(stream);
    if (status == cudaSuccess) status = cudaEventRecord(done, stream);
    lock.lock();
    if (status != cudaSuccess) {
      spare_events.push_back(done);
      std::string message = device.name() + ": " + lane_work_text(work, what, bytes) + " failed: " + cuda_error_text(status);
      fail_locked(message);
      WS_FAIL(ErrorCode::kDevice, message);
    }
    in_flight += bytes;
    pending.push_back({done, std::move(keepalive), bytes, std::string(what), work});
    changed.notify_all();
  }

  /// Waits for copies in order of enqueueing and drops their keepalives here, on a thread
  /// of our own: dropping may unpin a staging buffer or unregister a mapping,
  /// which a CUDA host callback (cudaLaunchHostFunc) must never do.
  void reap() {
    cudaSetDevice(device.index);
    std::unique_lock lock(mutex);
    for (;;) {
      changed.wait(lock, [&] { return stopping || !pending.empty(); });
      if (pending.empty()) return;  // stopping, and nothing left to wait for
      cudaEvent_t done = pending.front().done;
      lock.unlock();
      cudaError_t status = cudaEventSynchronize(done);
      lock.lock();
      Pending finished = std::move(pending.front());
      pending.pop_front();
      spare_events.push_back(finished.done);
      ++releasing;
      if (status != cudaSuccess) {
        fail_locked(device.name() + ": " + lane_work_text(finished.work, finished.what, finished.bytes) +
                    " failed: " + cuda_error_text(status));
      }
      lock.unlock();
      finished.keepalive.reset();
      lock.lock();
      --releasing;
      in_flight -= finished.bytes;
      changed.notify_all();
    }
  }
};

DeviceCopier::DeviceCopier(const Device& device, unsigned lanes) : state_(std::make_unique<State>()) {
  WS_EXPECT(device.is_cuda(), ErrorCode::kInvalidArgument, "a device copier needs a CUDA device, not " + device.name());
  require_device(device);
  state_->device = device;
  state_->lanes->device = device;
  for (unsigned i = 0; i < std::max(lanes, 1u); ++i) {
    // Non-blocking: the copies must not serialize with work on the legacy default stream.
    cudaStream_t stream = nullptr;
    cudaError_t status = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    WS_EXPECT(status == cudaSuccess, ErrorCode::kDevice,
              device.name() + ": cudaStreamCreate failed: " + cuda_error_text(status));
    state_->streams.push_back(stream);
  }
  cudaMemPoolProps pool{};
  pool.allocType = cudaMemAllocationTypePinned;
  pool.location.type = cudaMemLocationTypeDevice;
  pool.location.id = device.index;
  // A device without memory pools of its own (cudaErrorNotSupported) takes scratch from the
  // default pool instead.
  uint64_t keep = UINT64_MAX;
  if (cudaMemPoolCreate(&state_->lanes->pool, &pool) != cudaSuccess ||
      cudaMemPoolSetAttribute(state_->lanes->pool, cudaMemPoolAttrReleaseThreshold, &keep) != cudaSuccess) {
    cudaGetLastError();
    if (state_->lanes->pool != nullptr) cudaMemPoolDestroy(state_->lanes->pool);
    state_->lanes->pool = nullptr;
  }
  state_->reaper = std::thread([state = state_.get()] { state->reap(); });
}

DeviceCopier::~DeviceCopier() {
  {
    std::lock_guard lock(state_->mutex);
    state_->stopping = true;
  }
  state_->changed.notify_all();
  state_->reaper.join();
}

void DeviceCopier::copy_to_device(void* destination, const void* source, size_t bytes,
                                  std::shared_ptr<const void> keepalive, unsigned lane, std::string_view what) {
  if (bytes == 0) return;
  state_->enqueue(bytes, std::move(keepalive), lane, what, [&](cudaStream_t stream) {
    // cudaMemcpyDefault: the source may be host memory or this device's (unified addressing).
    return cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDefault, stream);
  });
}

void DeviceCopier::copy_rows_to_device(void* destination, size_t destination_pitch, const void* source,
                                       size_t source_pitch, size_t width, size_t rows,
                                       std::shared_ptr<const void> keepalive, unsigned lane, std::string_view what) {
  if (width == 0 || rows == 0) return;
  state_->enqueue(width * rows, std::move(keepalive), lane, what, [&](cudaStream_t stream) {
    return cudaMemcpy2DAsync(destination, destination_pitch, source, source_pitch, width, rows, cudaMemcpyDefault,
                             stream);
  });
}

void DeviceCopier::copy_to_host(void* destination, const void* source, size_t bytes, unsigned lane,
                                std::string_view what) {
  if (bytes == 0) return;
  auto& state = *state_;
  {
    std::lock_guard lock(state.mutex);
    state.throw_if_failed_locked();
  }
  cudaStream_t stream = state.streams[lane % state.streams.size()];
  set_device(state.device);
  cudaError_t status = cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDeviceToHost, stream);
  if (status == cudaSuccess) status = cudaStreamSynchronize(stream);
  WS_EXPECT(status == cudaSuccess, ErrorCode::kDevice,
            state.device.name() + ": " + copy_text(what, bytes) + " to the host failed: " + cuda_error_text(status));
}

void DeviceCopier::wait_until_in_flight_at_most(uint64_t bytes) {
  auto& state = *state_;
  std::unique_lock lock(state.mutex);
  state.changed.wait(lock, [&] { return state.in_flight <= bytes || state.error; });
  state.throw_if_failed_locked();
}

void DeviceCopier::synchronize() {
  auto& state = *state_;
  std::unique_lock lock(state.mutex);
  state.changed.wait(lock, [&] { return state.pending.empty() && state.releasing == 0; });
  state.throw_if_failed_locked();
}

void DeviceCopier::throw_if_failed() const {
  std::lock_guard lock(state_->mutex);
  state_->throw_if_failed_locked();
}

unsigned DeviceCopier::lanes() const noexcept { return static_cast<unsigned>(state_->streams.size()); }

const Device& DeviceCopier::device() const noexcept { return state_->device; }

uint64_t DeviceCopier::bytes_in_flight() const noexcept {
  std::lock_guard lock(state_->mutex);
  return state_->in_flight;
}

// ---- FP8 block quantization on a copier's lanes (quantize.hpp) --------------------------

struct DeviceCopierAccess {
  static DeviceCopier::State& state(DeviceCopier& copier) { return *copier.state_; }
};

bool device_quantizes_e4m3() noexcept {
#ifdef WS_HAVE_CUDA_KERNELS
  return true;
#else
  return false;
#endif
}

LaneScratch::LaneScratch(DeviceCopier& copier, unsigned lane, size_t bytes) {
  auto& state = DeviceCopierAccess::state(copier);
  device_ = state.device;
  stream_owner_ = state.lanes;
  auto stream = state.streams[lane % state.streams.size()];
  stream_ = stream;
  set_device(device_);
  void* data = nullptr;
  cudaError_t error = state.lanes->pool != nullptr
                          ? cudaMallocFromPoolAsync(&data, std::max<size_t>(bytes, 1), state.lanes->pool, stream)
                          : cudaMallocAsync(&data, std::max<size_t>(bytes, 1), stream);
  WS_EXPECT(error == cudaSuccess, ErrorCode::kDevice,
            device_.name() + ": cannot allocate " + format_size(bytes) +
                " of device scratch (landing reads to scatter, staging a part to quantize): cudaMallocAsync failed: " + cuda_error_text(error));
  data_ = static_cast<std::byte*>(data);
  size_ = bytes;
}

LaneScratch::~LaneScratch() {
  if (data_ == nullptr) return;
  cudaSetDevice(device_.index);
  cudaFreeAsync(data_, static_cast<cudaStream_t>(stream_));
}

bool device_scatters() noexcept {
#ifdef WS_HAVE_CUDA_KERNELS
  return true;
#else
  return false;
#endif
}

void land_and_scatter(DeviceCopier& copier, unsigned lane, const void* source, uint64_t bytes,
                      std::span<const ScatterRange> ranges, std::shared_ptr<const void> keepalive,
                      std::string_view what) {
  const Device& device = copier.device();
  const std::string batch_text = (what.empty() ? std::string() : std::string(what) + ": ") + std::to_string(ranges.size()) +
                                 " ranges landed in " + std::to_string(bytes) + " bytes";
  for (const ScatterRange& range : ranges) {
    WS_EXPECT(range.width <= kMostScatterField && range.rows <= kMostScatterField &&
                  range.source_pitch <= kMostScatterField && range.destination_pitch <= kMostScatterField,
              ErrorCode::kInvalidArgument,
              device.name() + ": cannot scatter " + batch_text + ": a range of " + std::to_string(range.rows) +
                  " rows of " + std::to_string(range.width) + " bytes has a field above 4 GiB");
    const uint64_t extent = range.rows == 0 ? 0 : (range.rows - 1) * range.source_pitch + range.width;
    WS_EXPECT(range.source_offset <= bytes && extent <= bytes - range.source_offset, ErrorCode::kInvalidArgument,
              device.name() + ": cannot scatter " + batch_text + ": a range reads bytes " +
                  std::to_string(range.source_offset) + "+" + std::to_string(extent) + ", outside them");
  }
  if (bytes == 0 || ranges.empty()) return;
#ifdef WS_HAVE_CUDA_KERNELS
  auto& state = DeviceCopierAccess::state(copier);
  LaneScratch landing(copier, lane, bytes);  // given back after the launches below, in the lane's order
  state.enqueue(bytes, std::move(keepalive), lane, what, [&](cudaStream_t stream) {
    return cudaMemcpyAsync(landing.data(), source, bytes, cudaMemcpyHostToDevice, stream);
  });
  for (size_t first = 0; first < ranges.size(); first += detail::kScatterItemsPerLaunch) {
    detail::ScatterBatch batch{};
    batch.landing = landing.data();
    uint64_t written = 0;
    for (size_t i = first; i < std::min(ranges.size(), first + detail::kScatterItemsPerLaunch); ++i) {
      const ScatterRange& range = ranges[i];
      if (range.width == 0 || range.rows == 0) continue;
      batch.items[batch.count++] = {static_cast<std::byte*>(range.destination), range.source_offset,
                                    static_cast<uint32_t>(range.width), static_cast<uint32_t>(range.rows),
                                    static_cast<uint32_t>(range.destination_pitch),
                                    static_cast<uint32_t>(range.source_pitch)};
      written += range.width * range.rows;
    }
    state.enqueue(written, nullptr, lane, what,
                  [&](cudaStream_t stream) { return detail::launch_scatter_work(batch, stream); }, LaneWork::kScatter);
  }
#else
  WS_FAIL(ErrorCode::kUnsupported, device.name() + ": cannot scatter " + batch_text +
                                       " on the device: this build has no CUDA kernels (nvcc was not found at build time)");
#endif
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

void quantize_e4m3_blocks(DeviceCopier& copier, unsigned lane, const E4m3BlockJob& job,
                          std::shared_ptr<const void> keepalive, std::string_view what) {
  quantize_e4m3_blocks(copier, lane, std::span(&job, 1), std::move(keepalive), what);
}

void quantize_e4m3_blocks(DeviceCopier& copier, unsigned lane, std::span<const E4m3BlockJob> jobs,
                          std::shared_ptr<const void> keepalive, std::string_view what) {
  const Device& device = copier.device();
  uint64_t source_bytes = 0;
#ifdef WS_HAVE_CUDA_KERNELS
  std::vector<detail::E4m3BlockWork> works;
  works.reserve(jobs.size());
#endif
  for (const E4m3BlockJob& job : jobs) {
    std::string job_text = (what.empty() ? std::string() : std::string(what) + ": ") + std::to_string(job.rows) + " x " + std::to_string(job.columns) + " " +
                           std::string(dtype_name(job.dtype)) + " values";
    WS_EXPECT(job.dtype == Dtype::kBF16 || job.dtype == Dtype::kF16 || job.dtype == Dtype::kF32,
              ErrorCode::kInvalidArgument,
              device.name() + ": cannot quantize " + job_text + " into FP8: only BF16, F16 and F32 quantize");
    const uint64_t element = dtype_bits(job.dtype) / 8;
    WS_EXPECT(job.block_rows > 0 && job.block_columns > 0 && job.block_rows * job.block_columns <= (1ull << 24),
              ErrorCode::kInvalidArgument,
              device.name() + ": cannot quantize " + job_text + " in blocks of " + std::to_string(job.block_rows) +
                  " x " + std::to_string(job.block_columns));
    WS_EXPECT(reinterpret_cast<uintptr_t>(job.source) % element == 0 && job.source_pitch % element == 0 &&
                  job.source_pitch >= job.columns * element,
              ErrorCode::kInvalidArgument,
              device.name() + ": cannot quantize " + job_text + ": the source rows (pitch " +
                  std::to_string(job.source_pitch) + " bytes) are not aligned to their elements");
#ifdef WS_HAVE_CUDA_KERNELS
    if (job.rows == 0 || job.columns == 0) continue;
    detail::E4m3BlockWork work{};
    work.source = job.source;
    work.source_pitch = job.source_pitch;
    work.element = job.dtype == Dtype::kBF16  ? detail::QuantizeElement::kBF16
                   : job.dtype == Dtype::kF16 ? detail::QuantizeElement::kF16
                                              : detail::QuantizeElement::kF32;
    work.rows = job.rows;
    work.columns = job.columns;
    work.block_rows = static_cast<uint32_t>(job.block_rows);
    work.block_columns = static_cast<uint32_t>(job.block_columns);
    work.codes = reinterpret_cast<uint8_t*>(job.codes);
    work.scales = job.scales;
    works.push_back(work);
    source_bytes += job.rows * job.columns * element;
#else
    WS_FAIL(ErrorCode::kUnsupported, device.name() + ": cannot quantize " + job_text +
                                         " on the device: this build has no CUDA kernels (nvcc was not found at build time)");
#endif
  }
#ifdef WS_HAVE_CUDA_KERNELS
  if (works.empty()) return;
  DeviceCopierAccess::state(copier).enqueue(
      source_bytes, std::move(keepalive), lane, what,
      [&](cudaStream_t stream) { return detail::launch_e4m3_blocks(works.data(), works.size(), stream); },
      LaneWork::kQuantize);
#else
  (void)source_bytes;
#endif
}

}  // namespace weightstream

// ---- streams and IPC for the update transports ------------------------------------------

namespace weightstream {

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
