// The DeviceCopier (copies to a device on lanes of its own, their keepalives dropped by a
// reaper thread once done) and the library's other work on those lanes: reads landed on the
// device and scattered, FP8 block quantization. Compiled only where CMake found the CUDA
// toolkit (device_cuda.cpp says more); device_cuda_fallback.cpp otherwise.
#include <cuda_runtime.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "device/cuda_device.hpp"
#include "device/shared/copies.hpp"
#include "device/shared/quantize.hpp"
#ifdef WS_HAVE_CUDA_KERNELS
#include "device/copy_kernels.hpp"
#include "device/quantize_kernels.hpp"
#endif
#include "weightstream/device.hpp"
#include "weightstream/error.hpp"
#include "weightstream/options.hpp"

namespace weightstream {

using detail::cuda_error_text;
using detail::set_device;

namespace {

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
