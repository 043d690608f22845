// The ucx update transport: each receiver registers its two bucket buffers (and a word per
// buffer that counts the buckets landed in it) with UCX and offers their remote keys, and a
// secret, with WELCOME. The sender moves each bucket right after its manifest, by the path
// of its endpoint to that receiver (ucx.hpp):
//
// - kRma (lanes with native RMA: RDMA, shared memory, cma): it writes the bucket one-sided
//   (ucp_put) into the receiver's buffer, flushes (remote completion), then bumps the
//   buffer's count.
// - kRendezvous (UCX's tcp, which only emulates puts, at half its message rate): it sends
//   the bucket in pieces as active messages with the secret, the slot, the offset and the
//   bucket's number in their header; a large piece (a tensor, or its part in the bucket)
//   travels as messages of its own. The receiver's UCX worker keeps each piece until the
//   receiver has checked the bucket's manifest and named where its entries land (place()):
//   a message inside one entry that the session takes as it is lands straight in that
//   parameter, any other in the buffer (rendezvous, zero-copy either way), and it counts the
//   bytes landed.
//
// The receiver applies a bucket once its count (or its bytes) says it landed, while the
// sender moves the next one into the other buffer. The sender's push() returns with the
// bucket still moving; the sender turns its worker while it fills the next bucket (every
// MiB) and while it waits for an APPLIED (progress()), and finishes the bucket (on kRma,
// counts it) at the next push() or at drain(). A progress thread on the receiver serves
// both paths (UCX's tcp transport needs the target to progress even for puts).
#include <poll.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <vector>

#include "device/shared/copies.hpp"
#include "update/transport.hpp"
#include "net/ucx.hpp"

namespace weightstream::transfer {
namespace {

using Clock = std::chrono::steady_clock;
const Device kHost{};

/// Pieces of one bucket written at once: several in flight keep the link busy.
constexpr uint64_t kUcxPiece = 8ull << 20;

/// How much of a bucket the sender copies between two turns of its worker's progress: small
/// enough that the link (a socket's buffer drains in a few milliseconds) does not go idle.
constexpr uint64_t kFillStep = 1ull << 20;

/// The smallest piece the rendezvous path sends from where it lies (take_in_place) rather
/// than copying it into the bucket: below it a message of its own costs more than the copy.
constexpr uint64_t kInPlaceMinimum = 256ull << 10;

/// WELCOME blob: u32 length + worker address, then for bucket 0, bucket 1 and the counts:
/// u64 address, u32 length + remote key; then the 16-byte secret of the rendezvous path and
/// the receiver's UCX tcp receive segment size (u64), which the sender's must equal.
struct Offer {
  std::vector<std::byte> worker_address;
  uint64_t addresses[3] = {0, 0, 0};
  std::vector<std::byte> keys[3];
  ucx::Secret secret{};
  uint64_t segment_bytes = 0;
};

/// The header of a bucket piece on the rendezvous path: its buffer, where in the bucket it
/// belongs, and which bucket it is (counted from 1 on the connection), so that a receiver
/// keeps a piece that comes before it has placed its bucket.
struct Piece {
  uint32_t slot = 0;
  uint32_t reserved = 0;
  uint64_t offset = 0;
  uint64_t bucket = 0;
};

void put_bytes(std::vector<std::byte>& out, const void* data, size_t bytes) {
  const auto* begin = static_cast<const std::byte*>(data);
  out.insert(out.end(), begin, begin + bytes);
}

std::vector<std::byte> encode_offer(const Offer& offer) {
  std::vector<std::byte> blob;
  auto length = static_cast<uint32_t>(offer.worker_address.size());
  put_bytes(blob, &length, sizeof(length));
  put_bytes(blob, offer.worker_address.data(), offer.worker_address.size());
  for (int i = 0; i < 3; ++i) {
    put_bytes(blob, &offer.addresses[i], sizeof(uint64_t));
    length = static_cast<uint32_t>(offer.keys[i].size());
    put_bytes(blob, &length, sizeof(length));
    put_bytes(blob, offer.keys[i].data(), offer.keys[i].size());
  }
  put_bytes(blob, offer.secret.data(), offer.secret.size());
  put_bytes(blob, &offer.segment_bytes, sizeof(offer.segment_bytes));
  return blob;
}

Offer parse_offer(std::span<const std::byte> blob, const std::string& who) {
  size_t at = 0;
  auto take = [&](void* out, size_t bytes) {
    WS_EXPECT(bytes <= blob.size() - at, ErrorCode::kProtocol, "the ucx WELCOME of " + who + " is truncated");
    std::memcpy(out, blob.data() + at, bytes);
    at += bytes;
  };
  auto take_bytes = [&](std::vector<std::byte>& out) {
    uint32_t length = 0;
    take(&length, sizeof(length));
    WS_EXPECT(length <= blob.size() - at, ErrorCode::kProtocol, "the ucx WELCOME of " + who + " is truncated");
    out.assign(blob.begin() + static_cast<ptrdiff_t>(at), blob.begin() + static_cast<ptrdiff_t>(at + length));
    at += length;
  };
  Offer offer;
  take_bytes(offer.worker_address);
  for (int i = 0; i < 3; ++i) {
    take(&offer.addresses[i], sizeof(uint64_t));
    take_bytes(offer.keys[i]);
  }
  take(offer.secret.data(), offer.secret.size());
  take(&offer.segment_bytes, sizeof(offer.segment_bytes));
  WS_EXPECT(at == blob.size(), ErrorCode::kProtocol, "the ucx WELCOME of " + who + " has trailing bytes");
  return offer;
}

class UcxReceiver final : public ReceiverTransport {
 public:
  explicit UcxReceiver(uint64_t bucket_bytes)
      : buffers_{Buffer(kHost, bucket_bytes), Buffer(kHost, bucket_bytes), Buffer(kHost, 64)} {
    std::memset(buffers_[2].data(), 0, 64);
    for (int i = 0; i < 3; ++i) {
      registrations_[i] = worker_.register_memory(buffers_[i].data(), i < 2 ? bucket_bytes : 64);
    }
    // Runs on the progress thread: a piece lands inside its bucket (in the buffer, or where
    // place() put that range of it), once its bucket is placed.
    auto place = [this, bucket_bytes](std::span<const std::byte> header, uint64_t bytes) -> ucx::Worker::Landing {
      Piece piece;
      if (header.size() != sizeof(piece)) return {};
      std::memcpy(&piece, header.data(), sizeof(piece));
      if (piece.slot > 1 || piece.offset > bucket_bytes || bytes > bucket_bytes - piece.offset) return {};
      if (piece.bucket > placed_through_.load(std::memory_order_acquire)) return {.later = true};
      Table& table = tables_[piece.slot];
      if (piece.bucket == table.bucket && bytes > 0) {
        auto after = std::upper_bound(table.placements.begin(), table.placements.end(), piece.offset,
                                      [](uint64_t offset, const Placement& placement) { return offset < placement.offset; });
        if (after != table.placements.begin()) {
          const Placement& placement = *std::prev(after);
          if (piece.offset + bytes <= placement.offset + placement.bytes) {
            table.routed[static_cast<size_t>(std::prev(after) - table.placements.begin())] += bytes;
            return {.destination = placement.destination + (piece.offset - placement.offset),
                    .device = placement.device};
          }
        }
      }
      return {.destination = buffers_[piece.slot].data() + piece.offset};
    };
    auto landed = [this](std::span<const std::byte> header, uint64_t bytes, bool ok) {
      Piece piece;
      std::memcpy(&piece, header.data(), sizeof(piece));
      if (!ok) failed_.store(true, std::memory_order_release);
      if (ok) landed_bytes_[piece.slot].fetch_add(bytes, std::memory_order_release);
    };
    worker_.accept_messages(secret_, place, landed);
    worker_.start_progress();
  }
  ~UcxReceiver() override {
    worker_.stop_progress();
    for (auto& registration : registrations_) registration.reset();
  }
  std::vector<std::byte> welcome_blob() const override {
    Offer offer;
    offer.worker_address = worker_.address();
    for (int i = 0; i < 3; ++i) {
      offer.addresses[i] = registrations_[i]->address();
      offer.keys[i] = registrations_[i]->remote_key();
    }
    offer.secret = secret_;
    offer.segment_bytes = ucx::receive_segment_bytes();
    return encode_offer(offer);
  }
  void receive(Connection& connection, uint32_t slot, uint64_t bytes, std::chrono::milliseconds timeout,
               const std::string& what) override {
    // The sender takes one path per receiver: the count of buckets it wrote (rma) or the
    // bytes this worker received (rendezvous) says the bucket has landed.
    const uint64_t due = ++landed_[slot];
    due_bytes_[slot] += bytes;
    std::atomic_ref<uint64_t> count(reinterpret_cast<uint64_t*>(buffers_[2].data())[slot]);
    const auto deadline = Clock::now() + timeout;
    for (unsigned spins = 0; count.load(std::memory_order_acquire) < due &&
                             landed_bytes_[slot].load(std::memory_order_acquire) < due_bytes_[slot];
         ++spins) {
      WS_EXPECT(!failed_.load(std::memory_order_acquire), ErrorCode::kNetwork,
                "a piece of " + what + " from " + connection.peer() + " failed to land over ucx");
      if (spins < 2000) continue;
      WS_EXPECT(Clock::now() < deadline, ErrorCode::kTimeout,
                what + " from " + connection.peer() + " did not land over ucx within " +
                    std::to_string(timeout.count()) + " ms");
      // The sender may already have written the next manifest (on the rendezvous path its
      // send ends before this worker has counted the bytes), so only the connection's end
      // is an error here; an ERROR message is read once the bucket is due.
      WS_EXPECT(!connection.closed(), ErrorCode::kNetwork,
                connection.peer() + " stopped (or failed) while " + what + " was in flight over ucx");
      pollfd none{-1, 0, 0};
      (void)::poll(&none, 0, 1);
    }
  }
  bool places() const override { return true; }
  bool places_on(const Device& device) const override { return !device.is_cuda() || worker_.moves_cuda_memory(); }
  void place(uint32_t slot, std::vector<Placement> placements) override {
    // The pieces of the bucket placed before this one in `slot` have all landed (receive()),
    // so none reads the table now; those of this bucket are kept until it is published.
    WS_EXPECT(std::ranges::is_sorted(placements, {}, &Placement::offset), ErrorCode::kInternal,
              "ucx receiver: placements not in the order of the bucket");
    Table& table = tables_[slot];
    table.bucket = ++buckets_placed_;
    table.routed.assign(placements.size(), 0);
    table.placements = std::move(placements);
    placed_through_.store(table.bucket, std::memory_order_release);
    worker_.wake();
  }
  std::vector<bool> placed(uint32_t slot) const override {
    const Table& table = tables_[slot];
    std::vector<bool> result(table.placements.size());
    for (size_t i = 0; i < result.size(); ++i) {
      const uint64_t routed = table.routed[i];
      WS_EXPECT(routed == 0 || routed == table.placements[i].bytes, ErrorCode::kProtocol,
                "bytes " + std::to_string(table.placements[i].offset) + "+" + std::to_string(table.placements[i].bytes) +
                    " of bucket " + std::to_string(table.bucket) + " of the connection came in pieces that straddle " +
                    "its entries: " + std::to_string(routed) + " of them landed in place, the rest in the buffer");
      result[i] = routed != 0;
    }
    return result;
  }
  const std::byte* slot(uint32_t index) const override { return buffers_[index].data(); }
  Device device() const override { return kHost; }

 private:
  /// Where the pieces of the bucket last placed in a buffer land.
  struct Table {
    uint64_t bucket = 0;  // counted from 1 on the connection; 0: none yet
    std::vector<Placement> placements;  // by offset, disjoint
    std::vector<uint64_t> routed;       // bytes of each landed (or landing) at its destination: the progress thread's
  };
  Buffer buffers_[3];  // the two buckets, then the counts of buckets landed in each
  ucx::Secret secret_ = ucx::random_secret();
  std::atomic<uint64_t> landed_bytes_[2] = {0, 0};  // rendezvous: bytes received into each bucket
  std::atomic<bool> failed_{false};                 // rendezvous: a piece failed to land
  ucx::Worker worker_;
  std::unique_ptr<ucx::Registration> registrations_[3];
  Table tables_[2];
  uint64_t buckets_placed_ = 0;                // place() calls: the last bucket placed
  std::atomic<uint64_t> placed_through_{0};   // published to the progress thread
  uint64_t landed_[2] = {0, 0};     // buckets due in each buffer
  uint64_t due_bytes_[2] = {0, 0};  // bytes due in each buffer
};

class UcxSender final : public SenderTransport {
 public:
  UcxSender(uint64_t bucket_bytes, std::span<const std::vector<std::byte>> welcome_blobs, UcxPath path)
      : buffers_{Buffer(kHost, bucket_bytes), Buffer(kHost, bucket_bytes)} {
    for (int i = 0; i < 2; ++i) registrations_[i] = worker_.register_memory(buffers_[i].data(), bucket_bytes);
    for (size_t i = 0; i < welcome_blobs.size(); ++i) {
      Target& target = targets_.emplace_back();
      const std::string who = "update receiver " + std::to_string(i);
      target.offer = parse_offer(welcome_blobs[i], who);
      ucx::check_receive_segments(target.offer.segment_bytes, who);  // before a byte can reach it
      target.endpoint = worker_.connect(target.offer.worker_address, who, path, target.offer.secret);
      for (int k = 0; k < 3; ++k) target.keys[k] = target.endpoint->add_remote_key(target.offer.keys[k]);
    }
  }
  void fill(uint32_t slot, uint64_t offset, const std::byte* source, const Device& source_device,
            uint64_t bytes) override {
    std::byte* destination = buffers_[slot].data() + offset;
    // A large piece travels as messages of its own, so that a receiver may land it where it
    // belongs (a message spanning several pieces lands in the receiver's buffer).
    if (bytes >= kInPlaceMinimum) own_messages_[slot].push_back({offset, bytes, destination, nullptr});
    if (source_device.is_cuda()) {
      copy_bytes(destination, kHost, source, source_device, bytes);
      return;
    }
    // The previous bucket moves while this one fills: UCX has no thread of its own, so the
    // copy stops every kFillStep to let the worker feed the link.
    for (uint64_t done = 0; done < bytes; done += kFillStep) {
      std::memcpy(destination + done, source + done, std::min(kFillStep, bytes - done));
      (void)progress();
    }
  }
  bool take_in_place(uint32_t slot, uint64_t offset, const std::byte* source, const Device& source_device,
                     uint64_t bytes, std::shared_ptr<const void> keepalive) override {
    // Only as messages: a put from memory UCX has not registered would be registered on an
    // RDMA NIC's lanes, where a read-only file mapping may be refused. GPU memory only where
    // the worker moves it (a CUDA-aware UCX): then it never crosses the host.
    if (bytes < kInPlaceMinimum) return false;
    if (source_device.is_cuda() && !worker_.moves_cuda_memory()) return false;
    for (const Target& target : targets_) {
      if (target.endpoint->path() != ucx::Path::kRendezvous) return false;
    }
    own_messages_[slot].push_back({offset, bytes, source, std::move(keepalive), source_device});
    (void)progress();  // the bucket before moves on while this one is gathered
    return true;
  }
  void seal(uint32_t slot, bool filled) override {
    // Work the caller queued on a GPU before the bucket was sealed is done before UCX reads
    // the bucket's pieces there.
    std::optional<Device> synchronized;
    for (const OwnMessages& piece : own_messages_[slot]) {
      if (!piece.device.is_cuda() || synchronized == piece.device) continue;
      synchronize_device(piece.device, "waiting for the work queued before the bucket was sealed");
      synchronized = piece.device;
    }
  }
  void push(std::span<Connection* const> connections, uint32_t slot, uint64_t bytes,
            std::chrono::milliseconds timeout) override {
    drain(connections, timeout);  // the previous bucket first: a receiver takes buckets in order
    connections_ = connections;
    pending_slot_ = slot;
    pending_ = true;
    ++buckets_pushed_;
    // The bucket's bytes in order: the large pieces as messages of their own (those
    // take_in_place() left where they lie, and large fills), and between them what fill()
    // copied into the buffer (alignment gaps too).
    auto send = [&](uint64_t offset, const std::byte* source, uint64_t length, const ucx::Registration* registration,
                    ucx::Memory memory = ucx::Memory::kHost) {
      for (uint64_t done = 0; done < length; done += kUcxPiece) {
        send_piece(slot, offset + done, source + done, std::min(kUcxPiece, length - done), registration, connections,
                   timeout, memory);
      }
    };
    std::vector<OwnMessages>& own = own_messages_[slot];
    std::sort(own.begin(), own.end(), [](const OwnMessages& a, const OwnMessages& b) { return a.offset < b.offset; });
    const ucx::Registration* buffer_registration = registrations_[slot].get();
    uint64_t sent = 0;
    for (const OwnMessages& piece : own) {
      if (piece.offset > sent) send(sent, buffers_[slot].data() + sent, piece.offset - sent, buffer_registration);
      const bool in_buffer = piece.source == buffers_[slot].data() + piece.offset;
      send(piece.offset, piece.source, piece.bytes, in_buffer ? buffer_registration : nullptr,
           piece.device.is_cuda() ? ucx::Memory::kCuda : ucx::Memory::kHost);
      sent = piece.offset + piece.bytes;
    }
    if (bytes > sent) send(sent, buffers_[slot].data() + sent, bytes - sent, buffer_registration);
    moving_ = std::move(own);  // what lies outside the buffer is kept until the bucket has landed (drain)
    own.clear();
  }
  void drain(std::span<Connection* const> connections, std::chrono::milliseconds timeout) override {
    if (!pending_) return;
    pending_ = false;  // a failure below ends the update: the bucket is not finished twice
    const uint32_t slot = pending_slot_;
    for (size_t i = 0; i < targets_.size(); ++i) {
      Target& target = targets_[i];
      if (target.endpoint->path() == ucx::Path::kRendezvous) {
        guarded(connections, i, [&] { target.endpoint->wait(timeout); });  // the receiver holds every piece
        continue;
      }
      guarded(connections, i, [&] { target.endpoint->flush(timeout); });
      ++target.counts[slot];
      guarded(connections, i, [&] {
        target.endpoint->put(reinterpret_cast<const std::byte*>(&target.counts[slot]),
                             target.offer.addresses[2] + slot * sizeof(uint64_t), target.keys[2], sizeof(uint64_t),
                             timeout);
        target.endpoint->flush(timeout);
      });
    }
    moving_.clear();  // every receiver holds the bucket: its in-place pieces may go
  }
  std::vector<std::string> paths() const override {
    std::vector<std::string> names;
    for (const Target& target : targets_) {
      names.push_back(std::string(ucx::path_name(target.endpoint->path())) + " (" + target.endpoint->transports() + ")");
    }
    return names;
  }

 private:
  struct Target {
    Offer offer;
    std::unique_ptr<ucx::Endpoint> endpoint;
    uint32_t keys[3] = {0, 0, 0};
    uint64_t counts[2] = {0, 0};
  };
  /// A large piece of a bucket, sent as messages of its own: from where it lies
  /// (take_in_place, kept alive by `keepalive`) or from the buffer (a large fill).
  struct OwnMessages {
    uint64_t offset = 0;  ///< in the bucket
    uint64_t bytes = 0;
    const std::byte* source = nullptr;
    std::shared_ptr<const void> keepalive;  ///< null for a fill
    Device device;  ///< where `source` lies (a GPU's memory travels GPU to GPU)
  };
  /// Starts `length` bytes at `source` towards every receiver as bytes [offset, offset +
  /// length) of its buffer `slot`.
  void send_piece(uint32_t slot, uint64_t offset, const std::byte* source, uint64_t length,
                  const ucx::Registration* registration, std::span<Connection* const> connections,
                  std::chrono::milliseconds timeout, ucx::Memory memory) {
    for (size_t i = 0; i < targets_.size(); ++i) {
      Target& target = targets_[i];
      guarded(connections, i, [&] {
        if (target.endpoint->path() == ucx::Path::kRma) {
          target.endpoint->put(source, target.offer.addresses[slot] + offset, target.keys[slot], length, timeout);
        } else {
          const Piece piece{slot, 0, offset, buckets_pushed_};
          target.endpoint->send_message(std::as_bytes(std::span(&piece, 1)), source, length, registration, timeout,
                                        memory);
        }
      });
    }
  }
  bool progress() override {
    if (!pending_) return false;
    bool moving = false;
    for (size_t i = 0; i < targets_.size(); ++i) {
      if (!targets_[i].endpoint->busy()) continue;
      guarded(connections_, i, [&] { targets_[i].endpoint->progress(); });
      moving = moving || targets_[i].endpoint->busy();
    }
    return moving;
  }
  template <typename Step>
  static void guarded(std::span<Connection* const> connections, size_t i, Step&& step) {
    try {
      step();
    } catch (const Error& error) {
      const std::string peer = i < connections.size() ? connections[i]->peer() : "an update receiver";
      WS_FAIL(error.code(), "writing a bucket to " + peer + " over ucx: " + error.what());
    }
  }
  // Declared first, so the pieces they keep outlive every endpoint that may still read them.
  std::vector<OwnMessages> own_messages_[2];  // the large pieces of the bucket gathered in each buffer
  std::vector<OwnMessages> moving_;           // those of the bucket push() started, until drain()
  uint64_t buckets_pushed_ = 0;               // push() calls: the bucket being pushed, counted from 1
  Buffer buffers_[2];
  ucx::Worker worker_;
  std::unique_ptr<ucx::Registration> registrations_[2];  // the buckets, sent from without registering per message
  std::vector<Target> targets_;  // after the worker: endpoints close before it goes
  bool pending_ = false;         // a bucket push() started has not yet reached every receiver
  uint32_t pending_slot_ = 0;    // its buffer
  std::span<Connection* const> connections_;  // of the pending bucket, to name a receiver in errors
};

}  // namespace

std::unique_ptr<SenderTransport> make_ucx_sender(uint64_t bucket_bytes,
                                                 std::span<const std::vector<std::byte>> welcome_blobs, UcxPath path) {
  return std::make_unique<UcxSender>(bucket_bytes, welcome_blobs, path);
}

std::unique_ptr<ReceiverTransport> make_ucx_receiver(uint64_t bucket_bytes) {
  return std::make_unique<UcxReceiver>(bucket_bytes);
}

}  // namespace weightstream::transfer
