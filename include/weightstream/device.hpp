#pragma once
/// @file device.hpp
/// The device layer: host, pinned-host and CUDA memory, and copies between them. Built
/// with CUDA where the toolkit is found; otherwise every CUDA request throws
/// Error(kUnsupported) naming the device. Knows nothing of storage. Every CUDA runtime and
/// driver call of weightstream's layers is made in src/device/ (device_cuda.cpp), with one
/// CUDA error text; other layers use this API (the update transports its streams and IPC).

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
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
/// Throws when `device` cannot be used: Error(kUnsupported) when the build has no CUDA
/// support, Error(kDevice) naming the device when the machine has no GPU or the index is
/// out of range. A CPU device is always usable.
void require_device(const Device& device);

/// Kinds of host memory.
enum class HostMemory {
  kPageable,  ///< page-aligned ordinary memory
  kPinned,    ///< page-locked (huge-page backed, cudaHostRegister) where CUDA is available, else page-aligned
};

/// An owning, move-only block of memory on a device. Host memory is page-aligned and
/// zero-filled; device memory is not initialized.
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

/// Writes `bytes` zero bytes at `destination`, in the memory of `device`, and waits until
/// they landed (cudaMemset on a GPU). Throws Error(kDevice) with the CUDA error string.
void fill_zero(void* destination, const Device& device, size_t bytes);

/// One copy of a batch: `bytes` from `source` to `destination`, each in host memory or in
/// the memory of the batch's device.
struct CopyRange {
  void* destination = nullptr;
  const void* source = nullptr;
  size_t bytes = 0;
};

/// Copies every range and waits until all are done. On a GPU the ranges go to the driver
/// as one batch (cudaMemcpyBatchAsync): thousands of small tensors cost about one call,
/// not one cudaMemcpy each (about 13 us each on an H200, which for 10,000 tensors is more
/// than copying 16 GB). The ranges must not overlap. Throws Error(kDevice) naming the
/// device, the number of ranges and the CUDA error.
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

/// Waits until every copy_bytes() copy involving `device` has finished. A device-to-device
/// copy_bytes() returns before the copy engine is done (CUDA's rule for cudaMemcpy between
/// device buffers); call this before handing such memory to another process or stream.
/// A no-op for the CPU and in builds without CUDA. Throws Error(kDevice) on a CUDA error.
void wait_for_copies(const Device& device);

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

/// Asynchronous host-to-device copies on a set of CUDA streams ("lanes") of one device.
/// Each copy keeps a caller's keepalive (a staging-buffer lease, a HostRegistration) until
/// the copy engine is done with the source; a thread of the copier releases it then, so
/// a bounded staging pool refills while copies are still being enqueued. Thread-safe:
/// any number of threads may enqueue at once. The first CUDA error fails every later call
/// and is the error synchronize() throws.
class DeviceCopier {
 public:
  /// Lanes of a copier made without a count. One host-to-device stream already saturates
  /// PCIe from pinned memory; a few let copies issued by different reader threads queue
  /// independently.
  static constexpr unsigned kDefaultLanes = 4;
  /// Creates `lanes` (at least 1) non-blocking streams on `device`. Throws
  /// Error(kUnsupported) without CUDA in the build, Error(kDevice) for an unusable device.
  explicit DeviceCopier(const Device& device, unsigned lanes = kDefaultLanes);
  /// Waits for the copies in flight (the sources must outlive them); never throws.
  ~DeviceCopier();
  DeviceCopier(const DeviceCopier&) = delete;
  DeviceCopier& operator=(const DeviceCopier&) = delete;

  /// Enqueues a copy of `bytes` from `source` (host memory, or memory of the copier's
  /// device) to device `destination` on lane `lane % lanes()` and returns at once;
  /// `keepalive` is dropped once the copy is done. A host source should be pinned or
  /// registered: pageable memory is staged by the driver before the call returns (so it
  /// may change afterwards) and copies more slowly. `what` (a tensor name) is used only in
  /// error messages. Throws Error(kDevice) naming the device, `what`, the range and the
  /// CUDA error.
  void copy_to_device(void* destination, const void* source, size_t bytes, std::shared_ptr<const void> keepalive,
                      unsigned lane, std::string_view what = {});
  /// Like copy_to_device() for a rectangle: `rows` rows of `width` bytes, source rows
  /// `source_pitch` bytes apart, destination rows `destination_pitch` bytes apart
  /// (cudaMemcpy2DAsync: one call for a column slice of a row-major tensor).
  void copy_rows_to_device(void* destination, size_t destination_pitch, const void* source, size_t source_pitch,
                           size_t width, size_t rows, std::shared_ptr<const void> keepalive, unsigned lane,
                           std::string_view what = {});
  /// Copies `bytes` from device `source` to host `destination` on lane `lane % lanes()`
  /// and waits for that copy (for reading back what landed, e.g. to hash it).
  void copy_to_host(void* destination, const void* source, size_t bytes, unsigned lane, std::string_view what = {});
  /// Blocks while more than `bytes` of enqueued copies are unfinished (a bound on the
  /// source memory a producer holds, e.g. registered windows of a mapped file).
  void wait_until_in_flight_at_most(uint64_t bytes);
  /// Waits for every copy enqueued so far and releases their keepalives. Throws the first
  /// CUDA error of any copy, naming the device and the copy.
  void synchronize();
  /// Throws the first CUDA error of a copy seen so far, without waiting. A copy's error is
  /// recorded before its keepalive is dropped, so a caller told of a landed copy by its
  /// keepalive's destruction learns here whether it landed intact.
  void throw_if_failed() const;

  unsigned lanes() const noexcept;
  const Device& device() const noexcept;
  /// Bytes enqueued and not yet known to be finished.
  uint64_t bytes_in_flight() const noexcept;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

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
