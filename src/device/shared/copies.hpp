#pragma once
// Copies within a device and the waits for them, as the load session and the update
// receiver issue them. Internal to the library (not installed): the layers
// above the device layer use it; src/device/device_cuda.cpp implements it (DeviceStream:
// ipc_cuda.cpp; land_and_scatter: copier_cuda.cpp), with a host
// fallback in device_cuda_fallback.cpp.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "weightstream/device.hpp"

namespace weightstream {

/// One copy of a batch: `bytes` from `source` to `destination`, each in host memory or in
/// the memory of the batch's device.
struct CopyRange {
  void* destination = nullptr;
  const void* source = nullptr;
  size_t bytes = 0;
};

/// Copies every range and waits until all are done. On a GPU the ranges go to the driver
/// as one batch (cudaMemcpyBatchAsync): thousands of small tensors cost about one call,
/// not one cudaMemcpy each, whose driver time for thousands of tensors exceeds the copying
/// (bench/HISTORY.md, "Figures once in source comments"). The ranges must not overlap.
/// Throws Error(kDevice) naming the device, the number of ranges and the CUDA error.
void copy_batch(const Device& device, std::span<const CopyRange> ranges);

/// Like copy_batch() for ranges whose sources and destinations are all in the memory of
/// `device` (a GPU's, or memory another process exported to it): one kernel launch copies
/// them all where the build has CUDA kernels, so 10,000 tensors cost about what one does.
void copy_within_device(const Device& device, std::span<const CopyRange> ranges);

/// Copies within one device issued in order on a stream of the queue's own and waited for
/// together: a caller applying a stream of batches (an update's buckets) enqueues one gather
/// per batch, and its host work on the next batch overlaps the copies of this one. A gather
/// is one kernel launch where the build has CUDA kernels (as copy_within_device()); on the
/// CPU, or without kernels, it copies at once. Sources must stay valid and unchanged, and
/// destinations untouched by others, until wait() returns. Move-only; the destructor waits.
class CopyQueue {
 public:
  CopyQueue();
  explicit CopyQueue(const Device& device);
  ~CopyQueue();
  CopyQueue(CopyQueue&&) noexcept;
  CopyQueue& operator=(CopyQueue&&) noexcept;

  /// Issues the copies of every range (sources and destinations in the device's memory, or
  /// memory another process exported to it) and returns before they are done. Throws
  /// Error(kDevice) naming the device and the CUDA error.
  void gather(std::span<const CopyRange> ranges);
  /// Waits until every gather issued so far has landed. Throws Error(kDevice) when one of
  /// them failed.
  void wait();
  /// True while gathers are issued and not yet waited for.
  bool pending() const noexcept;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

/// One rectangle written out of a landing buffer (land_and_scatter()): `rows` rows of
/// `width` bytes, read `source_pitch` bytes apart from `source_offset` in the landed bytes,
/// written `destination_pitch` bytes apart from `destination` (device memory). One row is
/// a contiguous run.
struct ScatterRange {
  void* destination = nullptr;
  uint64_t destination_pitch = 0;
  uint64_t source_offset = 0;
  uint64_t source_pitch = 0;
  uint64_t width = 0;
  uint64_t rows = 1;
};

/// The most bytes a ScatterRange's width, rows and pitches may each be.
constexpr uint64_t kMostScatterField = 0xffffffffull;

/// True where land_and_scatter() runs on the device: a build with CUDA kernels.
bool device_scatters() noexcept;

/// Lands `bytes` of host memory at `source` (pinned or registered) on `copier`'s device in
/// one copy, into device scratch on lane `lane`, then writes every range out of it with
/// one kernel launch per 120 ranges, on the same lane, and returns at once: many small
/// tensors, or the narrow rows of a column window, cost one copy and a launch instead of a
/// copy each. `keepalive` keeps the source until the landing copy is done;
/// DeviceCopier::synchronize() waits for it all and throws its error. `what` names the
/// batch in errors. Throws Error(kInvalidArgument) for a range outside the landed bytes or
/// a field above kMostScatterField, Error(kDevice) when CUDA fails, Error(kUnsupported)
/// where device_scatters() is false.
void land_and_scatter(DeviceCopier& copier, unsigned lane, const void* source, uint64_t bytes,
                      std::span<const ScatterRange> ranges, std::shared_ptr<const void> keepalive,
                      std::string_view what);

/// Waits until every copy_bytes() copy involving `device` has finished. A device-to-device
/// copy_bytes() returns before the copy engine is done (CUDA's rule for cudaMemcpy between
/// device buffers); call this before handing such memory to another process or stream.
/// A no-op for the CPU and in builds without CUDA. Throws Error(kDevice) on a CUDA error.
void wait_for_copies(const Device& device);

/// A CUDA stream of one device (non-blocking: it does not wait for the legacy default
/// stream) on which copies run in the order issued. Move-only; the destructor waits for
/// what was issued and never throws.
class DeviceStream {
 public:
  /// Creates the stream on `device`, a CUDA device. Throws Error(kUnsupported) without CUDA
  /// in the build, Error(kDevice) for an unusable device or a failed cudaStreamCreate.
  explicit DeviceStream(const Device& device);
  ~DeviceStream();
  DeviceStream(DeviceStream&& other) noexcept;
  DeviceStream& operator=(DeviceStream&& other) noexcept;
  DeviceStream(const DeviceStream&) = delete;
  DeviceStream& operator=(const DeviceStream&) = delete;

  /// Issues a copy of `bytes` between host memory and memory of the device (or memory
  /// another process exported to it) and returns before it is done. `what` names the copy in
  /// errors. Throws Error(kDevice) naming the device, `what` and the CUDA error.
  void copy_async(void* destination, const void* source, size_t bytes, std::string_view what);
  /// Waits for everything issued on the stream. Throws Error(kDevice) naming `what`.
  void synchronize(std::string_view what);
  /// The cudaStream_t, for a library that queues its own work on the stream (NCCL).
  void* native() const noexcept { return stream_; }
  const Device& device() const noexcept { return device_; }

 private:
  Device device_;
  void* stream_ = nullptr;
};

/// Waits until every piece of work queued on `device` by any stream of this process is
/// done (cudaDeviceSynchronize): what a caller computed before handing memory over. A no-op
/// for the CPU. Throws Error(kDevice) naming the device, `what` and the CUDA error.
void synchronize_device(const Device& device, std::string_view what);

}  // namespace weightstream
