// UpdateSender: packs tensors into two alternating buckets and sends each with its
// manifest; waits only when both buckets are with the receiver.
#include <algorithm>
#include <chrono>

#include "transfer/socket.hpp"
#include "transfer/transport.hpp"
#include "transfer/wire.hpp"
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

}  // namespace

struct UpdateSender::State {
  SenderOptions options;
  std::string address;
  std::optional<Connection> connection;
  std::unique_ptr<SenderTransport> transport;
  bool open = false;    // an update is between start() and finish()
  bool broken = false;  // an update failed: the connection is in an unknown state
  uint32_t slot = 0;                             // the buffer the current bucket fills
  bool slot_claimed = false;                     // the current bucket has bytes in `slot`
  std::optional<uint64_t> in_flight[2];          // bucket occupying each buffer, until APPLIED
  uint64_t next_index = 0;
  BucketManifest current;
  uint64_t current_shared_bytes = 0;             // bytes the current bucket shares in place

  std::string receiver() const { return "update receiver at " + address; }

  /// The bytes the current bucket may hold (see kRampSteps).
  uint64_t bucket_limit() const {
    const uint64_t full = options.bucket_bytes;
    const unsigned step = static_cast<unsigned>(std::min<uint64_t>(next_index, kRampSteps));
    return std::max(full >> (kRampSteps - step), std::min(full, kRampFloor));
  }

  /// Runs a step that talks to the receiver; a failure leaves the sender unusable.
  template <typename Step>
  auto on_connection(Step&& step) {
    WS_EXPECT(!broken, ErrorCode::kInvalidArgument,
              "update sender: an earlier update to " + receiver() + " failed; connect a new sender");
    try {
      return step();
    } catch (...) {
      broken = true;
      open = false;
      throw;
    }
  }

  /// Turns a message from the receiver that is not the expected one into an error.
  [[noreturn]] void fail_with(const Message& message, const std::string& awaiting) {
    if (message.type == MessageType::kError) {
      WS_FAIL(message.code, receiver() + " failed the update: " + message.text);
    }
    WS_FAIL(ErrorCode::kProtocol, receiver() + " sent " + std::string(message_type_name(message.type)) +
                                      " while this sender waited for " + awaiting);
  }

  /// Handles one message from the receiver: an APPLIED frees the buffer its bucket held (a
  /// bucket of shared regions only held none).
  void take_applied(const std::string& awaiting) {
    Received received = connection->receive(options.timeout, awaiting);
    if (received.message.type != MessageType::kApplied) fail_with(received.message, awaiting);
    const BucketManifest& applied = received.message.manifest;
    WS_EXPECT(applied.index < next_index, ErrorCode::kProtocol,
              receiver() + " applied bucket " + std::to_string(applied.index) + ", which was not sent");
    if (in_flight[applied.slot] == applied.index) in_flight[applied.slot].reset();
  }

  /// Runs `step`; when it fails because the receiver went away, prefers the receiver's own
  /// ERROR message (already in the socket) over "connection reset".
  template <typename Step>
  void guarded(Step&& step) {
    try {
      step();
    } catch (const Error& error) {
      if (error.code() != ErrorCode::kNetwork || !connection->readable()) throw;
      Received received;
      try {
        received = connection->receive(std::chrono::milliseconds(100), "the receiver's error");
      } catch (const Error&) {
        throw error;
      }
      if (received.message.type == MessageType::kError) fail_with(received.message, "");
      throw;
    }
  }

  void flush() {
    if (current.entries.empty()) return;
    transport->seal(slot, slot_claimed);
    Message message;
    message.type = MessageType::kBucket;
    message.manifest = std::move(current);
    uint64_t bytes = message.manifest.bytes;
    guarded([&] {
      connection->send(message, options.timeout);
      if (bytes > 0) transport->push(*connection, slot, bytes, options.timeout);
    });
    if (slot_claimed) {
      in_flight[slot] = next_index;
      slot ^= 1u;
    }
    ++next_index;
    slot_claimed = false;
    current = BucketManifest{};
    current_shared_bytes = 0;
    // Buckets of shared regions alone never wait for a buffer: read the APPLIED messages
    // that are already here, so the receiver never blocks on a full socket.
    guarded([&] {
      while (connection->readable()) take_applied("APPLIED");
    });
  }

  /// Starts a bucket (it claims a buffer only when bytes are copied into it).
  void open_bucket() {
    current = BucketManifest{};
    current.index = next_index;
    current_shared_bytes = 0;
  }

  /// Queues one tensor (UpdateSender::send after its checks).
  void send(const TensorView& tensor);

  /// The current bucket's buffer, once the receiver has released it.
  void claim_slot() {
    if (slot_claimed) return;
    while (in_flight[slot]) take_applied("the release of bucket buffer " + std::to_string(slot));
    current.slot = slot;
    slot_claimed = true;
  }
};

UpdateSender::UpdateSender(const std::string& address, SenderOptions options)
    : state_(std::make_unique<State>()) {
  State& state = *state_;
  state.options = options;
  state.address = address;
  WS_EXPECT(options.bucket_bytes >= 4096, ErrorCode::kInvalidArgument,
            "bucket size " + std::to_string(options.bucket_bytes) + " bytes is too small: at least 4KiB");
  WS_EXPECT(transport_compiled(options.transport), ErrorCode::kUnsupported,
            "update sender: the " + std::string(transport_name(options.transport)) +
                " transport is not compiled into this build");
  state.connection.emplace(connect_to(address, options.timeout));
  Message hello;
  hello.type = MessageType::kHello;
  hello.token = options.token;
  hello.transport = options.transport;
  hello.bucket_bytes = options.bucket_bytes;
  hello.blob = sender_hello_blob(options.transport);
  state.connection->send(hello, options.timeout);
  Received welcome = state.connection->receive(options.timeout, "WELCOME");
  if (welcome.message.type == MessageType::kRefuse) {
    WS_FAIL(ErrorCode::kProtocol, state.receiver() + " refused this sender: " + welcome.message.text);
  }
  if (welcome.message.type != MessageType::kWelcome) state.fail_with(welcome.message, "WELCOME");
  WS_EXPECT(welcome.message.bucket_bytes == options.bucket_bytes, ErrorCode::kProtocol,
            state.receiver() + " agreed to buckets of " + std::to_string(welcome.message.bucket_bytes) +
                " bytes, not the " + std::to_string(options.bucket_bytes) + " asked for");
  state.transport = make_sender_transport(options, hello.blob, welcome.message.blob, std::move(welcome.fd));
  state.transport->join(options.timeout);
}

UpdateSender::~UpdateSender() = default;

uint64_t UpdateSender::buckets_sent() const noexcept { return state_->next_index; }

void UpdateSender::start(TensorFormat format) {
  State& state = *state_;
  WS_EXPECT(state.broken || !state.open, ErrorCode::kInvalidArgument,
            "update sender: start() while an update is open (finish() it first)");
  state.on_connection([&] {
    Message message;
    message.type = MessageType::kStart;
    message.format = format;
    state.transport->begin_update();
    state.next_index = 0;
    state.slot = 0;
    state.slot_claimed = false;
    state.in_flight[0].reset();
    state.in_flight[1].reset();
    state.current = BucketManifest{};
    state.current_shared_bytes = 0;
    state.guarded([&] { state.connection->send(message, state.options.timeout); });
    state.open = true;
  });
}

void UpdateSender::send(const TensorView& tensor) {
  State& state = *state_;
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
  state.on_connection([&] { state.send(tensor); });
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
      state.transport->fill(state.slot, start, tensor.data + done, tensor.device, take);
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
  state.on_connection([&] { state.flush(); });
}

UpdateReport UpdateSender::finish() {
  State& state = *state_;
  WS_EXPECT(state.open, ErrorCode::kInvalidArgument, "update sender: finish() without start(), or twice");
  return state.on_connection([&] {
    state.flush();
    Message message;
    message.type = MessageType::kFinish;
    message.buckets = state.next_index;
    state.guarded([&] { state.connection->send(message, state.options.timeout); });
    state.open = false;
    for (;;) {
      Received received = state.connection->receive(state.options.timeout, "the update's REPORT");
      if (received.message.type == MessageType::kApplied) continue;
      if (received.message.type != MessageType::kReport) state.fail_with(received.message, "the update's REPORT");
      return received.message.report;
    }
  });
}

}  // namespace weightstream
