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

}  // namespace

struct UpdateSender::State {
  SenderOptions options;
  std::string address;
  std::optional<Connection> connection;
  std::unique_ptr<SenderTransport> transport;
  bool started = false;
  bool finished = false;
  uint32_t slot = 0;
  bool in_flight[2] = {false, false};
  uint64_t next_index = 0;
  BucketManifest current;

  std::string receiver() const { return "update receiver at " + address; }

  /// Turns a message from the receiver that is not the expected one into an error.
  [[noreturn]] void fail_with(const Message& message, const std::string& awaiting) {
    if (message.type == MessageType::kError) {
      WS_FAIL(message.code, receiver() + " failed the update: " + message.text);
    }
    WS_FAIL(ErrorCode::kProtocol, receiver() + " sent " + std::string(message_type_name(message.type)) +
                                      " while this sender waited for " + awaiting);
  }

  /// Handles one message from the receiver: an APPLIED frees its bucket buffer.
  void take_applied(const std::string& awaiting) {
    Received received = connection->receive(options.timeout, awaiting);
    if (received.message.type != MessageType::kApplied) fail_with(received.message, awaiting);
    uint32_t freed = received.message.manifest.slot;
    WS_EXPECT(in_flight[freed], ErrorCode::kProtocol,
              receiver() + " released bucket buffer " + std::to_string(freed) + ", which was not in flight");
    in_flight[freed] = false;
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
    transport->seal(slot);
    Message message;
    message.type = MessageType::kBucket;
    message.manifest = std::move(current);
    uint64_t bytes = message.manifest.bytes;
    guarded([&] {
      connection->send(message, options.timeout);
      transport->push(*connection, slot, bytes, options.timeout);
    });
    in_flight[slot] = true;
    ++next_index;
    slot ^= 1u;
    current = BucketManifest{};
  }

  /// Starts filling a bucket in `slot`, once the receiver has released it.
  void open_bucket() {
    while (in_flight[slot]) take_applied("the release of bucket buffer " + std::to_string(slot));
    current = BucketManifest{};
    current.index = next_index;
    current.slot = slot;
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
  state.transport = make_sender_transport(options.transport, options.bucket_bytes, options.device, hello.blob,
                                          welcome.message.blob, std::move(welcome.fd));
  state.transport->join(options.timeout);
}

UpdateSender::~UpdateSender() = default;

uint64_t UpdateSender::buckets_sent() const noexcept { return state_->next_index; }

void UpdateSender::start(TensorFormat format) {
  State& state = *state_;
  WS_EXPECT(!state.started, ErrorCode::kInvalidArgument, "update sender: start() called twice");
  Message message;
  message.type = MessageType::kStart;
  message.format = format;
  state.guarded([&] { state.connection->send(message, state.options.timeout); });
  state.started = true;
}

void UpdateSender::send(const TensorView& tensor) {
  State& state = *state_;
  const std::string name(tensor.name);
  WS_EXPECT(state.started && !state.finished, ErrorCode::kInvalidArgument,
            "update sender: send(" + name + ") outside start()/finish()");
  WS_EXPECT(!name.empty() && name.size() <= kMaxNameBytes, ErrorCode::kInvalidArgument,
            "update sender: tensor name of " + std::to_string(name.size()) + " bytes (1 to 4096 allowed)");
  WS_EXPECT(tensor.shape.size() <= kMaxTensorRank, ErrorCode::kInvalidArgument,
            "update sender: tensor " + name + " has " + std::to_string(tensor.shape.size()) + " dimensions");
  auto size = tensor_byte_size(tensor.dtype, tensor.shape);
  WS_EXPECT(size && tensor.offset <= *size && tensor.bytes <= *size - tensor.offset, ErrorCode::kInvalidArgument,
            "update sender: tensor " + name + ": piece " + std::to_string(tensor.offset) + "+" +
                std::to_string(tensor.bytes) + " does not fit its shape " + shape_text(tensor.shape));
  WS_EXPECT(tensor.data != nullptr || tensor.bytes == 0, ErrorCode::kInvalidArgument,
            "update sender: tensor " + name + " has no data");
  const uint64_t capacity = state.options.bucket_bytes;
  uint64_t done = 0;
  do {
    if (state.current.entries.empty()) state.open_bucket();
    uint64_t start = (state.current.bytes + kPieceAlignment - 1) / kPieceAlignment * kPieceAlignment;
    if (start >= capacity) {  // no room after alignment: this bucket is full
      state.flush();
      continue;
    }
    uint64_t take = std::min(tensor.bytes - done, capacity - start);
    if (take > 0) state.transport->fill(state.slot, start, tensor.data + done, tensor.device, take);
    BucketEntry entry;
    entry.name = name;
    entry.dtype = tensor.dtype;
    entry.shape.assign(tensor.shape.begin(), tensor.shape.end());
    entry.tensor_offset = tensor.offset + done;
    entry.bucket_offset = start;
    entry.bytes = take;
    state.current.entries.push_back(std::move(entry));
    state.current.bytes = start + take;
    done += take;
    if (state.current.bytes >= capacity) state.flush();
  } while (done < tensor.bytes);
}

void UpdateSender::flush() {
  State& state = *state_;
  WS_EXPECT(state.started && !state.finished, ErrorCode::kInvalidArgument, "update sender: flush() outside start()/finish()");
  state.flush();
}

UpdateReport UpdateSender::finish() {
  State& state = *state_;
  WS_EXPECT(state.started && !state.finished, ErrorCode::kInvalidArgument,
            "update sender: finish() without start(), or twice");
  state.flush();
  Message message;
  message.type = MessageType::kFinish;
  message.buckets = state.next_index;
  state.guarded([&] { state.connection->send(message, state.options.timeout); });
  state.finished = true;
  for (;;) {
    Received received = state.connection->receive(state.options.timeout, "the update's REPORT");
    if (received.message.type == MessageType::kApplied) {
      state.in_flight[received.message.manifest.slot] = false;
      continue;
    }
    if (received.message.type != MessageType::kReport) state.fail_with(received.message, "the update's REPORT");
    return received.message.report;
  }
}

}  // namespace weightstream
