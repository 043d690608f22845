// The ucx update transport: the sender registers its two bucket buffers with UCX and
// offers their remote keys with HELLO; each receiver reads a bucket one-sided (ucp_get)
// into its own buffer once the bucket's manifest has arrived, and answers APPLIED as
// usual. One sender feeds any number of receivers (each reads the same buckets). The
// bytes cross hosts by whatever UCX picks (tcp here; RDMA where present).
#include <cstring>

#include "transfer/transport.hpp"
#include "transfer/ucx.hpp"

namespace weightstream::transfer {
namespace {

const Device kHost{};

/// Pieces of one bucket read: several in flight keep the link busy.
constexpr uint64_t kUcxReadPiece = 8ull << 20;

/// HELLO blob: u32 address length, worker address, then per slot: u64 address, u32 key
/// length, key.
void put(std::vector<std::byte>& out, const void* data, size_t bytes) {
  const auto* begin = static_cast<const std::byte*>(data);
  out.insert(out.end(), begin, begin + bytes);
}

struct OfferedBuckets {
  std::vector<std::byte> worker_address;
  uint64_t addresses[2] = {0, 0};
  std::vector<std::byte> keys[2];
};

OfferedBuckets parse_offer(std::span<const std::byte> blob) {
  size_t at = 0;
  auto take = [&](void* out, size_t bytes) {
    WS_EXPECT(bytes <= blob.size() - at, ErrorCode::kProtocol, "the ucx sender's HELLO blob is truncated");
    std::memcpy(out, blob.data() + at, bytes);
    at += bytes;
  };
  auto take_bytes = [&](std::vector<std::byte>& out) {
    uint32_t length = 0;
    take(&length, sizeof(length));
    WS_EXPECT(length <= blob.size() - at, ErrorCode::kProtocol, "the ucx sender's HELLO blob is truncated");
    out.assign(blob.begin() + static_cast<ptrdiff_t>(at), blob.begin() + static_cast<ptrdiff_t>(at + length));
    at += length;
  };
  OfferedBuckets offer;
  take_bytes(offer.worker_address);
  for (int slot = 0; slot < 2; ++slot) {
    take(&offer.addresses[slot], sizeof(uint64_t));
    take_bytes(offer.keys[slot]);
  }
  WS_EXPECT(at == blob.size(), ErrorCode::kProtocol, "the ucx sender's HELLO blob has trailing bytes");
  return offer;
}

class UcxSender final : public SenderTransport {
 public:
  explicit UcxSender(uint64_t bucket_bytes)
      : buffers_{Buffer(kHost, bucket_bytes), Buffer(kHost, bucket_bytes)}, bucket_bytes_(bucket_bytes) {
    for (int slot = 0; slot < 2; ++slot) registrations_[slot] = worker_.register_memory(buffers_[slot].data(), bucket_bytes);
    // Reads over UCX's tcp transport are served by messages this side must progress.
    worker_.start_progress();
  }
  ~UcxSender() override {
    worker_.stop_progress();
    for (auto& registration : registrations_) registration.reset();
  }
  std::vector<std::byte> hello_blob() const {
    std::vector<std::byte> blob;
    std::vector<std::byte> address = worker_.address();
    auto length = static_cast<uint32_t>(address.size());
    put(blob, &length, sizeof(length));
    put(blob, address.data(), address.size());
    for (const auto& registration : registrations_) {
      uint64_t where = registration->address();
      put(blob, &where, sizeof(where));
      length = static_cast<uint32_t>(registration->remote_key().size());
      put(blob, &length, sizeof(length));
      put(blob, registration->remote_key().data(), registration->remote_key().size());
    }
    return blob;
  }
  void fill(uint32_t slot, uint64_t offset, const std::byte* source, const Device& source_device,
            uint64_t bytes) override {
    std::byte* destination = buffers_[slot].data() + offset;
    if (source_device.is_cuda()) {
      copy_bytes(destination, kHost, source, source_device, bytes);
    } else {
      std::memcpy(destination, source, bytes);
    }
  }

 private:
  Buffer buffers_[2];
  uint64_t bucket_bytes_;
  ucx::Worker worker_;  // after the buffers: deregistered and gone before they are freed
  std::unique_ptr<ucx::Registration> registrations_[2];
};

class UcxReceiver final : public ReceiverTransport {
 public:
  UcxReceiver(uint64_t bucket_bytes, std::span<const std::byte> hello_blob)
      : buffers_{Buffer(kHost, bucket_bytes), Buffer(kHost, bucket_bytes)}, offer_(parse_offer(hello_blob)) {
    endpoint_ = worker_.connect(offer_.worker_address, "the ucx update sender");
    for (int slot = 0; slot < 2; ++slot) keys_[slot] = endpoint_->add_remote_key(offer_.keys[slot]);
  }
  void receive(Connection& connection, uint32_t slot, uint64_t bytes, std::chrono::milliseconds timeout,
               const std::string& what) override {
    for (uint64_t done = 0; done < bytes; done += kUcxReadPiece) {
      endpoint_->get(buffers_[slot].data() + done, offer_.addresses[slot] + done, keys_[slot],
                     std::min(kUcxReadPiece, bytes - done), timeout);
    }
    try {
      endpoint_->wait(timeout);
    } catch (const Error& error) {
      WS_FAIL(error.code(), "reading " + what + " from " + connection.peer() + " over ucx: " + error.what());
    }
  }
  const std::byte* slot(uint32_t index) const override { return buffers_[index].data(); }
  Device device() const override { return kHost; }

 private:
  Buffer buffers_[2];
  OfferedBuckets offer_;
  ucx::Worker worker_;
  std::unique_ptr<ucx::Endpoint> endpoint_;  // after the worker: closed before it goes
  uint32_t keys_[2] = {0, 0};
};

}  // namespace

std::unique_ptr<SenderTransport> make_ucx_sender(uint64_t bucket_bytes, std::vector<std::byte>& hello_blob) {
  auto sender = std::make_unique<UcxSender>(bucket_bytes);
  hello_blob = sender->hello_blob();
  return sender;
}

std::unique_ptr<ReceiverTransport> make_ucx_receiver(uint64_t bucket_bytes, std::span<const std::byte> hello_blob) {
  return std::make_unique<UcxReceiver>(bucket_bytes, hello_blob);
}

}  // namespace weightstream::transfer
