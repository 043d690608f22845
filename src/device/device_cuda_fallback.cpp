// The device layer of a build without CUDA: host memory only. Every CUDA request throws
// Error(kUnsupported) naming the device, so a caller learns that the build, not the
// machine, is what lacks the GPU path.
#include <cstring>

#include "device/host_memory.hpp"
#include "device/shared/copies.hpp"
#include "device/shared/digests.hpp"
#include "device/shared/host_registration.hpp"
#include "device/shared/ipc.hpp"
#include "device/shared/quantize.hpp"
#include "weightstream/device.hpp"
#include "weightstream/error.hpp"

namespace weightstream {
namespace {

[[noreturn]] void fail_no_cuda(const Device& device) {
  WS_FAIL(ErrorCode::kUnsupported, device.name() +
                                       ": this build of weightstream has no CUDA support (the CUDA toolkit was not "
                                       "found at build time; rebuild with -DWS_WITH_CUDA=ON)");
}

}  // namespace

bool cuda_compiled() noexcept { return false; }

int cuda_device_count() noexcept { return 0; }

void require_device(const Device& device) {
  if (device.is_cuda()) fail_no_cuda(device);
}

Buffer::Buffer(Device device, size_t bytes, HostMemory /*host: nothing can pin without CUDA*/) : device_(device) {
  require_device(device);
  data_ = detail::allocate_host(bytes);
  size_ = data_ ? bytes : 0;
}

void Buffer::release() noexcept {
  detail::free_host(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

void copy_bytes(void* destination, const Device& destination_device, const void* source, const Device& source_device,
                size_t bytes) {
  require_device(destination_device);
  require_device(source_device);
  if (bytes) std::memcpy(destination, source, bytes);
}

void fill_zero(void* destination, const Device& device, size_t bytes) {
  require_device(device);
  if (bytes) std::memset(destination, 0, bytes);
}

void copy_within_device(const Device& device, std::span<const CopyRange> ranges) { copy_batch(device, ranges); }

void copy_batch(const Device& device, std::span<const CopyRange> ranges) {
  require_device(device);
  for (const CopyRange& range : ranges) {
    if (range.bytes) std::memcpy(range.destination, range.source, range.bytes);
  }
}

void wait_for_copies(const Device&) {}

struct CopyQueue::State {
  Device device;
};

CopyQueue::CopyQueue() : CopyQueue(Device{}) {}
CopyQueue::CopyQueue(const Device& device) : state_(std::make_unique<State>(State{device})) { require_device(device); }
CopyQueue::~CopyQueue() = default;
CopyQueue::CopyQueue(CopyQueue&&) noexcept = default;
CopyQueue& CopyQueue::operator=(CopyQueue&&) noexcept = default;
void CopyQueue::gather(std::span<const CopyRange> ranges) { copy_batch(state_->device, ranges); }
void CopyQueue::wait() {}
bool CopyQueue::pending() const noexcept { return false; }

HostRegistration::HostRegistration(const Device& device, const void*, size_t, bool) : device_(device) {
  fail_no_cuda(device);
}

void HostRegistration::release() noexcept {}

struct DeviceCopier::State {
  Device device;
};

DeviceCopier::DeviceCopier(const Device& device, unsigned) { fail_no_cuda(device); }
DeviceCopier::~DeviceCopier() = default;
void DeviceCopier::copy_to_device(void*, const void*, size_t, std::shared_ptr<const void>, unsigned, std::string_view) {
  fail_no_cuda(state_->device);
}
void DeviceCopier::copy_rows_to_device(void*, size_t, const void*, size_t, size_t, size_t, std::shared_ptr<const void>,
                                       unsigned, std::string_view) {
  fail_no_cuda(state_->device);
}
void DeviceCopier::copy_to_host(void*, const void*, size_t, unsigned, std::string_view) { fail_no_cuda(state_->device); }
void DeviceCopier::wait_until_in_flight_at_most(uint64_t) {}
void DeviceCopier::synchronize() {}
void DeviceCopier::throw_if_failed() const {}
unsigned DeviceCopier::lanes() const noexcept { return 0; }
const Device& DeviceCopier::device() const noexcept { return state_->device; }
uint64_t DeviceCopier::bytes_in_flight() const noexcept { return 0; }

bool device_hashes_xxh64() noexcept { return false; }
std::vector<uint64_t> xxh64_on_device(const Device& device, std::span<const DeviceDigestRange> ranges) {
  if (ranges.empty()) return {};
  fail_no_cuda(device);
}

bool device_scatters() noexcept { return false; }
void land_and_scatter(DeviceCopier& copier, unsigned, const void*, uint64_t, std::span<const ScatterRange>,
                      std::shared_ptr<const void>, std::string_view) {
  fail_no_cuda(copier.device());
}

bool device_quantizes_e4m3() noexcept { return false; }
LaneScratch::LaneScratch(DeviceCopier& copier, unsigned, size_t) { fail_no_cuda(copier.device()); }
LaneScratch::~LaneScratch() = default;
void quantize_e4m3_blocks(DeviceCopier& copier, unsigned, const E4m3BlockJob&, std::shared_ptr<const void>,
                          std::string_view) {
  fail_no_cuda(copier.device());
}
void quantize_e4m3_blocks(DeviceCopier& copier, unsigned, std::span<const E4m3BlockJob>, std::shared_ptr<const void>,
                          std::string_view) {
  fail_no_cuda(copier.device());
}

DeviceStream::DeviceStream(const Device& device) : device_(device) { fail_no_cuda(device); }
DeviceStream::~DeviceStream() = default;
DeviceStream::DeviceStream(DeviceStream&& other) noexcept = default;
DeviceStream& DeviceStream::operator=(DeviceStream&& other) noexcept = default;
void DeviceStream::copy_async(void*, const void*, size_t, std::string_view) { fail_no_cuda(device_); }
void DeviceStream::synchronize(std::string_view) { fail_no_cuda(device_); }

void synchronize_device(const Device& device, std::string_view) { require_device(device); }

IpcHandle export_ipc_handle(const Device& device, const void*, std::string_view) {
  fail_no_cuda(device.is_cuda() ? device : Device{Device::Kind::kCuda, 0});
}
std::optional<IpcHandle> try_export_ipc_handle(const Device&, const void*) { return std::nullopt; }
std::optional<DeviceAllocation> device_allocation_of(const void*) noexcept { return std::nullopt; }

IpcMapping::IpcMapping(const Device& device, const IpcHandle&, std::string_view) : device_(device) {
  fail_no_cuda(device.is_cuda() ? device : Device{Device::Kind::kCuda, 0});
}
IpcMapping::~IpcMapping() = default;
IpcMapping::IpcMapping(IpcMapping&& other) noexcept = default;
IpcMapping& IpcMapping::operator=(IpcMapping&& other) noexcept = default;

}  // namespace weightstream
