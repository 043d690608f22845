// UpdateReceiver: accepts a sender, decodes each bucket's manifest into views of its bytes
// and hands them to a LoadSession in update mode, which checks them against the layout and
// writes each layer once all of it has arrived (LayerCommit::kWholeLayer). Layers the update
// covers only in part are written at FINISH. Over ucx the bucket is checked first, its
// entries that the session takes as they are land straight in their parameters, and the
// session writes the rest as it arrives (LayerCommit::kAsArrived).

#include "update/receiver_state.hpp"

namespace weightstream {
namespace {

using receiver::Clock;
using receiver::tell_peer;

/// Where a same-host receiver listens: the path asked for, or a fresh one in the socket
/// directory (the caller's, or the TMPDIR of the environment).
std::string unix_socket_path(const ReceiverOptions& options) {
  if (!options.listen.empty()) return options.listen;
  return Listener::fresh_unix_socket_path(options.socket_directory.empty() ? temporary_directory(process_environment())
                                                                          : options.socket_directory);
}

using detail::seconds_text;

}  // namespace

UpdateReceiver::UpdateReceiver(ModelLayout& layout, ReceiverOptions options)
    : state_(std::make_unique<State>(layout, options,
                                     options.transport == TransportKind::kShm || options.transport == TransportKind::kCudaIpc
                                         ? Listener::unix_socket(unix_socket_path(options))
                                         : Listener::tcp(options.listen))) {
  state_->auth = listener_auth(options.token, options.open_without_token, "update receiver on " + address());
  WS_EXPECT(transport_compiled(options.transport), ErrorCode::kUnsupported,
            "update receiver: the " + std::string(transport_name(options.transport)) +
                " transport is not compiled into this build");
}

UpdateReceiver::~UpdateReceiver() = default;

void UpdateReceiver::cancel() noexcept {
  State& state = *state_;
  state.cancelled.store(true);
  const uint64_t one = 1;
  // Only fails when the counter would overflow, which takes 2^64 - 2 calls: it is readable anyway.
  (void)!::write(state.wake.get(), &one, sizeof(one));
  // An update under way: its reads and writes on the socket fail at once (EOF, EPIPE).
  std::lock_guard lock(state.live_mutex);
  if (state.live_fd >= 0) ::shutdown(state.live_fd, SHUT_RDWR);
}

const std::string& UpdateReceiver::address() const noexcept { return state_->listener.address(); }

ReceiverStats UpdateReceiver::stats() const noexcept {
  const State& state = *state_;
  ReceiverStats stats;
  stats.connections_refused = state.connections_refused.load(std::memory_order_relaxed);
  stats.senders_accepted = state.senders_accepted.load(std::memory_order_relaxed);
  stats.updates_started = state.updates_started.load(std::memory_order_relaxed);
  stats.updates_completed = state.updates_completed.load(std::memory_order_relaxed);
  stats.updates_failed = state.updates_failed.load(std::memory_order_relaxed);
  stats.updating = state.updating.load();
  return stats;
}

void UpdateReceiver::set_version(std::string content_digest) { state_->hold_version(std::move(content_digest)); }

std::string UpdateReceiver::version() const { return state_->held_version(); }

void UpdateReceiver::State::connect(std::chrono::milliseconds accept_timeout) {
  const auto deadline = Clock::now() + accept_timeout;
  silent = left = refused = 0;
  last_refusal.clear();
  constexpr auto kSendTimeout = std::chrono::milliseconds(500);
  auto drop = [&](const Connection& peer, const std::string& reason) {
    refused_peer(peer, reason);
    ++refused;
    last_refusal = reason;
  };
  for (;;) {
    check_cancelled("a sender to connect");
    auto now = Clock::now();
    std::erase_if(handshaking, [&](Handshaking& peer) {
      if (peer.deadline > now) return false;
      refused_peer(peer.connection,
                   "no handshake and HELLO within the handshake timeout of " + seconds_text(options.handshake_timeout));
      ++silent;
      return true;
    });
    std::vector<pollfd> waits;
    waits.push_back(pollfd{listener.fd(), POLLIN, 0});
    auto wake = deadline;
    for (const Handshaking& peer : handshaking) {
      waits.push_back(pollfd{peer.connection.fd(), POLLIN, 0});
      wake = std::min(wake, peer.deadline);
    }
    waits.push_back(pollfd{this->wake.get(), POLLIN, 0});  // last: cancel()
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(wake - now).count();
    int ready = ::poll(waits.data(), waits.size(), static_cast<int>(std::clamp<long long>(wait, 0, 1 << 30)));
    if (ready < 0 && errno == EINTR) continue;
    if (waits.back().revents != 0) continue;  // cancelled: reported at the top
    WS_EXPECT(ready >= 0, ErrorCode::kNetwork, self() + ": poll failed: " + detail::errno_text(errno));
    if (ready == 0) {
      if (Clock::now() < deadline) continue;  // a peer's handshake deadline: dropped above
      std::string dropped;
      if (silent > 0) {
        dropped += "; " + std::to_string(silent) + " peer(s) connected but sent no HELLO within the handshake timeout of " +
                   seconds_text(options.handshake_timeout) + " and were dropped";
      }
      if (left > 0) dropped += "; " + std::to_string(left) + " peer(s) disconnected before their HELLO";
      if (refused > 0) dropped += "; " + std::to_string(refused) + " peer(s) were refused (the last: " + last_refusal + ")";
      WS_FAIL(ErrorCode::kTimeout, "no sender connected to " + listener.address() + " within " +
                                       seconds_text(accept_timeout) + dropped);
    }
    // Every peer with bytes waiting is heard, in the order they connected; none is waited on.
    std::vector<bool> gone(handshaking.size(), false);
    for (size_t i = 0; i < handshaking.size(); ++i) {
      if ((waits[i + 1].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      Handshaking& peer = handshaking[i];
      try {
        if (!peer.handshake.advance(peer.connection, kSendTimeout)) continue;
      } catch (const Error& error) {
        gone[i] = true;
        if (error.code() == ErrorCode::kNetwork) {
          ++left;  // a sender that stopped at the receiver's proof (another token), or a port probe
          if (peer.handshake.heard()) refused_peer(peer.connection, error.what());
        } else {
          drop(peer.connection, error.what());
        }
        continue;
      }
      // Proven: its HELLO comes next, by the same deadline.
      gone[i] = true;
      std::string reason;
      if (greet(std::move(peer.connection), peer.deadline, reason)) break;
      if (reason.empty()) {
        ++left;
      } else {
        ++refused;
        last_refusal = reason;
      }
    }
    for (size_t i = gone.size(); i-- > 0;) {
      if (gone[i]) handshaking.erase(handshaking.begin() + static_cast<ptrdiff_t>(i));
    }
    if (connection) return;  // the others wait for the next receive() (their deadlines go on)
    if ((waits[0].revents & POLLIN) != 0) {
      Connection accepted = listener.accept(std::chrono::milliseconds(0));
      if (handshaking.size() >= kMaxHandshakingConnections) {
        // The oldest makes room: a flood of idle strangers keeps no real sender out.
        drop(handshaking.front().connection, "dropped mid-handshake to make room (" +
                                                 std::to_string(kMaxHandshakingConnections) +
                                                 " connections at once were mid-handshake)");
        handshaking.erase(handshaking.begin());
      }
      handshaking.push_back(Handshaking{std::move(accepted), Clock::now() + options.handshake_timeout,
                                        ServerHandshake(kUpdateHandshake, auth)});
    }
  }
}

bool UpdateReceiver::State::greet(Connection accepted, Clock::time_point hello_deadline, std::string& dropped) {
  const auto timeout = options.timeout;
  const auto started = Clock::now();
  const std::string peer = accepted.peer();

  // Refuses the HELLO: the sender is told why, the refusal logged, and the receiver waits on.
  auto refuse = [&](const std::string& reason) {
    Message refusal;
    refusal.type = MessageType::kRefuse;
    refusal.text = reason;
    try {
      send_message(accepted, refusal, std::chrono::milliseconds(1000));
    } catch (const Error&) {
      // The peer may already be gone; the refusal is logged here either way.
    }
    refused_peer(accepted, reason);
    dropped = reason;
    return false;
  };

  Received hello;
  try {
    // The HELLO of a peer that has proven the token must come by the same deadline.
    const auto hello_left = std::max(std::chrono::milliseconds(100), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                                         hello_deadline - Clock::now()));
    hello = receive_message(accepted, hello_left, "HELLO");
  } catch (const Error& error) {
    // A peer that leaves before its HELLO was no sender; one that stalls or sends garbage is
    // dropped and logged. Either way the receiver goes on waiting for one.
    if (error.code() == ErrorCode::kNetwork) return false;
    refused_peer(accepted, error.what());
    dropped = error.what();
    return false;
  }
  if (hello.message.type != MessageType::kHello) {
    return refuse("expected HELLO, got " + std::string(message_type_name(hello.message.type)));
  }
  if (hello.message.transport != options.transport) {
    return refuse("the sender asked for transport " + std::string(transport_name(hello.message.transport)) +
                  " but this receiver serves " + std::string(transport_name(options.transport)));
  }
  if (hello.message.bucket_bytes > options.max_bucket_bytes) {
    return refuse("bucket size " + std::to_string(hello.message.bucket_bytes) +
                  " bytes exceeds this receiver's limit of " + std::to_string(options.max_bucket_bytes));
  }
  try {
    auto made = make_receiver_transport(options.transport, hello.message.bucket_bytes, options.device, hello.message.blob,
                                        hello.message.receivers, hello.message.receiver_index);
    Message welcome;
    welcome.type = MessageType::kWelcome;
    welcome.bucket_bytes = hello.message.bucket_bytes;
    welcome.slots = 2;
    welcome.blob = made->welcome_blob();
    send_message(accepted, welcome, timeout, made->welcome_fd());
    made->join(timeout);
    transport = std::move(made);
  } catch (const Error& error) {
    tell_peer(accepted, error);
    WS_FAIL(error.code(), "connection from " + peer + " to " + self() + " failed before any update: " + error.what());
  }
  bucket_bytes = hello.message.bucket_bytes;
  connection.emplace(std::move(accepted));
  senders_accepted.fetch_add(1, std::memory_order_relaxed);
  publish_connection(connection->fd());
  connect_seconds = std::chrono::duration<double>(Clock::now() - started).count();
  updates = 0;
  return true;
}

Received UpdateReceiver::State::await_start(std::chrono::milliseconds accept_timeout) {
  const auto deadline = Clock::now() + accept_timeout;
  auto left = [&] {
    return std::max(std::chrono::milliseconds(0),
                    std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
  };
  for (;;) {
    if (!connection) connect(left());
    // A connected sender may take its time between updates (a trainer computing the next
    // weights): START is awaited as long as the caller waits for an update.
    try {
      prepare_ahead();
      wait_for_message(left());
      check_cancelled("the next update from " + connection->peer());
      return receive_message(*connection, left(), "START");
    } catch (const Error& error) {
      if (cancelled.load()) throw;  // the sender stays connected; nothing was received
      const bool between_updates = updates > 0;
      const std::string peer = connection->peer();
      drop_connection();
      // A sender that leaves after its last update is done; wait for the next one.
      if (between_updates && error.code() == ErrorCode::kNetwork) continue;
      WS_FAIL(error.code(), "update from " + peer + " to " + self() + " failed before it started: " + error.what());
    }
  }
}

UpdateReport UpdateReceiver::receive(std::chrono::milliseconds accept_timeout) {
  State& state = *state_;
  Received start = state.await_start(accept_timeout);
  return state.counted_update(start.message);
}

void UpdateReceiver::refuse(const std::string& reason, std::chrono::milliseconds accept_timeout) {
  State& state = *state_;
  Received start = state.await_start(accept_timeout);
  state.counted_update(start.message, &reason);
  WS_FAIL(ErrorCode::kInternal, state.self() + ": an update was applied where it was to be refused");
}

}  // namespace weightstream
