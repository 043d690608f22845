// UpdateSender: packs tensors into two alternating buckets and sends each with its
// manifest; waits only when both buckets are with the receiver.
#include <poll.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "base/parallel.hpp"
#include "update/delta.hpp"
#include "net/handshake.hpp"
#include "net/socket.hpp"
#include "update/transport.hpp"
#include "update/wire.hpp"
#include "weightstream/transfer.hpp"

namespace weightstream {
namespace {

using Clock = std::chrono::steady_clock;
using namespace transfer;

/// Pieces start on this boundary inside a bucket, so device copies and dtype conversions
/// read aligned memory.
constexpr uint64_t kPieceAlignment = 256;

/// An update's first bucket holds 1/2^kRampSteps of the bucket size, each next one twice
/// as much up to the full size: the receiver starts applying after a few tensors instead of
/// a whole bucket's worth (a 1 GiB bucket of 1.6 MB tensors is 600 tensors of sender and
/// receiver work before the first copy could start). Never below kRampFloor.
constexpr unsigned kRampSteps = 4;
constexpr uint64_t kRampFloor = 1ull << 20;

/// Names listed in a message: the first few, then how many more.
constexpr size_t kNamesListed = 20;

std::string listed(const std::vector<std::string>& names) {
  std::string text;
  for (size_t i = 0; i < names.size() && i < kNamesListed; ++i) text += (i ? ", " : "") + names[i];
  if (names.size() > kNamesListed) text += " and " + std::to_string(names.size() - kNamesListed) + " more";
  return text;
}

std::string described(Dtype dtype, std::span<const int64_t> shape) {
  return std::string(dtype_name(dtype)) + " " + shape_text(shape);
}

}  // namespace

std::vector<DeclaredTensor> declared_tensors(std::span<const TensorView> tensors) {
  std::vector<DeclaredTensor> manifest;
  std::unordered_map<std::string_view, size_t> index;  // keys view the callers' names
  for (const TensorView& tensor : tensors) {
    auto [found, added] = index.try_emplace(tensor.name, manifest.size());
    if (added) {
      manifest.push_back({std::string(tensor.name), tensor.dtype, {tensor.shape.begin(), tensor.shape.end()}});
      continue;
    }
    const DeclaredTensor& first = manifest[found->second];
    WS_EXPECT(first.dtype == tensor.dtype && std::ranges::equal(first.shape, tensor.shape), ErrorCode::kInvalidArgument,
              "tensor " + std::string(tensor.name) + " comes as " + described(tensor.dtype, tensor.shape) +
                  " after a piece as " + described(first.dtype, first.shape));
  }
  return manifest;
}

struct UpdateSender::State {
  /// One receiver this sender feeds: its control connection and the bucket each buffer
  /// holds there until it answers APPLIED.
  struct Link {
    std::string address;
    Connection connection;
    std::optional<uint64_t> in_flight[2];
    /// A delta's: the windows this receiver holds of each declared tensor (its ACCEPTED), and
    /// the digests of them in the tensors sent as changed elements (its FINISH).
    std::vector<std::vector<HeldWindow>> held;
    std::vector<std::pair<uint32_t, uint64_t>> digests;
    std::string receiver() const { return "update receiver at " + address; }
  };

  SenderOptions options;
  std::vector<Link> links;
  std::vector<Connection*> connections;          // of every link, for the transport's push
  std::unique_ptr<SenderTransport> transport;
  bool open = false;    // an update is between start() and finish()
  bool delta = false;   // the open update is a delta update
  bool broken = false;  // an update failed: the connections are in an unknown state
  uint32_t slot = 0;                             // the buffer the current bucket fills
  bool slot_claimed = false;                     // the current bucket has bytes in `slot`
  uint64_t next_index = 0;
  BucketManifest current;
  uint64_t current_shared_bytes = 0;             // bytes the current bucket shares in place
  // Tensor bytes the current bucket's changed elements stand for (a delta update): it is sent
  // once they reach its limit, so the receiver applies a delta bucket by bucket as the sender
  // encodes it instead of after the whole of it.
  uint64_t current_covered_bytes = 0;

  /// A tensor the open update declared, and how much of it has been sent.
  struct Declared {
    DeclaredTensor tensor;
    uint64_t bytes = 0;  ///< its whole size
    uint64_t sent = 0;   ///< bytes sent so far (pieces come in order)
    bool begun = false;  ///< some piece was sent (a tensor of 0 bytes is whole once sent)
  };
  std::vector<Declared> declared;
  /// Index into `declared` by name; the keys view its names (never resized once indexed).
  std::unordered_map<std::string_view, size_t> declared_index;
  /// A delta's: the elements of each declared tensor that some receiver holds (the union of
  /// the links' windows), the only ones compared and sent.
  std::vector<TensorWindows> held;

  /// Takes each receiver's windows from its ACCEPTED of a delta (checked against the manifest:
  /// Error(kProtocol) naming the receiver for a window outside its tensor) and joins them.
  void take_windows(std::span<const DeclaredTensor> manifest);
  /// The digests of `tensor`'s windows at each receiver (its index `index` in the manifest).
  std::vector<uint64_t> link_digests(size_t index, const TensorView& tensor) const;

  /// The declared tensors not sent whole, with how much of each was sent.
  std::vector<std::string> unsent() const {
    std::vector<std::string> names;
    for (const Declared& entry : declared) {
      if (entry.begun && entry.sent == entry.bytes) continue;
      names.push_back(entry.tensor.name + (entry.begun ? " (" + std::to_string(entry.sent) + " of " +
                                                             std::to_string(entry.bytes) + " bytes)"
                                                       : ""));
    }
    return names;
  }

  /// Tells every receiver that the update is abandoned, best effort (it may be gone).
  void abandon(const std::string& reason) {
    Message message;
    message.type = MessageType::kError;
    message.code = ErrorCode::kInvalidArgument;
    message.text = message_text(reason);
    for (Link& link : links) {
      try {
        send_message(link.connection, message, std::chrono::milliseconds(1000));
      } catch (const Error&) {
      }
    }
    // Then waits, briefly, for each receiver to read it and hang up, discarding what it still
    // says (a bucket's APPLIED): closing first resets the connection under a receiver that is
    // acknowledging a bucket, and that receiver would report the reset instead of the reason.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(1000);
    for (Link& link : links) {
      try {
        for (;;) {
          const auto left =
              std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
          if (left.count() <= 0) break;
          receive_message(link.connection, left, "the receiver's hang-up after the abandoned update");
        }
      } catch (const Error&) {
      }
    }
  }

  std::string receivers() const {
    if (links.size() == 1) return links.front().receiver();
    std::string text = std::to_string(links.size()) + " update receivers (";
    for (size_t i = 0; i < links.size(); ++i) text += (i ? ", " : "") + links[i].address;
    return text + ")";
  }

  /// The bytes the current bucket may hold (see kRampSteps).
  uint64_t bucket_limit() const {
    const uint64_t full = options.bucket_bytes;
    const unsigned step = static_cast<unsigned>(std::min<uint64_t>(next_index, kRampSteps));
    return std::max(full >> (kRampSteps - step), std::min(full, kRampFloor));
  }

  /// Runs a step that talks to the receivers; a failure leaves the sender unusable.
  template <typename Step>
  auto on_connection(Step&& step) {
    WS_EXPECT(!broken, ErrorCode::kInvalidArgument,
              "update sender: an earlier update to " + receivers() + " failed; connect a new sender");
    try {
      return step();
    } catch (...) {
      broken = true;
      open = false;
      throw;
    }
  }

  /// Turns a message from a receiver that is not the expected one into an error.
  [[noreturn]] static void fail_with(const Link& link, const Message& message, const std::string& awaiting) {
    if (message.type == MessageType::kError) {
      WS_FAIL(message.code, link.receiver() + " failed the update: " + message.text);
    }
    WS_FAIL(ErrorCode::kProtocol, link.receiver() + " sent " + std::string(message_type_name(message.type)) +
                                      " while this sender waited for " + awaiting);
  }

  /// Handles one message from a receiver: an APPLIED frees, at that receiver, the buffer its
  /// bucket held (a bucket of shared regions only held none).
  void take_applied(Link& link, const std::string& awaiting) {
    Received received = receive_message(link.connection, options.timeout, awaiting);
    if (received.message.type != MessageType::kApplied) fail_with(link, received.message, awaiting);
    const BucketManifest& applied = received.message.manifest;
    WS_EXPECT(applied.index < next_index, ErrorCode::kProtocol,
              link.receiver() + " applied bucket " + std::to_string(applied.index) + ", which was not sent");
    if (link.in_flight[applied.slot] == applied.index) link.in_flight[applied.slot].reset();
  }

  /// Runs `step`; when it fails because a receiver went away, prefers that receiver's own
  /// ERROR message (already in its socket) over "connection reset".
  template <typename Step>
  void guarded(Step&& step) {
    try {
      step();
    } catch (const Error& error) {
      if (error.code() != ErrorCode::kNetwork) throw;
      for (Link& link : links) {
        if (!link.connection.readable()) continue;
        Received received;
        try {
          received = receive_message(link.connection, std::chrono::milliseconds(100), "the receiver's error");
        } catch (const Error&) {
          continue;
        }
        if (received.message.type == MessageType::kError) fail_with(link, received.message, "");
      }
      throw;
    }
  }

  /// Sends `message` to every receiver.
  void send_all(const Message& message) {
    for (Link& link : links) send_message(link.connection, message, options.timeout);
  }

  void flush() {
    if (current.entries.empty()) return;
    transport->seal(slot, slot_claimed);
    Message message;
    message.type = MessageType::kBucket;
    message.manifest = std::move(current);
    uint64_t bytes = message.manifest.bytes;
    guarded([&] {
      send_all(message);
      if (bytes > 0) transport->push(connections, slot, bytes, options.timeout);
    });
    if (slot_claimed) {
      for (Link& link : links) link.in_flight[slot] = next_index;
      slot ^= 1u;
    }
    ++next_index;
    slot_claimed = false;
    current = BucketManifest{};
    current_shared_bytes = 0;
    current_covered_bytes = 0;
    // Buckets of shared regions alone never wait for a buffer: read the APPLIED messages
    // that are already here, so no receiver blocks on a full socket.
    guarded([&] {
      for (Link& link : links) {
        while (link.connection.readable()) take_applied(link, "APPLIED");
      }
    });
  }

  /// Starts a bucket (it claims a buffer only when bytes are copied into it).
  void open_bucket() {
    current = BucketManifest{};
    current.index = next_index;
    current_shared_bytes = 0;
    current_covered_bytes = 0;
  }

  /// Queues one tensor (UpdateSender::send after its checks).
  void send(const TensorView& tensor);
  /// Queues the changed elements of a whole tensor (send_changes after its checks) as one
  /// entry, in one bucket.
  void send_encoded(const TensorView& tensor, std::span<const std::byte> encoded);
  /// The checks of send() for `tensor`; returns its entry of the manifest.
  Declared& admit(const TensorView& tensor);
  /// The checks of send_changes() for one tensor and its base; returns its entry of the manifest.
  Declared& admit_changes(const TensorView& base, const TensorView& tensor);
  /// The encoding of `tensor`'s changed elements since `base` inside the receivers' windows of
  /// it (its index `index` in the manifest) on `threads` threads, or std::nullopt where sending
  /// it whole is cheaper (SenderOptions::delta_dense_fraction).
  std::optional<std::vector<std::byte>> encode_changes(size_t index, const TensorView& base, const TensorView& tensor,
                                                       unsigned threads) const;
  /// Threads that encode one tensor's changed elements (SenderOptions::delta_threads).
  unsigned delta_threads() const {
    return options.delta_threads > 0 ? options.delta_threads : std::max(1u, std::thread::hardware_concurrency());
  }

  /// The current bucket's buffer, once every receiver has released it.
  void claim_slot() {
    if (slot_claimed) return;
    guarded([&] {
      for (Link& link : links) {
        while (link.in_flight[slot]) {
          await_message(link);
          take_applied(link, "the release of bucket buffer " + std::to_string(slot));
        }
      }
    });
    current.slot = slot;
    slot_claimed = true;
  }

  /// Until a message from `link` is ready, turns the transport while a bucket is still
  /// moving (at most the update's timeout; receive() then waits on with its own).
  void await_message(Link& link) {
    const auto deadline = std::chrono::steady_clock::now() + options.timeout;
    pollfd entry{link.connection.fd(), POLLIN, 0};
    const timespec turn{0, 50'000};  // 50 us: the link's socket buffers drain in a few ms
    while (transport->progress() && std::chrono::steady_clock::now() < deadline) {
      if (::ppoll(&entry, 1, &turn, nullptr) > 0) return;
    }
  }
};

UpdateSender::UpdateSender(const std::string& address, SenderOptions options)
    : UpdateSender(std::vector<std::string>{address}, std::move(options)) {}

UpdateSender::UpdateSender(const std::vector<std::string>& addresses, SenderOptions options)
    : state_(std::make_unique<State>()) {
  State& state = *state_;
  state.options = options;
  WS_EXPECT(!addresses.empty(), ErrorCode::kInvalidArgument, "update sender: no receiver address given");
  WS_EXPECT(addresses.size() <= kMaxReceivers, ErrorCode::kInvalidArgument,
            "update sender: " + std::to_string(addresses.size()) + " receivers, at most " +
                std::to_string(kMaxReceivers));
  WS_EXPECT(addresses.size() == 1 || feeds_several(options.transport), ErrorCode::kInvalidArgument,
            "update sender: " + std::to_string(addresses.size()) + " receivers over " +
                std::string(transport_name(options.transport)) +
                ", which carries one; feed several over tcp, nccl or ucx, or make one sender per receiver");
  WS_EXPECT(options.bucket_bytes >= kMinBucketBytes, ErrorCode::kInvalidArgument,
            "bucket size " + std::to_string(options.bucket_bytes) + " bytes is too small: at least 4KiB");
  WS_EXPECT(transport_compiled(options.transport), ErrorCode::kUnsupported,
            "update sender: the " + std::string(transport_name(options.transport)) +
                " transport is not compiled into this build");
  const auto receivers = static_cast<uint32_t>(addresses.size());
  Message hello;
  hello.type = MessageType::kHello;
  hello.transport = options.transport;
  hello.bucket_bytes = options.bucket_bytes;
  hello.receivers = receivers;
  hello.blob = sender_hello_blob(options.transport);
  std::vector<std::vector<std::byte>> welcome_blobs;  // ucx: each receiver offers its buckets
  Received first_welcome;
  // Every receiver is greeted before the transport joins them: NCCL's join waits for all.
  for (uint32_t index = 0; index < receivers; ++index) {
    State::Link link{addresses[index], connect_to(addresses[index], options.timeout), {}};
    prove_to_server(link.connection, kUpdateHandshake, options.token, options.timeout, link.receiver());
    hello.receiver_index = index;
    send_message(link.connection, hello, options.timeout);
    Received welcome = receive_message(link.connection, options.timeout, "WELCOME");
    if (welcome.message.type == MessageType::kRefuse) {
      WS_FAIL(ErrorCode::kProtocol, link.receiver() + " refused this sender: " + welcome.message.text);
    }
    if (welcome.message.type != MessageType::kWelcome) State::fail_with(link, welcome.message, "WELCOME");
    WS_EXPECT(welcome.message.bucket_bytes == options.bucket_bytes, ErrorCode::kProtocol,
              link.receiver() + " agreed to buckets of " + std::to_string(welcome.message.bucket_bytes) +
                  " bytes, not the " + std::to_string(options.bucket_bytes) + " asked for");
    welcome_blobs.push_back(welcome.message.blob);
    if (index == 0) first_welcome = std::move(welcome);
    state.links.push_back(std::move(link));
  }
  for (State::Link& link : state.links) state.connections.push_back(&link.connection);
  state.transport = options.transport == TransportKind::kUcx
                        ? make_ucx_sender(options.bucket_bytes, welcome_blobs, options.ucx_path)
                        : make_sender_transport(options, receivers, hello.blob, first_welcome.message.blob,
                                                std::move(first_welcome.fd));
  state.transport->join(options.timeout);
}

UpdateSender::~UpdateSender() = default;

uint64_t UpdateSender::buckets_sent() const noexcept { return state_->next_index; }

std::vector<std::string> UpdateSender::paths() const { return state_->transport->paths(); }

void UpdateSender::start(TensorFormat format, std::span<const DeclaredTensor> manifest, const UpdateVersions& versions) {
  State& state = *state_;
  WS_EXPECT(state.broken || !state.open, ErrorCode::kInvalidArgument,
            "update sender: start() while an update is open (finish() it first)");
  const bool delta = !versions.base.empty();
  WS_EXPECT(versions.base.size() <= kMaxVersionBytes && versions.target.size() <= kMaxVersionBytes,
            ErrorCode::kInvalidArgument,
            "update sender: a version of " + std::to_string(std::max(versions.base.size(), versions.target.size())) +
                " bytes, at most " + std::to_string(kMaxVersionBytes));
  WS_EXPECT(!delta || format == TensorFormat::kCheckpoint, ErrorCode::kInvalidArgument,
            "update sender: a delta update takes checkpoint-format tensors, not engine format");
  WS_EXPECT(!delta || state.options.transport == TransportKind::kShm || state.options.transport == TransportKind::kTcp ||
                state.options.transport == TransportKind::kUcx,
            ErrorCode::kUnsupported,
            "update sender: delta updates travel over shm, tcp and ucx, not " +
                std::string(transport_name(state.options.transport)) + " (yet)");
  // The manifest is checked here as the receiver's parser would refuse it, before anything
  // is sent: a bad manifest leaves the connection usable.
  WS_EXPECT(manifest.size() <= kMaxEntries, ErrorCode::kInvalidArgument,
            "update sender: a manifest of " + std::to_string(manifest.size()) + " tensors, at most " +
                std::to_string(kMaxEntries));
  std::vector<State::Declared> declared;
  declared.reserve(manifest.size());
  uint64_t message_bytes = 5;
  for (const DeclaredTensor& tensor : manifest) {
    WS_EXPECT(!tensor.name.empty() && tensor.name.size() <= kMaxNameBytes, ErrorCode::kInvalidArgument,
              "update sender: a declared tensor name of " + std::to_string(tensor.name.size()) +
                  " bytes (1 to 4096 allowed)");
    WS_EXPECT(tensor.shape.size() <= kMaxTensorRank, ErrorCode::kInvalidArgument,
              "update sender: declared tensor " + tensor.name + " has " + std::to_string(tensor.shape.size()) +
                  " dimensions");
    auto size = tensor_byte_size(tensor.dtype, tensor.shape);
    WS_EXPECT(size.has_value(), ErrorCode::kInvalidArgument,
              "update sender: declared tensor " + tensor.name + ": " + described(tensor.dtype, tensor.shape) +
                  " has no valid byte size");
    declared.push_back({tensor, *size});
    message_bytes += 6 + tensor.name.size() + 8 * tensor.shape.size();
  }
  WS_EXPECT(message_bytes <= kMaxMessageBytes, ErrorCode::kInvalidArgument,
            "update sender: the manifest of " + std::to_string(manifest.size()) + " tensors takes " +
                std::to_string(message_bytes) + " bytes, more than one message carries (" +
                std::to_string(kMaxMessageBytes) + "); send them as several updates");
  std::unordered_map<std::string_view, size_t> index;
  index.reserve(declared.size());
  for (size_t i = 0; i < declared.size(); ++i) {
    WS_EXPECT(index.try_emplace(declared[i].tensor.name, i).second, ErrorCode::kInvalidArgument,
              "update sender: tensor " + declared[i].tensor.name + " is declared twice in the manifest");
  }
  state.on_connection([&] {
    Message message;
    message.type = MessageType::kStart;
    message.format = format;
    message.versions = versions;
    message.declared.assign(manifest.begin(), manifest.end());
    state.transport->begin_update();
    state.next_index = 0;
    state.slot = 0;
    state.slot_claimed = false;
    for (State::Link& link : state.links) link.in_flight[0].reset(), link.in_flight[1].reset();
    state.current = BucketManifest{};
    state.current_shared_bytes = 0;
    state.current_covered_bytes = 0;
    state.declared = std::move(declared);
    state.declared_index = std::move(index);  // its keys view the names, which moved with their vector
    state.guarded([&] { state.send_all(message); });
    // Every receiver checks the manifest against its model before any bucket is sent.
    for (State::Link& link : state.links) {
      Received answer = receive_message(link.connection, state.options.timeout, "the receiver's verdict on the manifest");
      if (answer.message.type == MessageType::kError) {
        WS_FAIL(answer.message.code, link.receiver() + " refused the update: " + answer.message.text);
      }
      if (answer.message.type != MessageType::kAccepted) State::fail_with(link, answer.message, "ACCEPTED");
      link.held = std::move(answer.message.held);
      link.digests.clear();
    }
    state.held.clear();
    if (delta) state.take_windows(manifest);
    state.open = true;
    state.delta = delta;
  });
}

UpdateSender::State::Declared& UpdateSender::State::admit(const TensorView& tensor) {
  State& state = *this;
  // Spelled out only in messages: a string per tensor is measurable at 10,000 tensors.
  const std::string_view name = tensor.name;
  WS_EXPECT(state.open, ErrorCode::kInvalidArgument, "update sender: send(" + std::string(name) + ") outside start()/finish()");
  WS_EXPECT(!name.empty() && name.size() <= kMaxNameBytes, ErrorCode::kInvalidArgument,
            "update sender: tensor name of " + std::to_string(name.size()) + " bytes (1 to 4096 allowed)");
  WS_EXPECT(tensor.shape.size() <= kMaxTensorRank, ErrorCode::kInvalidArgument,
            "update sender: tensor " + std::string(name) + " has " + std::to_string(tensor.shape.size()) + " dimensions");
  auto size = tensor_byte_size(tensor.dtype, tensor.shape);
  WS_EXPECT(size && tensor.offset <= *size && tensor.bytes <= *size - tensor.offset, ErrorCode::kInvalidArgument,
            "update sender: tensor " + std::string(name) + ": piece " + std::to_string(tensor.offset) + "+" +
                std::to_string(tensor.bytes) + " does not fit its shape " + shape_text(tensor.shape));
  WS_EXPECT(tensor.data != nullptr || tensor.bytes == 0, ErrorCode::kInvalidArgument,
            "update sender: tensor " + std::string(name) + " has no data");
  auto found = state.declared_index.find(name);
  WS_EXPECT(found != state.declared_index.end(), ErrorCode::kInvalidArgument,
            "update sender: tensor " + std::string(name) +
                " is not in the update's manifest (start() declares every tensor an update sends)");
  State::Declared& declared = state.declared[found->second];
  WS_EXPECT(tensor.dtype == declared.tensor.dtype && std::ranges::equal(tensor.shape, declared.tensor.shape),
            ErrorCode::kInvalidArgument,
            "update sender: tensor " + std::string(name) + " is " + described(tensor.dtype, tensor.shape) +
                " but the manifest declares it " + described(declared.tensor.dtype, declared.tensor.shape));
  WS_EXPECT(!declared.begun || declared.sent < declared.bytes, ErrorCode::kInvalidArgument,
            "update sender: tensor " + std::string(name) + " was sent whole already in this update");
  WS_EXPECT(tensor.offset == declared.sent, ErrorCode::kInvalidArgument,
            "update sender: tensor " + std::string(name) + ": a piece at byte " + std::to_string(tensor.offset) +
                " after " + std::to_string(declared.sent) + " bytes of it were sent (pieces come in order)");
  return declared;
}

void UpdateSender::send(const TensorView& tensor) {
  State& state = *state_;
  State::Declared& declared = state.admit(tensor);
  declared.sent += tensor.bytes;
  declared.begun = true;
  state.on_connection([&] { state.send(tensor); });
}

UpdateSender::State::Declared& UpdateSender::State::admit_changes(const TensorView& base, const TensorView& tensor) {
  const std::string name(tensor.name);
  WS_EXPECT(open && delta, ErrorCode::kInvalidArgument,
            "update sender: send_changes(" + name + ") outside a delta update (start() with a base version)");
  WS_EXPECT(base.dtype == tensor.dtype && std::ranges::equal(base.shape, tensor.shape) && base.offset == 0 &&
                base.bytes == tensor.bytes,
            ErrorCode::kInvalidArgument,
            "update sender: tensor " + name + " is " + described(tensor.dtype, tensor.shape) + " but its base is " +
                described(base.dtype, base.shape) + " (" + std::to_string(base.bytes) + " bytes)");
  WS_EXPECT(!base.device.is_cuda() && !tensor.device.is_cuda() && (base.data != nullptr || base.bytes == 0),
            ErrorCode::kInvalidArgument,
            "update sender: changed elements of tensor " + name + " are computed from host memory (" +
                base.device.name() + " and " + tensor.device.name() + " given)");
  Declared& declared = admit(tensor);
  WS_EXPECT(tensor.offset == 0 && tensor.bytes == declared.bytes, ErrorCode::kInvalidArgument,
            "update sender: changed elements of tensor " + name + " are computed from the whole tensor, not the piece " +
                std::to_string(tensor.offset) + "+" + std::to_string(tensor.bytes));
  return declared;
}

std::optional<std::vector<std::byte>> UpdateSender::State::encode_changes(size_t index, const TensorView& base,
                                                                          const TensorView& tensor,
                                                                          unsigned threads) const {
  const double fraction = std::clamp(options.delta_dense_fraction, 0.0, 1.0);
  const uint64_t limit =
      std::min<uint64_t>(static_cast<uint64_t>(fraction * static_cast<double>(tensor.bytes)), options.bucket_bytes);
  return encode_changed_elements(std::span(base.data, base.bytes), std::span(tensor.data, tensor.bytes),
                                 dtype_bits(tensor.dtype) / 8, limit, threads, &held[index]);
}

void UpdateSender::State::take_windows(std::span<const DeclaredTensor> manifest) {
  held.assign(manifest.size(), TensorWindows{});
  for (size_t i = 0; i < manifest.size(); ++i) {
    const uint64_t elements = declared[i].bytes * 8 / std::max<uint64_t>(dtype_bits(manifest[i].dtype), 1);
    held[i].rows = manifest[i].shape.empty() ? 1 : static_cast<uint64_t>(manifest[i].shape[0]);
    held[i].columns = held[i].rows > 0 ? elements / held[i].rows : 0;
  }
  for (Link& link : links) {
    WS_EXPECT(link.held.size() == manifest.size(), ErrorCode::kProtocol,
              link.receiver() + " accepted a delta of " + std::to_string(manifest.size()) + " tensors with windows of " +
                  std::to_string(link.held.size()));
    for (size_t i = 0; i < manifest.size(); ++i) {
      TensorWindows& joined = held[i];
      for (const HeldWindow& window : link.held[i]) {
        WS_EXPECT(window.row_begin <= joined.rows && window.rows <= joined.rows - window.row_begin &&
                      window.column_begin <= joined.columns && window.columns <= joined.columns - window.column_begin,
                  ErrorCode::kProtocol,
                  link.receiver() + " holds rows " + std::to_string(window.row_begin) + "+" + std::to_string(window.rows) +
                      ", columns " + std::to_string(window.column_begin) + "+" + std::to_string(window.columns) +
                      " of tensor " + manifest[i].name + ", which has " + std::to_string(joined.rows) + " x " +
                      std::to_string(joined.columns));
      }
    }
  }
  // Whole where a receiver holds the whole tensor (a replicated one), else the windows joined.
  for (size_t i = 0; i < manifest.size(); ++i) {
    TensorWindows& joined = held[i];
    const HeldWindow all{0, joined.rows, 0, joined.columns};
    bool whole = false;
    joined.whole = false;
    for (const Link& link : links) {
      for (const HeldWindow& window : link.held[i]) {
        whole = whole || window == all;
        if (std::ranges::find(joined.windows, window) == joined.windows.end()) joined.windows.push_back(window);
      }
    }
    if (whole) joined = TensorWindows{.rows = joined.rows, .columns = joined.columns};
  }
}

std::vector<uint64_t> UpdateSender::State::link_digests(size_t index, const TensorView& tensor) const {
  std::vector<uint64_t> digests;
  for (const Link& link : links) {
    digests.push_back(windows_digest(std::span(tensor.data, tensor.bytes), dtype_bits(tensor.dtype) / 8,
                                     held[index].columns, link.held[index]));
  }
  return digests;
}

bool UpdateSender::send_changes(const TensorView& base, const TensorView& tensor) {
  return send_changes(std::span(&base, 1), std::span(&tensor, 1)) == 1;
}

uint64_t UpdateSender::send_changes(std::span<const TensorView> bases, std::span<const TensorView> tensors) {
  State& state = *state_;
  WS_EXPECT(bases.size() == tensors.size(), ErrorCode::kInvalidArgument,
            "update sender: send_changes() of " + std::to_string(tensors.size()) + " tensors with " +
                std::to_string(bases.size()) + " bases");
  // Every tensor is checked before any is counted as sent: a refused batch sends nothing.
  std::vector<State::Declared*> declared;
  declared.reserve(tensors.size());
  std::unordered_set<const State::Declared*> seen;
  for (size_t i = 0; i < tensors.size(); ++i) {
    State::Declared& entry = state.admit_changes(bases[i], tensors[i]);
    WS_EXPECT(seen.insert(&entry).second, ErrorCode::kInvalidArgument,
              "update sender: tensor " + std::string(tensors[i].name) + " comes twice in one send_changes()");
    declared.push_back(&entry);
  }
  // Large tensors are compared range by range on every thread, the small ones a tensor a thread.
  // Each one sent as changes is digested as each receiver holds it, for its check at FINISH.
  const unsigned threads = state.delta_threads();
  std::vector<std::optional<std::vector<std::byte>>> encoded(tensors.size());
  std::vector<std::vector<uint64_t>> digests(tensors.size());
  auto encode = [&](size_t i, unsigned on_threads) {
    const auto index = static_cast<size_t>(declared[i] - state.declared.data());
    encoded[i] = state.encode_changes(index, bases[i], tensors[i], on_threads);
    if (encoded[i]) digests[i] = state.link_digests(index, tensors[i]);
  };
  std::vector<size_t> small;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].bytes >= kParallelEncodingBytes || threads == 1) {
      encode(i, threads);
    } else {
      small.push_back(i);
    }
  }
  detail::run_parallel(small.size(), threads, [&](size_t, size_t item) { encode(small[item], 1); });
  uint64_t sparse = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    declared[i]->sent = tensors[i].bytes;
    declared[i]->begun = true;
    state.on_connection([&] { encoded[i] ? state.send_encoded(tensors[i], *encoded[i]) : state.send(tensors[i]); });
    const auto index = static_cast<uint32_t>(declared[i] - state.declared.data());
    for (size_t link = 0; link < digests[i].size(); ++link) state.links[link].digests.emplace_back(index, digests[i][link]);
    sparse += encoded[i] ? 1 : 0;
  }
  return sparse;
}

uint64_t UpdateSender::send_quantized_changes(const TensorView& base_codes, const TensorView& base_scales,
                                             const TensorView& tensor, std::array<int64_t, 2> block) {
  const std::string name(tensor.name);
  WS_EXPECT(!tensor.shape.empty() && block[0] > 0 && block[1] > 0, ErrorCode::kInvalidArgument,
            "update sender: tensor " + name + " of shape " + shape_text(tensor.shape) + " cannot be quantized in " +
                std::to_string(block[0]) + " x " + std::to_string(block[1]) + " blocks");
  const auto rows = static_cast<uint64_t>(tensor.shape[0]);
  const uint64_t columns = rows > 0 ? tensor.bytes / (dtype_bits(tensor.dtype) / 8) / rows : 0;
  const std::vector<int64_t> scale_shape = {(tensor.shape[0] + block[0] - 1) / block[0],
                                            static_cast<int64_t>((columns + block[1] - 1) / block[1])};
  WS_EXPECT(base_codes.name == tensor.name && base_codes.dtype == Dtype::kF8E4M3 &&
                std::ranges::equal(base_codes.shape, tensor.shape) && base_scales.dtype == Dtype::kF32 &&
                std::ranges::equal(base_scales.shape, scale_shape),
            ErrorCode::kInvalidArgument,
            "update sender: the FP8 base of tensor " + name + " " + described(tensor.dtype, tensor.shape) + " must be " +
                name + " F8_E4M3 " + shape_text(tensor.shape) + " with its scales F32 " + shape_text(scale_shape) +
                ", not " + std::string(base_codes.name) + " " + described(base_codes.dtype, base_codes.shape) + " and " +
                std::string(base_scales.name) + " " + described(base_scales.dtype, base_scales.shape));
  WS_EXPECT(!tensor.device.is_cuda() && tensor.offset == 0, ErrorCode::kInvalidArgument,
            "update sender: tensor " + name + " is quantized whole from host memory");
  std::vector<std::byte> codes(rows * columns);
  std::vector<float> scales(static_cast<uint64_t>(scale_shape[0] * scale_shape[1]));
  quantize_fp8_blocks(std::span(tensor.data, tensor.bytes), tensor.dtype, rows, columns, block, codes, scales);
  const std::array<TensorView, 2> quantized = {
      TensorView{.name = base_codes.name, .dtype = Dtype::kF8E4M3, .shape = base_codes.shape, .data = codes.data(),
                 .bytes = codes.size()},
      TensorView{.name = base_scales.name, .dtype = Dtype::kF32, .shape = base_scales.shape,
                 .data = reinterpret_cast<const std::byte*>(scales.data()), .bytes = scales.size() * sizeof(float)}};
  const std::array<TensorView, 2> bases = {base_codes, base_scales};
  return send_changes(bases, quantized);  // copied into the buckets before it returns
}

void UpdateSender::State::send_encoded(const TensorView& tensor, std::span<const std::byte> encoded) {
  State& state = *this;
  if (state.current.entries.empty()) state.open_bucket();
  uint64_t start = (state.current.bytes + kPieceAlignment - 1) / kPieceAlignment * kPieceAlignment;
  // One entry in one bucket: the whole buffer may take it, whatever the ramp allows.
  if (start + encoded.size() + state.current_shared_bytes > state.options.bucket_bytes) {
    state.flush();
    state.open_bucket();
    start = 0;
  }
  state.claim_slot();
  state.transport->fill(state.slot, start, encoded.data(), Device{}, encoded.size());
  BucketEntry& entry = state.current.entries.emplace_back();
  entry.name = tensor.name;
  entry.dtype = tensor.dtype;
  entry.shape.assign(tensor.shape.begin(), tensor.shape.end());
  entry.source_offset = start;
  entry.bytes = encoded.size();
  entry.encoding = EntryEncoding::kChangedElements;
  state.current.bytes = start + encoded.size();
  state.current_covered_bytes += tensor.bytes;
  const uint64_t limit = state.bucket_limit();
  if (state.current.bytes + state.current_shared_bytes >= limit || state.current_covered_bytes >= limit) state.flush();
}

void UpdateSender::State::send(const TensorView& tensor) {
  State& state = *this;
  auto add_entry = [&](uint64_t tensor_offset, uint32_t source, uint64_t source_offset, uint64_t bytes) {
    BucketEntry& entry = state.current.entries.emplace_back();
    entry.name = tensor.name;
    entry.dtype = tensor.dtype;
    entry.shape.assign(tensor.shape.begin(), tensor.shape.end());
    entry.tensor_offset = tensor_offset;
    entry.source = source;
    entry.source_offset = source_offset;
    entry.bytes = bytes;
  };
  // In place: the receiver reads the tensor from the sender's shared allocation. The bucket
  // counts its bytes (a bucket is the unit of pipelining) but holds none of them.
  if (tensor.bytes > 0 && tensor.device.is_cuda()) {
    if (state.current.entries.empty()) state.open_bucket();
    if (auto place = state.transport->share(tensor.data, tensor.device, tensor.bytes, state.current.regions)) {
      add_entry(tensor.offset, place->region + 1, place->offset, tensor.bytes);
      state.current_shared_bytes += tensor.bytes;
      if (state.current.bytes + state.current_shared_bytes >= state.bucket_limit()) state.flush();
      return;
    }
  }
  uint64_t done = 0;
  do {
    if (state.current.entries.empty()) state.open_bucket();
    const uint64_t capacity = state.bucket_limit();  // of this bucket (the first ones are smaller)
    uint64_t start = (state.current.bytes + kPieceAlignment - 1) / kPieceAlignment * kPieceAlignment;
    if (start >= capacity || start + state.current_shared_bytes >= capacity) {  // no room: this bucket is full
      state.flush();
      continue;
    }
    uint64_t take = std::min(tensor.bytes - done, capacity - start - state.current_shared_bytes);
    if (take > 0) {
      state.claim_slot();
      // Bytes that stay valid and unchanged until finish() may travel from where they are.
      const bool in_place = tensor.lifetime == SourceLifetime::kLoad &&
                            state.transport->take_in_place(state.slot, start, tensor.data + done, tensor.device, take,
                                                           tensor.keepalive);
      if (!in_place) state.transport->fill(state.slot, start, tensor.data + done, tensor.device, take);
    }
    add_entry(tensor.offset + done, 0, start, take);
    state.current.bytes = start + take;
    done += take;
    if (state.current.bytes + state.current_shared_bytes >= capacity) state.flush();
  } while (done < tensor.bytes);
}

void UpdateSender::flush() {
  State& state = *state_;
  WS_EXPECT(state.open, ErrorCode::kInvalidArgument, "update sender: flush() outside start()/finish()");
  state.on_connection([&] {
    state.flush();
    state.guarded([&] { state.transport->drain(state.connections, state.options.timeout); });
  });
}

UpdateReport UpdateSender::finish() {
  State& state = *state_;
  WS_EXPECT(state.open, ErrorCode::kInvalidArgument, "update sender: finish() without start(), or twice");
  return state.on_connection([&] {
    if (std::vector<std::string> unsent = state.unsent(); !unsent.empty()) {
      const std::string reason = std::to_string(unsent.size()) + " declared tensor" +
                                 (unsent.size() == 1 ? " was" : "s were") + " not sent whole: " + listed(unsent);
      state.abandon("the sender abandoned the update: " + reason);
      WS_FAIL(ErrorCode::kInvalidArgument, "update sender: cannot finish the update to " + state.receivers() + ": " +
                                               reason + " (the receivers were told; connect a new sender)");
    }
    state.flush();
    state.guarded([&] { state.transport->drain(state.connections, state.options.timeout); });
    Message message;
    message.type = MessageType::kFinish;
    message.buckets = state.next_index;
    state.guarded([&] {
      for (State::Link& link : state.links) {  // each with the digests of what it holds
        message.digests = std::move(link.digests);
        link.digests.clear();
        send_message(link.connection, message, state.options.timeout);
      }
    });
    state.open = false;
    // Every receiver's report; the slowest one's is the update's.
    std::optional<UpdateReport> slowest;
    for (State::Link& link : state.links) {
      for (;;) {
        Received received = receive_message(link.connection, state.options.timeout, "the update's REPORT");
        if (received.message.type == MessageType::kApplied) continue;
        if (received.message.type != MessageType::kReport) State::fail_with(link, received.message, "the update's REPORT");
        if (!slowest || received.message.report.seconds > slowest->seconds) slowest = received.message.report;
        break;
      }
    }
    return *slowest;
  });
}

}  // namespace weightstream
