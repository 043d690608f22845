#pragma once
// The transports of the update protocol: where the two bucket buffers live and how a
// bucket's bytes reach the receiver. Control messages always travel over the Connection;
// a transport only moves bucket bytes. Host transports (shm, TCP) are in transport.cpp;
// CUDA IPC in cuda_ipc_transport_cuda.cpp and NCCL in nccl_transport_nccl.cpp, each with a
// fallback twin that throws Error(kUnsupported) in builds without the library.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "net/socket.hpp"
#include "update/wire.hpp"
#include "weightstream/device.hpp"
#include "weightstream/transfer.hpp"

namespace weightstream::transfer {

/// The receiver's end: owns (or maps) the two bucket buffers it applies from.
class ReceiverTransport {
 public:
  virtual ~ReceiverTransport() = default;
  /// Bytes sent to the sender with WELCOME (the CUDA IPC handles of both buffers).
  virtual std::vector<std::byte> welcome_blob() const { return {}; }
  /// A descriptor passed with WELCOME (the shm memfd), or -1.
  virtual int welcome_fd() const { return -1; }
  /// Called once WELCOME is sent: joins the sender where the transport needs both sides
  /// at once (the NCCL communicator).
  virtual void join(std::chrono::milliseconds timeout) {}
  /// Makes `bytes` of the bucket in `slot` present in the buffer: TCP reads them from the
  /// connection, NCCL receives the broadcast; shared-memory transports have them already.
  virtual void receive(Connection& connection, uint32_t slot, uint64_t bytes, std::chrono::milliseconds timeout,
                       const std::string& what) {}
  /// A range of the next bucket that may land straight at `destination` (in the parameters)
  /// instead of in the buffer: bytes [offset, offset + bytes) of the bucket.
  struct Placement {
    uint64_t offset = 0;
    uint64_t bytes = 0;
    std::byte* destination = nullptr;
    Device device{};  ///< where `destination` lies
  };
  /// Whether a bucket's bytes may land where the receiver names (place()) rather than in
  /// its buffer: ucx's messages, each received where it belongs.
  virtual bool places() const { return false; }
  /// Whether place() may name destinations in the memory of `device`: the host's always
  /// where places(); a GPU's where the transport moves its memory itself (a CUDA-aware UCX).
  virtual bool places_on(const Device& device) const { return places() && !device.is_cuda(); }
  /// Names, before receive() of the next bucket (into buffer `slot`), where ranges of it
  /// land; its bytes wait (UCX keeps them at the sender) until this is called, so nothing
  /// lands before the receiver has checked the bucket's manifest. An empty list: all in the
  /// buffer. Called once for every bucket with bytes when places().
  virtual void place(uint32_t slot, std::vector<Placement> placements) {}
  /// After receive(): for each placement of the bucket in `slot`, whether its bytes landed
  /// at its destination (true) or in the buffer (false). Throws Error(kProtocol) for a
  /// placement whose bytes landed in part at each.
  virtual std::vector<bool> placed(uint32_t slot) const { return {}; }
  /// Start of buffer `slot` (0 or 1).
  virtual const std::byte* slot(uint32_t index) const = 0;
  /// Where the buffers live.
  virtual Device device() const = 0;
  /// Opens a region the sender shares for reading in place (CUDA IPC) as region `id` of the
  /// current update; a region an earlier update of the connection shared with the same
  /// handle is still open and is reused. Transports without shared regions throw
  /// Error(kProtocol).
  virtual void open_region(const SharedRegion& region);
  /// The bytes of the current update's region `id`; empty when there is none.
  virtual std::span<const std::byte> region(uint32_t id) const { return {}; }
  /// Ends the current update (its copies have landed): regions it did not announce are
  /// closed, those it did stay open for the next update; the next update numbers its
  /// regions from 0 again. All close with the transport.
  virtual void end_update() {}
};

/// Where the receiver finds bytes of the sender's in place: shared region `region`, at
/// `offset` within it.
struct RegionPlace {
  uint32_t region = 0;
  uint64_t offset = 0;
};

/// The sender's end: fills the buffers and hands them over.
class SenderTransport {
 public:
  virtual ~SenderTransport() = default;
  /// Called once WELCOME has arrived: joins the receiver (NCCL).
  virtual void join(std::chrono::milliseconds timeout) {}
  /// Called at each START: forgets the regions of the previous update (the receiver closed
  /// them; the caller may have freed their memory since).
  virtual void begin_update() {}
  /// Copies `bytes` from `source` (on `source_device`) to `offset` of buffer `slot`. The
  /// copy may still be in flight when this returns; seal() waits for it.
  virtual void fill(uint32_t slot, uint64_t offset, const std::byte* source, const Device& source_device,
                    uint64_t bytes) = 0;
  /// Waits until every fill of `slot` has landed, before its manifest goes out; called for
  /// every bucket (with `filled` false when it has no buffer bytes), so a device transport
  /// also waits here for the work queued before on the sender's GPU: a tensor computed just
  /// before send() is read complete, whether copied or shared.
  virtual void seal(uint32_t slot, bool filled) {}
  /// Takes `bytes` at `source` (memory of `source_device`, valid and unchanged until the
  /// update finishes and while `keepalive`, when set, lives) as bytes [offset, offset +
  /// bytes) of buffer `slot` without copying them there: they travel from where they are
  /// (ucx's rendezvous; GPU memory GPU to GPU where the transport moves it). False: not
  /// taken, fill() them instead.
  virtual bool take_in_place(uint32_t slot, uint64_t offset, const std::byte* source, const Device& source_device,
                             uint64_t bytes, std::shared_ptr<const void> keepalive) {
    return false;
  }
  /// Shares the allocation holding `bytes` at `data` (on `device`) so the receiver reads
  /// them in place: where they are, with the region's announcement appended to `announce`
  /// when it is shared for the first time. std::nullopt: the bytes travel in a bucket (host
  /// transports; device memory that cannot be shared or is too small to be worth opening).
  virtual std::optional<RegionPlace> share(const std::byte* data, const Device& device, uint64_t bytes,
                                           std::vector<SharedRegion>& announce) {
    return std::nullopt;
  }
  /// Moves the bucket's bytes to every receiver after its BUCKET message (TCP writes them on
  /// each connection, NCCL broadcasts once to all; ucx starts the move and returns, and the
  /// bucket has reached every receiver by the next push() or drain()).
  virtual void push(std::span<Connection* const> connections, uint32_t slot, uint64_t bytes,
                    std::chrono::milliseconds timeout) {}
  /// Moves along, without waiting, a bucket push() left moving; true while one still is. The
  /// sender calls it while it waits for a receiver's APPLIED, so the next bucket keeps moving
  /// meanwhile (ucx: UCX moves bytes over tcp only while this process turns its worker).
  virtual bool progress() { return false; }
  /// Waits until every bucket push() started has reached every receiver. A transport whose
  /// push() returns with the bytes still moving (ucx: they move while the next bucket
  /// fills) finishes them here; called before FINISH and when the caller flushes.
  virtual void drain(std::span<Connection* const> connections, std::chrono::milliseconds timeout) {}
  /// How the bytes travel to each receiver, where the transport chooses per receiver (ucx:
  /// "rma" or "rendezvous", UpdateSender::paths()); empty otherwise.
  virtual std::vector<std::string> paths() const { return {}; }
};

/// The HELLO blob a sender of `kind` offers (the NCCL unique id; empty otherwise).
std::vector<std::byte> sender_hello_blob(TransportKind kind);

/// Whether one sender may feed several receivers at once over `kind` (TCP writes each its
/// own stream, NCCL broadcasts to all, UCX receivers each read the same buckets; shared
/// memory and CUDA IPC buffers are per receiver).
bool feeds_several(TransportKind kind) noexcept;

/// The receiver's transport for a sender that asked for `bucket_bytes` and feeds
/// `receivers` receivers, this one at `receiver_index`.
std::unique_ptr<ReceiverTransport> make_receiver_transport(TransportKind kind, uint64_t bucket_bytes,
                                                           const Device& device, std::span<const std::byte> hello_blob,
                                                           uint32_t receivers, uint32_t receiver_index);
/// The sender's transport for `receivers` receivers, given what the first one sent with WELCOME.
std::unique_ptr<SenderTransport> make_sender_transport(const SenderOptions& options, uint32_t receivers,
                                                       std::span<const std::byte> hello_blob,
                                                       std::span<const std::byte> welcome_blob, FileDescriptor passed_fd);

// CUDA IPC (cuda_ipc_transport_cuda.cpp, or its fallback).
std::unique_ptr<ReceiverTransport> make_cuda_ipc_receiver(uint64_t bucket_bytes, const Device& device);
std::unique_ptr<SenderTransport> make_cuda_ipc_sender(const SenderOptions& options,
                                                      std::span<const std::byte> welcome_blob);
// UCX (ucx_transport.cpp over the ucx.hpp shim). Each receiver's WELCOME offers its
// registered buckets; the sender writes into every receiver's, so it needs every WELCOME.
std::unique_ptr<SenderTransport> make_ucx_sender(uint64_t bucket_bytes,
                                                 std::span<const std::vector<std::byte>> welcome_blobs, UcxPath path);
std::unique_ptr<ReceiverTransport> make_ucx_receiver(uint64_t bucket_bytes);
// NCCL (nccl_transport_nccl.cpp, or its fallback).
bool nccl_compiled() noexcept;
std::vector<std::byte> nccl_unique_id();
// NCCL ranks: the sender is rank 0 of `ranks`, receiver i is rank i + 1.
std::unique_ptr<ReceiverTransport> make_nccl_receiver(uint64_t bucket_bytes, const Device& device,
                                                      std::span<const std::byte> unique_id, int ranks, int rank);
std::unique_ptr<SenderTransport> make_nccl_sender(uint64_t bucket_bytes, const Device& device,
                                                  std::span<const std::byte> unique_id, int ranks);

}  // namespace weightstream::transfer
