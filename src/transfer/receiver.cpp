// UpdateReceiver: accepts a sender, decodes each bucket's manifest into views of its bytes
// and hands them to a LoadSession in update mode, which checks them against the layout and
// writes each layer once all of it has arrived (LayerCommit::kWholeLayer). Layers the update
// covers only in part are written at FINISH. Over ucx the bucket is checked first, its
// entries that the session takes as they are land straight in their parameters, and the
// session writes the rest as it arrives (LayerCommit::kAsArrived).

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "base/errno_text.hpp"
#include "base/text.hpp"
#include "transfer/delta.hpp"
#include "transfer/handshake.hpp"
#include "transfer/socket.hpp"
#include "transfer/transport.hpp"
#include "transfer/update_checks.hpp"
#include "transfer/wire.hpp"
#include "weightstream/options.hpp"
#include "weightstream/transfer.hpp"

namespace weightstream {
namespace {

using Clock = std::chrono::steady_clock;
using namespace transfer;

/// Runs `step` and adds the seconds it took to `total` (also when it throws).
template <typename Step>
decltype(auto) timed(double& total, Step&& step) {
  struct AddElapsed {
    double& total;
    Clock::time_point begun = Clock::now();
    ~AddElapsed() { total += std::chrono::duration<double>(Clock::now() - begun).count(); }
  } add{total};
  return step();
}

std::string join_layers(const ModelLayout& layout, const std::vector<int64_t>& layers) {
  if (layers.empty()) return "none";
  std::string text;
  for (int64_t layer : layers) {
    if (!text.empty()) text += ", ";
    text += layer_label(layout, layer);
  }
  return text;
}

/// Sends `error` to the peer as an ERROR message, best effort: it may be the one that
/// vanished.
void tell_peer(Connection& connection, const Error& error) {
  Message failure;
  failure.type = MessageType::kError;
  failure.code = error.code();
  failure.text = message_text(error.what());
  try {
    connection.send(failure, std::chrono::milliseconds(1000));
  } catch (const Error&) {
  }
}

}  // namespace

struct UpdateReceiver::State {
  State(ModelLayout& layout_, ReceiverOptions options_, Listener listener_)
      : layout(layout_), options(std::move(options_)), listener(std::move(listener_)),
        wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
    WS_EXPECT(static_cast<bool>(wake), ErrorCode::kNetwork,
              self() + ": cannot create the eventfd that cancel() wakes it with: " + detail::errno_text(errno));
  }
  ModelLayout& layout;
  ReceiverOptions options;
  Listener listener;
  ListenerAuth auth;  // what a sender must prove (handshake.hpp)
  // cancel(): the flag, and an eventfd that the waits for a sender and for START poll with
  // their sockets, so that they return at once. An update under way is stopped by shutting
  // its connection down: `live_fd` is the connected sender's socket, published under
  // `live_mutex` and withdrawn before the socket is closed, so cancel() never reaches a
  // descriptor number reused by then.
  std::atomic<bool> cancelled{false};
  FileDescriptor wake;
  // Counters of UpdateReceiver::stats().
  std::atomic<uint64_t> connections_refused{0};
  std::atomic<uint64_t> senders_accepted{0};
  std::atomic<uint64_t> updates_started{0};
  std::atomic<uint64_t> updates_completed{0};
  std::atomic<uint64_t> updates_failed{0};
  std::atomic<bool> updating{false};
  std::mutex live_mutex;
  int live_fd = -1;

  void publish_connection(int fd) {
    std::lock_guard lock(live_mutex);
    live_fd = fd;
    if (cancelled.load()) ::shutdown(fd, SHUT_RDWR);
  }
  // The connected sender, kept between its updates (one connection carries any number).
  std::optional<Connection> connection;
  // Peers that connected and have not proven the token yet, each with the time by which its
  // HELLO must come. All are heard at once, never waited on one by one (ServerHandshake::
  // advance): a silent, slow or lying one delays no other. At most
  // kMaxHandshakingConnections; one more evicts the oldest.
  struct Handshaking {
    Connection connection;
    Clock::time_point deadline;
    ServerHandshake handshake;
  };
  std::vector<Handshaking> handshaking;
  std::unique_ptr<ReceiverTransport> transport;
  uint64_t bucket_bytes = 0;
  double connect_seconds = 0;  // set-up of the current connection, reported with its first update
  uint64_t updates = 0;        // updates finished on the current connection
  // One session for every update: begin() per update; its copy queue (and the arrays it
  // has grown) stays. Made anew after a failed update, which leaves it mid-load. Over
  // transports that land bytes in a buffer, it writes a layer only once all of it has
  // arrived (LayerCommit::kWholeLayer): if a sender dies after half of a layer's tensors,
  // that layer keeps its old values, not a mix. Over ucx, a bucket's tensors land straight
  // in their parameters once its manifest is checked (LayerCommit::kAsArrived): no copy
  // out of a buffer, and a sender that dies mid-layer leaves that layer part new.
  std::optional<LoadSession> session;
  // The next update, begun before its START arrives (while the trainer computes it) in the
  // format of the last update: with 10,000 tensors it is about half a millisecond that
  // would otherwise come before the first copy. Used when START asks for that format,
  // begun anew otherwise.
  std::optional<TensorFormat> prepared;
  std::optional<TensorFormat> last_format;
  // The version the layout holds (UpdateReceiver::set_version); empty: unknown.
  mutable std::mutex version_mutex;
  std::string version;

  std::string held_version() const {
    std::lock_guard lock(version_mutex);
    return version;
  }
  void hold_version(std::string content_digest) {
    std::lock_guard lock(version_mutex);
    version = std::move(content_digest);
  }

  /// Refuses a delta update this receiver cannot apply, before its first byte: another base
  /// version than the one it holds, an unknown one, or buckets on a GPU.
  void check_delta(const UpdateVersions& versions) const {
    const std::string held = held_version();
    WS_EXPECT(!held.empty(), ErrorCode::kModel,
              "the delta update applies to content digest " + versions.base +
                  " but this receiver's version is unknown (none was set after its load, or an update left it so); "
                  "send a full update");
    WS_EXPECT(held == versions.base, ErrorCode::kModel,
              "the delta update applies to content digest " + versions.base + " but this receiver holds " + held +
                  "; send a full update, or a delta from " + held);
    WS_EXPECT(!transport->device().is_cuda(), ErrorCode::kUnsupported,
              "a delta update lands through host buckets only, and this receiver's are on " + transport->device().name());
  }

  /// Forgets an update prepared ahead: its session was begun (nothing written), so the
  /// next update makes a new one.
  void discard_prepared() {
    if (prepared) session.reset();
    prepared.reset();
  }

  /// Begins the session of an update in `format`.
  void prepare(TensorFormat format) {
    if (prepared == format) return;
    discard_prepared();
    if (!session) session.emplace(layout);
    session->begin(LoadMode::kUpdate, format, commit());
    prepared = format;
  }

  /// How the session writes layers: as their tensors arrive where the transport lands
  /// bucket bytes straight in the parameters (ucx), whole layers otherwise.
  LayerCommit commit() const {
    return transport && transport->places() ? LayerCommit::kAsArrived : LayerCommit::kWholeLayer;
  }

  /// Prepares the next update of the connection ahead of its START, when an update in some
  /// format ran before; a failure here is left for that update to meet and report.
  void prepare_ahead() {
    if (!last_format || prepared) return;
    try {
      prepare(*last_format);
    } catch (const Error&) {
      session.reset();
      discard_prepared();
    }
  }

  /// Logs a peer refused or dropped, and counts it.
  void refused_peer(const Connection& peer, const std::string& reason) {
    connections_refused.fetch_add(1, std::memory_order_relaxed);
    log_refused(peer, self(), reason);
  }

  /// Runs the update whose START arrived, counted as started, then completed or failed.
  UpdateReport counted_update(const Message& start, const std::string* refusal = nullptr) {
    updates_started.fetch_add(1, std::memory_order_relaxed);
    updating = true;
    try {
      UpdateReport report = run_update(start, Clock::now(), refusal);
      updates_completed.fetch_add(1, std::memory_order_relaxed);
      updating = false;
      return report;
    } catch (...) {
      updates_failed.fetch_add(1, std::memory_order_relaxed);
      updating = false;
      throw;
    }
  }

  std::string self() const {
    return "update receiver at " + listener.address() + " (" + std::string(transport_name(options.transport)) + ")";
  }

  void drop_connection() {
    discard_prepared();  // prepared for this connection's transport (its device, its regions)
    transport.reset();
    publish_connection(-1);
    connection.reset();
    updates = 0;
  }

  /// Throws Error(kCancelled) once cancel() was called; `waiting` says for what.
  void check_cancelled(const std::string& waiting) const {
    WS_EXPECT(!cancelled.load(), ErrorCode::kCancelled, self() + ": cancelled while waiting for " + waiting);
  }

  /// Waits until the connected sender's next message (or its hang-up) can be read, for at
  /// most `timeout`; returns at once when cancel() is called (check_cancelled tells).
  void wait_for_message(std::chrono::milliseconds timeout) const {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      pollfd waits[2] = {{connection->fd(), POLLIN, 0}, {wake.get(), POLLIN, 0}};
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      int ready = ::poll(waits, 2, static_cast<int>(std::clamp<long long>(left, 0, 1 << 30)));
      if (ready < 0 && errno == EINTR) continue;
      return;  // ready, timed out or failed: the read that follows reports which
    }
  }

  /// Accepts peers until one proves the token and presents a HELLO this receiver takes,
  /// then sets up its transport: WELCOME, join. A peer that stays silent past the handshake
  /// timeout, cannot prove the token or speaks garbage is dropped and logged once, and the
  /// receiver goes on waiting for the next until `accept_timeout`.
  void connect(std::chrono::milliseconds accept_timeout);
  /// Hears the HELLO of a peer that has proven the token and sets up its transport. False,
  /// with `dropped` saying why, when the peer left, stalled or sent what this receiver
  /// refuses before its HELLO was taken (the peer is told why, where it can be); throws
  /// when setting up the transport fails.
  bool greet(Connection accepted, Clock::time_point hello_deadline, std::string& dropped);
  /// Peers dropped by connect() meanwhile, for its timeout's message.
  uint64_t silent = 0;   // sent no HELLO within the handshake timeout
  uint64_t left = 0;     // disconnected before their HELLO
  uint64_t refused = 0;  // failed the handshake or sent garbage
  std::string last_refusal;
  /// Waits (at most `accept_timeout`, accepting a sender when none is connected) for the
  /// next update's START.
  Received await_start(std::chrono::milliseconds accept_timeout);
  /// Runs one update on the connection, from its START to its REPORT; with a `refusal`,
  /// answers the START with it instead and throws.
  UpdateReport run_update(const Message& start, Clock::time_point started, const std::string* refusal = nullptr);

  /// The layers of the bucket being received whose bytes may be landing in place (for a
  /// failure's report).
  std::vector<int64_t> placing_layers;

  /// Where the entries of a checked bucket land when the session takes their bytes where
  /// they are (LoadSession::direct_destination), by offset in the bucket; `entries` gets
  /// each one's index in the manifest. A bucket whose entries share bytes lands whole in
  /// the buffer.
  std::vector<ReceiverTransport::Placement> bucket_placements(const BucketManifest& manifest,
                                                              std::vector<size_t>& entries) const {
    std::vector<size_t> order;
    for (size_t i = 0; i < manifest.entries.size(); ++i) {
      const BucketEntry& entry = manifest.entries[i];
      if (entry.source == 0 && entry.bytes > 0 && entry.encoding == EntryEncoding::kBytes) order.push_back(i);
    }
    std::ranges::sort(order, {}, [&](size_t i) { return manifest.entries[i].source_offset; });
    std::vector<ReceiverTransport::Placement> placements;
    // GPU parameters take their bytes straight from a transport that moves GPU memory.
    const Device device = layout.device();
    const bool into_gpu = device.is_cuda() && transport->places_on(device);
    uint64_t end = 0;
    for (size_t i : order) {
      const BucketEntry& entry = manifest.entries[i];
      if (entry.source_offset < end) {
        entries.clear();
        return {};
      }
      end = entry.source_offset + entry.bytes;
      std::byte* destination = session->direct_destination(entry.name, entry.dtype, entry.shape, entry.tensor_offset,
                                                           entry.bytes, into_gpu);
      if (destination == nullptr) continue;
      placements.push_back({entry.source_offset, entry.bytes, destination, device});
      entries.push_back(i);
    }
    return placements;
  }

  /// The layers of the parameters the entries `entries` of `manifest` land in.
  std::vector<int64_t> placed_layers(const BucketManifest& manifest, const std::vector<size_t>& entries) const {
    std::vector<int64_t> layers;
    for (size_t index : entries) {
      TensorRoute route = layout.route(manifest.entries[index].name);
      for (const auto& target : route.targets) layers.push_back(layout.parameters()[target.first].layer);
    }
    return layers;
  }
};

namespace {

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
      accepted.send(refusal, std::chrono::milliseconds(1000));
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
    hello = accepted.receive(hello_left, "HELLO");
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
    accepted.send(welcome, timeout, made->welcome_fd());
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
      return connection->receive(left(), "START");
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

UpdateReport UpdateReceiver::State::run_update(const Message& start_message, Clock::time_point started,
                                               const std::string* refusal) {
  const auto timeout = options.timeout;
  Connection& link = *connection;
  const std::string peer = link.peer();
  uint64_t buckets = 0;       // buckets received and applied
  uint64_t bytes = 0;
  uint64_t shared_bytes = 0;  // bytes read in place from shared regions
  uint64_t placed_bytes = 0;  // bucket bytes that landed straight in their parameters
  uint32_t regions_open = 0;  // regions the sender shared in this update
  UpdatePhases phases;
  placing_layers.clear();

  std::optional<uint64_t> current;  // the bucket being checked and applied
  bool loading = false;             // a bucket was handed to the session: the version held is unknown
  bool landed = false;              // every byte landed and the hooks ran (a delta's check follows)
  auto last_bucket_text = [&] {
    if (current) return "at bucket " + std::to_string(*current) + " (" + std::to_string(buckets) + " applied before it)";
    return buckets == 0 ? std::string("before any bucket arrived")
                        : "after bucket " + std::to_string(buckets - 1) + " (the last received)";
  };
  try {
    WS_EXPECT(start_message.type == MessageType::kStart, ErrorCode::kProtocol,
              "expected START, got " + std::string(message_type_name(start_message.type)));
    WS_EXPECT(refusal == nullptr, ErrorCode::kModel, refusal ? *refusal : std::string());
    const TensorFormat format = start_message.format;
    timed(phases.preparing, [&] { prepare(format); });  // nothing to do when prepared ahead
    prepared.reset();  // this update's now
    last_format = format;
    // The whole update is checked before its first byte: a refusal writes nothing.
    const bool delta = !start_message.versions.base.empty();
    ManifestLedger ledger = timed(phases.checking, [&] {
      if (delta) check_delta(start_message.versions);
      ManifestLedger checked = check_manifest(layout, *session, format, start_message.declared, delta);
      Message accepted;
      accepted.type = MessageType::kAccepted;
      // A delta's sender sends each element this receiver holds, and digests them for FINISH.
      if (delta) accepted.held = held_windows(layout, start_message.declared);
      link.send(accepted, timeout);
      return checked;
    });
    uint64_t sparse_tensors = 0;

    // ---- buckets, then finish ----
    for (;;) {
      Received received = timed(phases.waiting, [&] {
        return link.receive(timeout, "bucket " + std::to_string(buckets) + " or FINISH");
      });
      phases.waiting -= received.parse_seconds;
      phases.parsing += received.parse_seconds;
      if (buckets == 0) phases.first_bucket = std::chrono::duration<double>(Clock::now() - started).count();
      Message& message = received.message;
      WS_EXPECT(message.type != MessageType::kError, ErrorCode::kModel, message.text);  // the sender gave up
      if (message.type == MessageType::kFinish) {
        WS_EXPECT(message.buckets == buckets, ErrorCode::kProtocol,
                  "FINISH says " + std::to_string(message.buckets) + " buckets were sent but " +
                      std::to_string(buckets) + " arrived");
        // Every declared tensor whole, before the layers still held are written: an FP8
        // weight's codes never land without the scales the manifest paired them with.
        std::vector<std::string> short_of;
        for (size_t i = 0; i < ledger.bytes.size(); ++i) {
          if (ledger.received[i] == ledger.bytes[i]) continue;
          short_of.push_back(start_message.declared[i].name + " (" + std::to_string(ledger.received[i]) + " of " +
                             std::to_string(ledger.bytes[i]) + " bytes)");
        }
        if (!short_of.empty()) {
          std::string names;
          for (size_t i = 0; i < short_of.size() && i < kProblemsListed; ++i) names += (i ? ", " : "") + short_of[i];
          if (short_of.size() > kProblemsListed) names += " and " + std::to_string(short_of.size() - kProblemsListed) + " more";
          WS_FAIL(ErrorCode::kModel, "FINISH came before " + std::to_string(short_of.size()) + " declared tensor" +
                                         (short_of.size() == 1 ? "" : "s") + " arrived whole: " + names);
        }
        timed(phases.copying, [&] { session->settle(); });
        timed(phases.finishing, [&] { session->finish(); });
        landed = true;
        UpdateReport report;
        if (delta) {
          hold_version("");  // known again once what landed is checked
          report.checked_tensors = timed(phases.verifying, [&] {
            return check_held_digests(layout, start_message.declared, message.digests, ledger.sent_as_changes,
                                      start_message.versions.target, std::max(1u, std::thread::hardware_concurrency()));
          });
        }
        timed(phases.closing, [&] { transport->end_update(); });
        report.format = format;
        report.buckets = buckets;
        report.bytes = bytes;
        report.shared_bytes = shared_bytes;
        report.placed_bytes = placed_bytes;
        report.regions = regions_open;
        report.tensors = session->counters().tensors_applied;
        report.sparse_tensors = sparse_tensors;
        report.dense_tensors = start_message.declared.size() - sparse_tensors;
        report.seconds = std::chrono::duration<double>(Clock::now() - started).count();
        report.connect_seconds = updates == 0 ? connect_seconds : 0;
        report.counters = session->counters();
        report.phases = phases;
        report.completed_layers = session->completed_layers();
        Message answer;
        answer.type = MessageType::kReport;
        answer.report = report;
        hold_version(start_message.versions.target);
        link.send(answer, timeout);
        ++updates;
        return report;
      }
      WS_EXPECT(message.type == MessageType::kBucket, ErrorCode::kProtocol,
                "expected bucket " + std::to_string(buckets) + " or FINISH, got " +
                    std::string(message_type_name(message.type)));
      BucketManifest& manifest = message.manifest;
      WS_EXPECT(manifest.index == buckets, ErrorCode::kProtocol,
                "bucket numbered " + std::to_string(manifest.index) + " arrived where bucket " +
                    std::to_string(buckets) + " was due");
      WS_EXPECT(manifest.bytes <= bucket_bytes, ErrorCode::kProtocol,
                "bucket " + std::to_string(manifest.index) + " claims " + std::to_string(manifest.bytes) +
                    " bytes, more than the agreed bucket size " + std::to_string(bucket_bytes));
      current = manifest.index;
      // What the manifest did not declare, or declared otherwise, is refused before the
      // bucket's bytes are received.
      sparse_tensors += ledger.account(manifest, start_message.declared, delta);
      for (const SharedRegion& region : manifest.regions) {
        WS_EXPECT(region.id == regions_open, ErrorCode::kProtocol,
                  "bucket " + std::to_string(manifest.index) + " shares region " + std::to_string(region.id) +
                      " where region " + std::to_string(regions_open) + " was due");
        timed(phases.opening, [&] { transport->open_region(region); });
        ++regions_open;
      }
      std::vector<TensorView> views = bucket_views(manifest, transport->slot(manifest.slot), *transport);
      // Where the transport lands bytes where they belong: the bucket is checked whole,
      // then its entries bound as they are to one place of a host parameter are received
      // there (its other bytes land in the buffer).
      std::vector<size_t> placed_entries;  // indices into views, by offset in the bucket
      std::vector<ReceiverTransport::Placement> placements;
      if (manifest.bytes > 0 && transport->places()) {
        timed(phases.checking, [&] {
          try {
            session->check(views);
            placements = bucket_placements(manifest, placed_entries);
          } catch (const Error&) {
            transport->place(manifest.slot, {});  // the pieces land in the buffer, unread
            throw;
          }
        });
        placing_layers = placed_layers(manifest, placed_entries);
        transport->place(manifest.slot, placements);
      }
      if (manifest.bytes > 0) {
        timed(phases.waiting, [&] {
          transport->receive(link, manifest.slot, manifest.bytes, timeout,
                             "the " + std::to_string(manifest.bytes) + "-byte payload of bucket " +
                                 std::to_string(manifest.index));
        });
      }
      timed(phases.checking, [&] {
        decode_changes(manifest, transport->slot(manifest.slot), views);
        // The session checks every entry before any byte of the bucket is written (or held
        // back); copies within the GPU are only issued, so the next bucket's checks overlap them.
        // Entries that landed in place are checked and counted, not copied.
        if (!placements.empty()) {
          std::vector<bool> landed_in_place = transport->placed(manifest.slot);
          for (size_t i = 0; i < placed_entries.size(); ++i) {
            if (!landed_in_place[i]) continue;
            views[placed_entries[i]].data = placements[i].destination;
            views[placed_entries[i]].device = placements[i].device;
            placed_bytes += placements[i].bytes;
          }
        }
        if (!views.empty() && !loading) {
          loading = true;
          hold_version("");  // from here bytes land: unknown until the whole update has
        }
        if (!views.empty()) session->load(views);
      });
      placing_layers.clear();
      if (manifest.bytes > 0) {
        // The sender refills this slot once it hears APPLIED: on a GPU the copies out of it
        // must be done by then, not merely issued.
        timed(phases.copying, [&] { session->settle(); });
      }
      current.reset();
      ++buckets;
      bytes += manifest.bytes;
      for (const BucketEntry& entry : manifest.entries) shared_bytes += entry.source != 0 ? entry.bytes : 0;
      Message applied;
      applied.type = MessageType::kApplied;
      applied.manifest.index = manifest.index;
      applied.manifest.slot = manifest.slot;
      link.send(applied, timeout);
    }
  } catch (const Error& error) {
    // Tell the sender why, then drop the connection: after a failure neither side knows
    // where the other stands.
    tell_peer(link, error);
    std::string applied = session ? join_layers(layout, session->completed_layers()) : "none";
    std::string part_new;  // over ucx, layers whose tensors landed in part
    if (session && commit() == LayerCommit::kAsArrived) {
      std::vector<int64_t> completed = session->completed_layers();
      std::set<int64_t> touched(placing_layers.begin(), placing_layers.end());
      for (int64_t layer : session->touched_layers()) touched.insert(layer);
      std::vector<int64_t> partial;
      std::ranges::set_difference(touched, completed, std::back_inserter(partial));
      part_new = "; layers written in part (over ucx, tensors land in their parameters as they arrive): " +
                 join_layers(layout, partial);
    }
    session.reset();  // waits for copies issued from the sender's regions before closing them
    drop_connection();  // closes the regions
    WS_EXPECT(!landed, error.code(), "update from " + peer + " to " + self() + " failed after it landed: " + error.what());
    const bool stopped = cancelled.load();
    WS_FAIL(stopped ? ErrorCode::kCancelled : error.code(),
            "update from " + peer + " to " + self() + " failed " + last_bucket_text() + ": " +
                (stopped ? "cancelled (the receiver was cancelled, which shut the connection down)"
                         : std::string(error.what())) + "; layers completed and applied before the failure: " + applied +
                              part_new + "; every other layer keeps its old values (a reload restores a consistent model)");
  }
}

}  // namespace weightstream
