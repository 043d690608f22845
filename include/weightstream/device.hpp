#pragma once
/// @file device.hpp
/// The device layer: host, pinned-host and CUDA memory, and copies between them. Built
/// with CUDA where the toolkit is found; otherwise every CUDA request throws
/// Error(kUnsupported) naming the device. Knows nothing of storage. Every CUDA runtime and
/// driver call of weightstream's layers is made in src/device/ (device_cuda.cpp), with one
/// CUDA error text. Copy queues, CUDA streams, host registrations and IPC handles are
/// internals of the library's own layers: src/device/copies.hpp, host_registration.hpp, ipc.hpp.

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

struct DeviceCopierAccess;  // the library's own work on a copier's lanes (src/device/quantize.hpp)

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
  friend struct DeviceCopierAccess;
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace weightstream
