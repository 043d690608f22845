// The CUDA IPC transport: the receiver allocates its two bucket buffers on its GPU and
// exports each ONCE, at connect, with cudaIpcGetMemHandle; the sender opens the two handles
// once (cudaIpcOpenMemHandle) and fills buckets with async copies on its own stream, so
// the per-update cost of IPC is two handle opens, never one per tensor (opening a handle is
// a driver call that costs more than copying a small tensor; bench/HISTORY.md).
//
// Shared regions: a tensor that lives in a large allocation of the sender's GPU (a
// trainer's flat parameter buffer, a caching allocator's big segment) is not copied into a
// bucket at all. The sender exports the whole allocation once per update and the receiver
// opens it once and copies straight from it into its parameters: each byte is copied once,
// where a bucket moves it twice. Only allocations of at least
// SenderOptions::share_minimum_bytes are shared: opening one costs about as much as copying
// a few hundred MB once. A trainer's flat buffer outlives its updates, so the receiver keeps
// a region open for the next update of the connection: the same allocation comes with the
// same handle (CUDA gives a new allocation a new one, even at the same address), and only
// regions an update no longer announces are closed at its end.
// Compiled only with CUDA; cuda_ipc_transport_cuda_fallback.cpp otherwise. Every CUDA call
// (export, open, streams, address ranges) goes through the device layer (device.hpp).
#include <cstring>
#include <map>
#include <memory>

#include "update/transport.hpp"
#include "device/shared/copies.hpp"
#include "device/shared/ipc.hpp"
#include "weightstream/device.hpp"
#include "weightstream/options.hpp"

namespace weightstream::transfer {
namespace {

constexpr size_t kHandleBytes = kIpcHandleBytes;

Device cuda_device(const Device& device) { return device.is_cuda() ? device : Device{Device::Kind::kCuda, 0}; }

class CudaIpcReceiver final : public ReceiverTransport {
 public:
  CudaIpcReceiver(uint64_t bucket_bytes, const Device& device) : device_(cuda_device(device)) {
    require_device(device_);
    for (auto& buffer : buffers_) buffer = Buffer(device_, bucket_bytes);
    blob_.resize(2 * kHandleBytes);
    for (int i = 0; i < 2; ++i) {
      IpcHandle handle = export_ipc_handle(device_, buffers_[i].data(), "bucket buffer " + std::to_string(i));
      std::memcpy(blob_.data() + i * kHandleBytes, handle.data(), kHandleBytes);
    }
  }
  std::vector<std::byte> welcome_blob() const override { return blob_; }
  const std::byte* slot(uint32_t index) const override { return buffers_[index].data(); }
  Device device() const override { return device_; }
  void open_region(const SharedRegion& region) override;
  std::span<const std::byte> region(uint32_t id) const override;
  void end_update() override;

 private:
  /// A region of the sender's mapped here, kept across the updates that announce it.
  struct Mapping {
    IpcMapping opened;
    uint64_t bytes = 0;        ///< as announced (checked against the mapping's own size)
    bool announced = false;    ///< by the current update
  };
  Device device_;
  Buffer buffers_[2];
  std::vector<std::byte> blob_;
  std::map<std::vector<std::byte>, Mapping> mappings_;  // by handle bytes
  std::vector<const Mapping*> regions_;                 // the current update's, by region id
};

void CudaIpcReceiver::open_region(const SharedRegion& region) {
  const std::string what = "the sender's shared region " + std::to_string(region.id) + " (" + format_size(region.bytes) + ")";
  WS_EXPECT(region.handle.size() == kHandleBytes, ErrorCode::kProtocol,
            "shared region " + std::to_string(region.id) + " came with a " + std::to_string(region.handle.size()) +
                "-byte handle, not a " + std::to_string(kHandleBytes) + "-byte cudaIpcMemHandle_t");
  Mapping& mapping = mappings_[region.handle];
  WS_EXPECT(!mapping.announced, ErrorCode::kProtocol, what + " repeats the handle of a region shared before in this update");
  if (!mapping.opened.data()) {
    IpcHandle handle;
    std::memcpy(handle.data(), region.handle.data(), kHandleBytes);
    try {
      mapping.opened = IpcMapping(device_, handle, what);  // on the receiver's device
    } catch (...) {
      mappings_.erase(region.handle);
      throw;
    }
    // The sender's word for the size is checked against the mapping's own: copies are
    // bounded by it.
    {
      const auto pointer = reinterpret_cast<uintptr_t>(mapping.opened.data());
      if (std::optional<DeviceAllocation> allocation = device_allocation_of(mapping.opened.data())) {
        const uintptr_t base = allocation->base;
        const uint64_t size = allocation->bytes;
        const uint64_t mapped = pointer >= base && pointer - base <= size ? base + size - pointer : 0;
        if (mapped < region.bytes) {
          mappings_.erase(region.handle);
          WS_FAIL(ErrorCode::kProtocol, what + " claims " + std::to_string(region.bytes) +
                                            " bytes but its allocation maps " + std::to_string(mapped) + " bytes here");
        }
      }
    }
    mapping.bytes = region.bytes;
  }
  WS_EXPECT(mapping.bytes == region.bytes, ErrorCode::kProtocol,
            what + " has the handle of a region of " + std::to_string(mapping.bytes) + " bytes shared before");
  mapping.announced = true;
  regions_.push_back(&mapping);
}

std::span<const std::byte> CudaIpcReceiver::region(uint32_t id) const {
  if (id >= regions_.size()) return {};
  return {regions_[id]->opened.data(), regions_[id]->bytes};
}

void CudaIpcReceiver::end_update() {
  regions_.clear();
  for (auto it = mappings_.begin(); it != mappings_.end();) {
    if (it->second.announced) {
      it->second.announced = false;
      ++it;
    } else {
      it = mappings_.erase(it);  // the sender no longer shares it (it may have freed it)
    }
  }
}

class CudaIpcSender final : public SenderTransport {
 public:
  CudaIpcSender(const SenderOptions& options, std::span<const std::byte> blob)
      : device_(cuda_device(options.device)),
        share_minimum_bytes_(options.share_allocations ? options.share_minimum_bytes : UINT64_MAX) {
    const uint64_t bucket_bytes = options.bucket_bytes;
    WS_EXPECT(blob.size() == 2 * kHandleBytes, ErrorCode::kProtocol,
              "the receiver's WELCOME for cuda-ipc carried " + std::to_string(blob.size()) + " bytes of handles, not " +
                  std::to_string(2 * kHandleBytes));
    require_device(device_);
    for (int i = 0; i < 2; ++i) {
      IpcHandle handle;
      std::memcpy(handle.data(), blob.data() + i * kHandleBytes, kHandleBytes);
      buckets_[i] = IpcMapping(device_, handle,
                               "the receiver's bucket buffer " + std::to_string(i) + " (" + format_size(bucket_bytes) + ")");
    }
    stream_.emplace(device_);
  }
  void fill(uint32_t slot, uint64_t offset, const std::byte* source, const Device& source_device,
            uint64_t bytes) override {
    if (source_device == device_) {
      // From this GPU: gathered, and copied by one launch when the bucket is sealed.
      pending_.push_back({buckets_[slot].data() + offset, source, bytes});
      return;
    }
    // From the host (or another GPU): async on one stream; seal() waits once per bucket.
    stream_->copy_async(buckets_[slot].data() + offset, source, bytes, "copy into bucket buffer " + std::to_string(slot));
  }
  void seal(uint32_t slot, bool filled) override {
    // Work the caller queued on this GPU (on any stream) before the bucket is sealed is
    // done before its bytes are copied or its shared regions are read by the receiver.
    synchronize_device(device_, "waiting for the work queued before the bucket was sealed");
    if (!filled) return;
    copy_within_device(device_, pending_);
    pending_.clear();
    stream_->synchronize("waiting for the copies into bucket buffer " + std::to_string(slot));
  }

  void begin_update() override {
    allocations_.clear();
    last_ = nullptr;
    next_region_ = 0;
  }

  std::optional<RegionPlace> share(const std::byte* data, const Device& device, uint64_t bytes,
                                   std::vector<SharedRegion>& announce) override {
    if (device != device_ || share_minimum_bytes_ == UINT64_MAX) return std::nullopt;
    const auto address = reinterpret_cast<uintptr_t>(data);
    const Allocation* allocation = find(address);
    if (allocation == nullptr) allocation = &learn(address);
    if (!allocation->region || address + bytes > allocation->base + allocation->bytes) return std::nullopt;
    if (!allocation->announced) {
      SharedRegion region;
      region.id = *allocation->region;
      region.bytes = allocation->bytes;
      region.handle.assign(allocation->handle.begin(), allocation->handle.end());
      announce.push_back(std::move(region));
      allocation->announced = true;
    }
    return RegionPlace{*allocation->region, address - allocation->base};
  }

 private:
  /// One allocation of this GPU seen by share(): shared (a region) or not worth sharing.
  struct Allocation {
    uintptr_t base = 0;
    uint64_t bytes = 0;
    std::optional<uint32_t> region;
    IpcHandle handle{};
    mutable bool announced = false;
  };

  /// The allocation holding `address` among those seen, or null. Tensors usually come in
  /// address order from one allocation, so the last one found is tried first.
  const Allocation* find(uintptr_t address) const {
    if (last_ != nullptr && address >= last_->base && address < last_->base + last_->bytes) return last_;
    auto after = allocations_.upper_bound(address);
    if (after == allocations_.begin()) return nullptr;
    const Allocation& candidate = std::prev(after)->second;
    if (address >= candidate.base + candidate.bytes) return nullptr;
    last_ = &candidate;
    return last_;
  }

  /// Asks the driver for the allocation holding `address`, and shares it when it is large
  /// enough and exportable (memory from cudaMallocAsync pools or virtual-memory mappings is
  /// not; its tensors then travel in buckets).
  const Allocation& learn(uintptr_t address) {
    Allocation allocation;
    allocation.base = address;
    allocation.bytes = 1;
    if (std::optional<DeviceAllocation> found = device_allocation_of(reinterpret_cast<const void*>(address))) {
      allocation.base = found->base;
      allocation.bytes = found->bytes;
      if (found->bytes >= share_minimum_bytes_) {
        // A refused export is not an error: the tensor goes in a bucket.
        if (auto handle = try_export_ipc_handle(device_, reinterpret_cast<const void*>(allocation.base))) {
          allocation.handle = *handle;
          allocation.region = next_region_++;
        }
      }
    }
    auto [it, inserted] = allocations_.insert_or_assign(allocation.base, allocation);
    last_ = &it->second;
    return it->second;
  }

  Device device_;
  uint64_t share_minimum_bytes_;
  IpcMapping buckets_[2];
  std::optional<DeviceStream> stream_;
  std::vector<CopyRange> pending_;  // copies from this GPU into the bucket being filled
  std::map<uintptr_t, Allocation> allocations_;  // by base address
  mutable const Allocation* last_ = nullptr;
  uint32_t next_region_ = 0;
};

}  // namespace

std::unique_ptr<ReceiverTransport> make_cuda_ipc_receiver(uint64_t bucket_bytes, const Device& device) {
  return std::make_unique<CudaIpcReceiver>(bucket_bytes, device);
}

std::unique_ptr<SenderTransport> make_cuda_ipc_sender(const SenderOptions& options,
                                                      std::span<const std::byte> welcome_blob) {
  return std::make_unique<CudaIpcSender>(options, welcome_blob);
}

}  // namespace weightstream::transfer
