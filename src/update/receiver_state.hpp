#pragma once
// The state of an UpdateReceiver, shared by its two sources: receiver.cpp (listening,
// accepting a sender, waiting for START) and receiver_update.cpp (one update, from its
// START to its REPORT).
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
#include "update/delta.hpp"
#include "net/handshake.hpp"
#include "net/socket.hpp"
#include "update/transport.hpp"
#include "update/update_checks.hpp"
#include "update/wire.hpp"
#include "weightstream/options.hpp"
#include "weightstream/transfer.hpp"


namespace weightstream {
// This header is the receiver's own (receiver.cpp, receiver_update.cpp): the protocol's
// names read unqualified there.
using namespace transfer;

namespace receiver {

using Clock = std::chrono::steady_clock;

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

/// The labels of `layers` ("layer 0, layer 1, lm_head"), or "none".
std::string join_layers(const ModelLayout& layout, const std::vector<int64_t>& layers);

/// Sends `error` to the peer as an ERROR message, best effort: it may be the one that
/// vanished.
void tell_peer(Connection& connection, const Error& error);

}  // namespace receiver

struct UpdateReceiver::State {
  using Clock = receiver::Clock;
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

  /// Where one update stands, for its report and a failure's message.
  struct UpdateProgress {
    bool delta = false;         // a delta update (START names a base version)
    uint64_t buckets = 0;       // buckets received and applied
    uint64_t bytes = 0;
    uint64_t shared_bytes = 0;  // bytes read in place from shared regions
    uint64_t placed_bytes = 0;  // bucket bytes that landed straight in their parameters
    uint32_t regions_open = 0;  // regions the sender shared in this update
    uint64_t sparse_tensors = 0;
    UpdatePhases phases;
    std::optional<uint64_t> current;  // the bucket being checked and applied
    bool loading = false;             // a bucket was handed to the session: the version held is unknown
    bool landed = false;              // every byte landed and the hooks ran (a delta's check follows)
    std::string last_bucket_text() const {
      if (current) return "at bucket " + std::to_string(*current) + " (" + std::to_string(buckets) + " applied before it)";
      return buckets == 0 ? std::string("before any bucket arrived")
                          : "after bucket " + std::to_string(buckets - 1) + " (the last received)";
    }
  };
  /// Entries of a bucket the transport lands in their parameters: `placements`, and each
  /// one's index among the bucket's views in `entries`.
  struct BucketPlacement {
    std::vector<ReceiverTransport::Placement> placements;
    std::vector<size_t> entries;
  };
  /// Prepares for the update of `start`, checks its manifest whole and answers ACCEPTED.
  ManifestLedger accept_update(const Message& start, UpdateProgress& progress);
  /// Checks one bucket against the manifest, receives its bytes and hands them to the
  /// session, then answers APPLIED.
  void apply_bucket(BucketManifest& manifest, const Message& start, ManifestLedger& ledger, UpdateProgress& progress);
  /// Checks the bucket's views whole and tells the transport where its entries may land.
  BucketPlacement place_bucket(const BucketManifest& manifest, const std::vector<TensorView>& views,
                               UpdatePhases& phases);
  /// Decodes changed elements and hands the bucket's views (those that landed in place
  /// pointing there) to the session.
  void load_bucket(const BucketManifest& manifest, std::vector<TensorView>& views, const BucketPlacement& placement,
                   UpdateProgress& progress);
  /// FINISH: every declared tensor whole, the session finished, a delta's windows checked,
  /// the REPORT sent.
  UpdateReport finish_update(const Message& start, const Message& finish, const ManifestLedger& ledger,
                             UpdateProgress& progress, Clock::time_point started);
  /// Throws Error(kModel) naming the declared tensors that did not arrive whole.
  static void check_whole(const ManifestLedger& ledger, const std::vector<DeclaredTensor>& declared);
  /// Tells the sender why the update failed, drops the connection and throws the error
  /// with what was applied before it.
  [[noreturn]] void fail_update(const Error& error, Connection& link, const std::string& peer,
                                const UpdateProgress& progress);

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

}  // namespace weightstream
