// The NCCL transport: the sender is rank 0 of a communicator with every receiver it feeds
// (receiver i is rank i + 1) and broadcasts each bucket once from its device buffer into
// all the receivers' buffers; manifests and answers still travel over each receiver's TCP
// control connection. The sender makes the NCCL unique id and sends it
// in HELLO, so no other rendezvous is needed. Compiled only where NCCL's header was found
// (WS_HAVE_NCCL); nccl_transport_nccl_fallback.cpp otherwise.
//
// libnccl is opened at first use (dlopen), not linked: a process that also holds torch
// must use the one NCCL torch loaded. Linked, the toolkit's libnccl.so.2 came in with
// `import weightstream` and torch, imported after, aborted in free() on the GPU machine.
#include <dlfcn.h>
#include <nccl.h>

#include <cstring>

#include "update/transport.hpp"
#include "device/shared/copies.hpp"
#include "weightstream/device.hpp"

namespace weightstream::transfer {
namespace {

/// The NCCL functions this transport calls, from the libnccl.so.2 the process has (or
/// loads now). Throws Error(kUnsupported) naming the library and dlerror() when absent.
struct NcclApi {
  decltype(&::ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&::ncclCommInitRank) comm_init_rank = nullptr;
  decltype(&::ncclCommDestroy) comm_destroy = nullptr;
  decltype(&::ncclBroadcast) broadcast = nullptr;
  decltype(&::ncclGetErrorString) error_string = nullptr;
  decltype(&::ncclGetLastError) last_error = nullptr;

  static const NcclApi& get() {
    static const NcclApi api = load();
    return api;
  }

 private:
  static NcclApi load() {
    // The one already in the process or on the loader's path first; else the one found
    // at build time (the CUDA toolkit's lib/ is on no default path).
    constexpr const char* kLibrary = "libnccl.so.2";
    void* library = ::dlopen(kLibrary, RTLD_NOW | RTLD_GLOBAL);  // kept open for the process
    std::string reason = library == nullptr ? ::dlerror() : "";
#ifdef WS_NCCL_FALLBACK_PATH
    if (library == nullptr) library = ::dlopen(WS_NCCL_FALLBACK_PATH, RTLD_NOW | RTLD_GLOBAL);
#endif
    WS_EXPECT(library != nullptr, ErrorCode::kUnsupported,
              std::string("the nccl transport cannot load ") + kLibrary + ": " + reason +
                  " (install NCCL, e.g. the nvidia-nccl wheel torch uses, or put it on LD_LIBRARY_PATH)");
    NcclApi api;
    auto bind = [&](auto& function, const char* name) {
      void* symbol = ::dlsym(library, name);
      WS_EXPECT(symbol != nullptr, ErrorCode::kUnsupported,
                std::string("the nccl transport: ") + kLibrary + " has no " + name + " (too old an NCCL?)");
      function = reinterpret_cast<std::remove_reference_t<decltype(function)>>(symbol);
    };
    bind(api.get_unique_id, "ncclGetUniqueId");
    bind(api.comm_init_rank, "ncclCommInitRank");
    bind(api.comm_destroy, "ncclCommDestroy");
    bind(api.broadcast, "ncclBroadcast");
    bind(api.error_string, "ncclGetErrorString");
    bind(api.last_error, "ncclGetLastError");
    return api;
  }
};

constexpr int kSenderRank = 0;

void check_nccl(ncclResult_t result, const Device& device, const std::string& operation) {
  WS_EXPECT(result == ncclSuccess, ErrorCode::kDevice,
            device.name() + ": " + operation + ": " + NcclApi::get().error_string(result) + " (" +
                NcclApi::get().last_error(nullptr) + ")");
}

Device cuda_device(const Device& device) { return device.is_cuda() ? device : Device{Device::Kind::kCuda, 0}; }

/// This process's place in the communicator of a sender and its receivers, and a stream
/// for its collectives, on one GPU.
class Peer {
 public:
  Peer(const Device& device, std::span<const std::byte> id_bytes, int ranks, int rank)
      : device_(device), ranks_(ranks), rank_(rank), stream_(device) {
    WS_EXPECT(id_bytes.size() == sizeof(ncclUniqueId), ErrorCode::kProtocol,
              "the sender's HELLO for nccl carried " + std::to_string(id_bytes.size()) + " bytes of unique id, not " +
                  std::to_string(sizeof(ncclUniqueId)));
    std::memcpy(&id_, id_bytes.data(), sizeof(id_));
  }
  ~Peer() {
    try {
      stream_.synchronize("waiting for the last collective");
    } catch (const Error&) {
      // Destruction goes on: the communicator and the stream are freed either way.
    }
    if (communicator_ != nullptr) NcclApi::get().comm_destroy(communicator_);
  }
  Peer(const Peer&) = delete;
  Peer& operator=(const Peer&) = delete;

  /// Blocks until every rank has joined.
  void join() {
    require_device(device_);
    check_nccl(NcclApi::get().comm_init_rank(&communicator_, ranks_, id_, rank_), device_,
               "ncclCommInitRank (rank " + std::to_string(rank_) + " of " + std::to_string(ranks_) + ")");
  }
  void broadcast(std::byte* buffer, uint64_t bytes) {
    check_nccl(NcclApi::get().broadcast(buffer, buffer, bytes, ncclUint8, kSenderRank, communicator_,
                                        static_cast<cudaStream_t>(stream_.native())),
               device_, "ncclBroadcast of " + std::to_string(bytes) + " bytes");
    stream_.synchronize("waiting for ncclBroadcast");
  }
  DeviceStream& stream() noexcept { return stream_; }

 private:
  Device device_;
  int ranks_;
  int rank_;
  ncclUniqueId id_{};
  ncclComm_t communicator_ = nullptr;
  DeviceStream stream_;
};

class NcclReceiver final : public ReceiverTransport {
 public:
  NcclReceiver(uint64_t bucket_bytes, const Device& device, std::span<const std::byte> id, int ranks, int rank)
      : device_(cuda_device(device)), peer_(device_, id, ranks, rank) {
    for (auto& buffer : buffers_) buffer = Buffer(device_, bucket_bytes);
  }
  void join(std::chrono::milliseconds) override { peer_.join(); }
  void receive(Connection&, uint32_t slot, uint64_t bytes, std::chrono::milliseconds, const std::string&) override {
    peer_.broadcast(buffers_[slot].data(), bytes);
  }
  const std::byte* slot(uint32_t index) const override { return buffers_[index].data(); }
  Device device() const override { return device_; }

 private:
  Device device_;
  Peer peer_;
  Buffer buffers_[2];
};

class NcclSender final : public SenderTransport {
 public:
  NcclSender(uint64_t bucket_bytes, const Device& device, std::span<const std::byte> id, int ranks)
      : device_(cuda_device(device)), peer_(device_, id, ranks, kSenderRank) {
    for (auto& buffer : buffers_) buffer = Buffer(device_, bucket_bytes);
  }
  void join(std::chrono::milliseconds) override { peer_.join(); }
  void fill(uint32_t slot, uint64_t offset, const std::byte* source, const Device& source_device,
            uint64_t bytes) override {
    if (source_device.is_cuda() && !device_settled_) {
      // The copy runs on the peer's stream: first let every kernel the caller queued (on
      // any stream) finish, so a tensor computed just before send() is copied complete.
      synchronize_device(device_, "waiting for the work queued before the bucket's first copy");
      device_settled_ = true;
    }
    peer_.stream().copy_async(buffers_[slot].data() + offset, source, bytes, "copy into bucket buffer " + std::to_string(slot));
  }
  void seal(uint32_t slot, bool) override {
    device_settled_ = false;
    peer_.stream().synchronize("waiting for the copies into bucket buffer " + std::to_string(slot));
  }
  void push(std::span<Connection* const>, uint32_t slot, uint64_t bytes, std::chrono::milliseconds) override {
    peer_.broadcast(buffers_[slot].data(), bytes);  // once, to every receiver
  }

 private:
  Device device_;
  Peer peer_;
  Buffer buffers_[2];
  bool device_settled_ = false;  // the caller's queued work was waited for in this bucket
};

}  // namespace

bool nccl_compiled() noexcept { return true; }

std::vector<std::byte> nccl_unique_id() {
  ncclUniqueId id;
  const NcclApi& api = NcclApi::get();
  ncclResult_t result = api.get_unique_id(&id);
  WS_EXPECT(result == ncclSuccess, ErrorCode::kDevice, std::string("ncclGetUniqueId: ") + api.error_string(result));
  const auto* bytes = reinterpret_cast<const std::byte*>(&id);
  return {bytes, bytes + sizeof(id)};
}

std::unique_ptr<ReceiverTransport> make_nccl_receiver(uint64_t bucket_bytes, const Device& device,
                                                      std::span<const std::byte> unique_id, int ranks, int rank) {
  return std::make_unique<NcclReceiver>(bucket_bytes, device, unique_id, ranks, rank);
}

std::unique_ptr<SenderTransport> make_nccl_sender(uint64_t bucket_bytes, const Device& device,
                                                  std::span<const std::byte> unique_id, int ranks) {
  return std::make_unique<NcclSender>(bucket_bytes, device, unique_id, ranks);
}

}  // namespace weightstream::transfer
