// Host transports (shared memory and TCP), the transport names, and the factory that
// picks a transport by kind.
#include "update/transport.hpp"
#include "net/ucx.hpp"
#include "base/errno_text.hpp"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

namespace weightstream {

std::string_view transport_name(TransportKind kind) noexcept {
  switch (kind) {
    case TransportKind::kShm: return "shm";
    case TransportKind::kTcp: return "tcp";
    case TransportKind::kCudaIpc: return "cuda-ipc";
    case TransportKind::kNccl: return "nccl";
    case TransportKind::kUcx: return "ucx";
  }
  return "unknown";
}

TransportKind parse_transport(std::string_view text) {
  for (TransportKind kind : {TransportKind::kShm, TransportKind::kTcp, TransportKind::kCudaIpc, TransportKind::kNccl,
                             TransportKind::kUcx}) {
    if (text == transport_name(kind)) return kind;
  }
  WS_FAIL(ErrorCode::kInvalidArgument, "transport '" + std::string(text) + "' is not one of shm, tcp, cuda-ipc, nccl, ucx");
}

bool transport_compiled(TransportKind kind) noexcept {
  switch (kind) {
    case TransportKind::kShm:
    case TransportKind::kTcp: return true;
    case TransportKind::kCudaIpc: return cuda_compiled();
    case TransportKind::kNccl: return transfer::nccl_compiled();
    case TransportKind::kUcx: return transfer::ucx::compiled();
  }
  return false;
}

namespace transfer {
namespace {

const Device kHost{};

void copy_to_host(std::byte* destination, const std::byte* source, const Device& source_device, uint64_t bytes) {
  if (source_device.is_cuda()) {
    copy_bytes(destination, kHost, source, source_device, bytes);
  } else {
    std::memcpy(destination, source, bytes);
  }
}

/// A shared mapping of both buckets, unmapped on destruction.
class SharedBuckets {
 public:
  SharedBuckets(int fd, uint64_t bucket_bytes, const std::string& what) : bytes_(2 * bucket_bytes) {
    void* address = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    WS_EXPECT(address != MAP_FAILED, ErrorCode::kIo,
              "cannot map the " + std::to_string(bytes_) + "-byte shared bucket memory of " + what + ": " +
                  detail::errno_text(errno));
    data_ = static_cast<std::byte*>(address);
  }
  ~SharedBuckets() { ::munmap(data_, bytes_); }
  SharedBuckets(const SharedBuckets&) = delete;
  SharedBuckets& operator=(const SharedBuckets&) = delete;
  std::byte* data() const noexcept { return data_; }

 private:
  std::byte* data_ = nullptr;
  uint64_t bytes_ = 0;
};

/// Shared memory: one memfd of two buckets, created by the receiver and passed to the
/// sender with WELCOME (SCM_RIGHTS). The sender writes the bucket in place; the receiver
/// applies from the same pages, so the bytes are copied once on each side.
class ShmReceiver final : public ReceiverTransport {
 public:
  explicit ShmReceiver(uint64_t bucket_bytes)
      : fd_(::memfd_create("weightstream-update-buckets", MFD_CLOEXEC)), bucket_bytes_(bucket_bytes) {
    WS_EXPECT(static_cast<bool>(fd_), ErrorCode::kIo, "cannot create shared bucket memory (memfd_create): " +
                                                          detail::errno_text(errno));
    WS_EXPECT(::ftruncate(fd_.get(), static_cast<off_t>(2 * bucket_bytes)) == 0, ErrorCode::kIo,
              "cannot size shared bucket memory to 2 x " + std::to_string(bucket_bytes) + " bytes: " +
                  detail::errno_text(errno));
    mapping_ = std::make_unique<SharedBuckets>(fd_.get(), bucket_bytes, "this receiver");
  }
  int welcome_fd() const override { return fd_.get(); }
  const std::byte* slot(uint32_t index) const override { return mapping_->data() + index * bucket_bytes_; }
  Device device() const override { return kHost; }

 private:
  FileDescriptor fd_;
  uint64_t bucket_bytes_;
  std::unique_ptr<SharedBuckets> mapping_;
};

class ShmSender final : public SenderTransport {
 public:
  ShmSender(uint64_t bucket_bytes, FileDescriptor fd) : fd_(std::move(fd)), bucket_bytes_(bucket_bytes) {
    WS_EXPECT(static_cast<bool>(fd_), ErrorCode::kProtocol,
              "the receiver's WELCOME for the shm transport carried no shared-memory descriptor");
    struct stat status{};
    WS_EXPECT(::fstat(fd_.get(), &status) == 0 && static_cast<uint64_t>(status.st_size) >= 2 * bucket_bytes,
              ErrorCode::kProtocol,
              "the receiver's shared bucket memory holds " + std::to_string(status.st_size) + " bytes, not 2 x " +
                  std::to_string(bucket_bytes));
    mapping_ = std::make_unique<SharedBuckets>(fd_.get(), bucket_bytes, "the receiver");
  }
  void fill(uint32_t slot, uint64_t offset, const std::byte* source, const Device& source_device,
            uint64_t bytes) override {
    copy_to_host(mapping_->data() + slot * bucket_bytes_ + offset, source, source_device, bytes);
  }

 private:
  FileDescriptor fd_;
  uint64_t bucket_bytes_;
  std::unique_ptr<SharedBuckets> mapping_;
};

/// TCP: each side has two local buckets; the bytes follow their manifest on the socket.
class TcpReceiver final : public ReceiverTransport {
 public:
  explicit TcpReceiver(uint64_t bucket_bytes) : buffers_{Buffer(kHost, bucket_bytes), Buffer(kHost, bucket_bytes)} {}
  void receive(Connection& connection, uint32_t slot, uint64_t bytes, std::chrono::milliseconds timeout,
               const std::string& what) override {
    connection.receive_bytes(std::span(buffers_[slot].data(), bytes), timeout, what);
  }
  const std::byte* slot(uint32_t index) const override { return buffers_[index].data(); }
  Device device() const override { return kHost; }

 private:
  Buffer buffers_[2];
};

class TcpSender final : public SenderTransport {
 public:
  explicit TcpSender(uint64_t bucket_bytes) : buffers_{Buffer(kHost, bucket_bytes), Buffer(kHost, bucket_bytes)} {}
  void fill(uint32_t slot, uint64_t offset, const std::byte* source, const Device& source_device,
            uint64_t bytes) override {
    copy_to_host(buffers_[slot].data() + offset, source, source_device, bytes);
  }
  void push(std::span<Connection* const> connections, uint32_t slot, uint64_t bytes,
            std::chrono::milliseconds timeout) override {
    for (Connection* connection : connections) {
      connection->send_bytes(std::span(buffers_[slot].data(), bytes), timeout,
                             "bucket payload (" + std::to_string(bytes) + " bytes)");
    }
  }

 private:
  Buffer buffers_[2];
};

}  // namespace

void ReceiverTransport::open_region(const SharedRegion& region) {
  WS_FAIL(ErrorCode::kProtocol, "the sender shared region " + std::to_string(region.id) +
                                    " (its own device memory), which only the cuda-ipc transport can read");
}

std::vector<std::byte> sender_hello_blob(TransportKind kind) {
  return kind == TransportKind::kNccl ? nccl_unique_id() : std::vector<std::byte>{};
}

bool feeds_several(TransportKind kind) noexcept {
  return kind == TransportKind::kTcp || kind == TransportKind::kNccl || kind == TransportKind::kUcx;
}

std::unique_ptr<ReceiverTransport> make_receiver_transport(TransportKind kind, uint64_t bucket_bytes,
                                                           const Device& device, std::span<const std::byte> hello_blob,
                                                           uint32_t receivers, uint32_t receiver_index) {
  WS_EXPECT(receivers == 1 || feeds_several(kind), ErrorCode::kProtocol,
            "the sender feeds " + std::to_string(receivers) + " receivers at once over " +
                std::string(transport_name(kind)) + ", which carries one (only tcp, nccl and ucx feed several)");
  switch (kind) {
    case TransportKind::kShm: return std::make_unique<ShmReceiver>(bucket_bytes);
    case TransportKind::kTcp: return std::make_unique<TcpReceiver>(bucket_bytes);
    case TransportKind::kCudaIpc: return make_cuda_ipc_receiver(bucket_bytes, device);
    case TransportKind::kNccl:
      return make_nccl_receiver(bucket_bytes, device, hello_blob, static_cast<int>(receivers) + 1,
                                static_cast<int>(receiver_index) + 1);
    case TransportKind::kUcx: return make_ucx_receiver(bucket_bytes);
  }
  WS_FAIL(ErrorCode::kInternal, "unknown transport");
}

std::unique_ptr<SenderTransport> make_sender_transport(const SenderOptions& options, uint32_t receivers,
                                                       std::span<const std::byte> hello_blob,
                                                       std::span<const std::byte> welcome_blob, FileDescriptor passed_fd) {
  switch (options.transport) {
    case TransportKind::kShm: return std::make_unique<ShmSender>(options.bucket_bytes, std::move(passed_fd));
    case TransportKind::kTcp: return std::make_unique<TcpSender>(options.bucket_bytes);
    case TransportKind::kCudaIpc: return make_cuda_ipc_sender(options, welcome_blob);
    case TransportKind::kNccl:
      return make_nccl_sender(options.bucket_bytes, options.device, hello_blob, static_cast<int>(receivers) + 1);
    case TransportKind::kUcx:
      WS_FAIL(ErrorCode::kInternal, "the ucx sender transport needs every WELCOME (make_ucx_sender)");
  }
  WS_FAIL(ErrorCode::kInternal, "unknown transport");
}

}  // namespace transfer
}  // namespace weightstream
