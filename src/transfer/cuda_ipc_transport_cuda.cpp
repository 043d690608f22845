// The CUDA IPC transport: the receiver allocates its two bucket buffers on its GPU and
// exports each ONCE, at connect, with cudaIpcGetMemHandle; the sender opens the two handles
// once (cudaIpcOpenMemHandle) and fills buckets with async copies on its own stream, so
// the per-update cost of IPC is two handle opens, never one per tensor (opening a handle
// costs about 0.1 ms, which for 90,000 tensors is most of an update).
// Compiled only with CUDA; cuda_ipc_transport_cuda_fallback.cpp otherwise.
#include <cuda_runtime.h>

#include <cstring>

#include "transfer/transport.hpp"

namespace weightstream::transfer {
namespace {

constexpr size_t kHandleBytes = sizeof(cudaIpcMemHandle_t);

std::string cuda_text(cudaError_t error) {
  cudaGetLastError();  // clear the sticky last error a failed call leaves
  return std::string(cudaGetErrorString(error)) + " (" + cudaGetErrorName(error) + ")";
}

void check(cudaError_t error, const Device& device, const std::string& operation) {
  WS_EXPECT(error == cudaSuccess, ErrorCode::kDevice, device.name() + ": " + operation + ": " + cuda_text(error));
}

Device cuda_device(const Device& device) { return device.is_cuda() ? device : Device{Device::Kind::kCuda, 0}; }

class CudaIpcReceiver final : public ReceiverTransport {
 public:
  CudaIpcReceiver(uint64_t bucket_bytes, const Device& device) : device_(cuda_device(device)) {
    require_device(device_);
    for (auto& buffer : buffers_) buffer = Buffer(device_, bucket_bytes);
    blob_.resize(2 * kHandleBytes);
    for (int i = 0; i < 2; ++i) {
      cudaIpcMemHandle_t handle;
      check(cudaIpcGetMemHandle(&handle, buffers_[i].data()), device_, "cudaIpcGetMemHandle of bucket buffer " + std::to_string(i));
      std::memcpy(blob_.data() + i * kHandleBytes, &handle, kHandleBytes);
    }
  }
  std::vector<std::byte> welcome_blob() const override { return blob_; }
  const std::byte* slot(uint32_t index) const override { return buffers_[index].data(); }
  Device device() const override { return device_; }

 private:
  Device device_;
  Buffer buffers_[2];
  std::vector<std::byte> blob_;
};

/// A mapping of a peer's device buffer, closed on destruction.
class OpenedHandle {
 public:
  OpenedHandle() = default;
  OpenedHandle(const cudaIpcMemHandle_t& handle, const Device& device, int index) {
    void* pointer = nullptr;
    check(cudaIpcOpenMemHandle(&pointer, handle, cudaIpcMemLazyEnablePeerAccess), device,
          "cudaIpcOpenMemHandle of the receiver's bucket buffer " + std::to_string(index));
    data_ = static_cast<std::byte*>(pointer);
  }
  OpenedHandle(OpenedHandle&& other) noexcept : data_(std::exchange(other.data_, nullptr)) {}
  OpenedHandle& operator=(OpenedHandle&& other) noexcept {
    std::swap(data_, other.data_);
    return *this;
  }
  ~OpenedHandle() {
    if (data_ != nullptr) cudaIpcCloseMemHandle(data_);
  }
  std::byte* data() const noexcept { return data_; }

 private:
  std::byte* data_ = nullptr;
};

class CudaIpcSender final : public SenderTransport {
 public:
  CudaIpcSender(uint64_t bucket_bytes, const Device& device, std::span<const std::byte> blob)
      : device_(cuda_device(device)) {
    WS_EXPECT(blob.size() == 2 * kHandleBytes, ErrorCode::kProtocol,
              "the receiver's WELCOME for cuda-ipc carried " + std::to_string(blob.size()) + " bytes of handles, not " +
                  std::to_string(2 * kHandleBytes));
    require_device(device_);
    for (int i = 0; i < 2; ++i) {
      cudaIpcMemHandle_t handle;
      std::memcpy(&handle, blob.data() + i * kHandleBytes, kHandleBytes);
      buckets_[i] = OpenedHandle(handle, device_, i);
    }
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), device_, "cudaStreamCreate");
  }
  ~CudaIpcSender() override {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  void fill(uint32_t slot, uint64_t offset, const std::byte* source, const Device& source_device,
            uint64_t bytes) override {
    if (source_device == device_) {
      // From this GPU: gathered, and copied by one launch when the bucket is sealed.
      pending_.push_back({buckets_[slot].data() + offset, source, bytes});
      return;
    }
    // From the host (or another GPU): async on one stream; seal() waits once per bucket.
    check(cudaMemcpyAsync(buckets_[slot].data() + offset, source, bytes, cudaMemcpyDefault, stream_), device_,
          "copy of " + std::to_string(bytes) + " bytes into bucket buffer " + std::to_string(slot));
  }
  void seal(uint32_t slot) override {
    copy_within_device(device_, pending_);
    pending_.clear();
    check(cudaStreamSynchronize(stream_), device_, "waiting for the copies into bucket buffer " + std::to_string(slot));
  }

 private:
  Device device_;
  OpenedHandle buckets_[2];
  cudaStream_t stream_ = nullptr;
  std::vector<CopyRange> pending_;  // copies from this GPU into the bucket being filled
};

}  // namespace

std::unique_ptr<ReceiverTransport> make_cuda_ipc_receiver(uint64_t bucket_bytes, const Device& device) {
  return std::make_unique<CudaIpcReceiver>(bucket_bytes, device);
}

std::unique_ptr<SenderTransport> make_cuda_ipc_sender(uint64_t bucket_bytes, const Device& device,
                                                      std::span<const std::byte> welcome_blob) {
  return std::make_unique<CudaIpcSender>(bucket_bytes, device, welcome_blob);
}

}  // namespace weightstream::transfer
