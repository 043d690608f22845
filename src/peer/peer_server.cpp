// PeerServer: publishes a loaded layout's parameters to pullers. One thread accepts control
// connections and runs their handshakes side by side without ever waiting on one (poll and
// ServerHandshake::advance, each with one whole-handshake deadline); a puller that has
// proven the token gets a thread of its own for its requests (manifest, version), so a
// slow one delays no other. Both kinds are bounded. UCX's progress thread serves the reads
// (one-sided gets, and the send requests of pullers on the rendezvous path).
#include <fcntl.h>
#include <poll.h>
#include <unistd.h>
#include <xxhash.h>

#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <list>
#include <map>
#include <mutex>
#include <thread>

#include "base/errno_text.hpp"
#include "base/text.hpp"
#include "peer/peer_protocol.hpp"
#include "net/socket.hpp"
#include "net/ucx.hpp"
#include "weightstream/error.hpp"
#include "weightstream/peer.hpp"

namespace weightstream {
namespace {

using Clock = std::chrono::steady_clock;
using namespace transfer;

/// The dtype most of the layout's bytes have, or "mixed" when none has most of them.
std::string layout_dtype(const ModelLayout& layout) {
  std::map<Dtype, uint64_t> bytes;
  uint64_t total = 0;
  for (const Parameter& parameter : layout.parameters()) {
    bytes[parameter.dtype] += parameter.bytes();
    total += parameter.bytes();
  }
  for (auto [dtype, count] : bytes) {
    if (2 * count > total) return std::string(dtype_name(dtype));
  }
  return "mixed";
}

/// Pullers served at once by one server, past their handshakes; one more is refused.
constexpr size_t kMaxPullers = 64;
/// Largest request a puller sends (HELLO and VERSION are empty objects).
constexpr uint64_t kMaxPullerRequestBytes = 64 << 10;

}  // namespace

bool is_peer_uri(std::string_view uri) noexcept { return uri.starts_with(kPeerScheme); }

std::vector<std::string> peer_addresses(std::string_view uri) {
  WS_EXPECT(is_peer_uri(uri), ErrorCode::kInvalidArgument, "'" + std::string(uri) + "' is not a peer:// URI");
  std::vector<std::string> addresses;
  std::string_view rest = uri.substr(kPeerScheme.size());
  while (!rest.empty()) {
    size_t comma = rest.find(',');
    std::string address(rest.substr(0, comma));
    WS_EXPECT(!address.empty(), ErrorCode::kInvalidArgument, "peer URI " + std::string(uri) + " has an empty address");
    split_host_port(address);  // checks HOST:PORT
    addresses.push_back(address);
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
    WS_EXPECT(!rest.empty(), ErrorCode::kInvalidArgument, "peer URI " + std::string(uri) + " ends with a comma");
  }
  WS_EXPECT(!addresses.empty(), ErrorCode::kInvalidArgument,
            "peer URI " + std::string(uri) + " names no HOST:PORT (peer://HOST:PORT[,HOST:PORT...])");
  return addresses;
}

std::string peer_checkpoint_identity(std::span<const PeerTensor> tensors, std::string_view config_json) {
  std::vector<const PeerTensor*> sorted;
  for (const PeerTensor& tensor : tensors) sorted.push_back(&tensor);
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->name < b->name; });
  XXH64_state_t* state = XXH64_createState();
  XXH64_reset(state, 0);
  auto add = [&](std::string_view text) {
    XXH64_update(state, text.data(), text.size());
    XXH64_update(state, "\n", 1);
  };
  for (const PeerTensor* tensor : sorted) {
    add(tensor->name);
    add(dtype_name(tensor->dtype));
    add(shape_text(tensor->shape));
    add(tensor->shard);
  }
  add(config_json);
  uint64_t digest = XXH64_digest(state);
  XXH64_freeState(state);
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(digest));
  return text;
}

struct PeerServer::State {
  const ModelLayout& layout;
  PeerServeOptions options;
  Listener listener;
  ListenerAuth auth;  // what a puller must prove (handshake.hpp)
  // Declared before the registrations: they are deregistered before the worker goes.
  transfer::ucx::Worker worker;
  std::vector<std::unique_ptr<transfer::ucx::Registration>> registrations;
  std::mutex mutex;  // guards manifest, manifest_text, updating
  PeerManifest manifest;
  bool updating = false;
  std::thread thread;
  std::atomic<bool> stop{false};
  int wake[2] = {-1, -1};
  /// A puller past its handshake, on a thread of its own. Only `thread` (the accepting one)
  /// adds and removes them, and the connection is closed only once its thread has ended,
  /// so the destructor's shutdown() never reaches a reused descriptor.
  struct Puller {
    Connection connection;
    std::thread thread;
    std::atomic<bool> finished{false};
    explicit Puller(Connection accepted) : connection(std::move(accepted)) {}
  };
  std::list<Puller> pullers;
  // Counters of PeerServer::stats().
  std::atomic<uint64_t> pullers_connected{0};
  std::atomic<uint64_t> pullers_accepted{0};
  std::atomic<uint64_t> manifests_sent{0};
  std::atomic<uint64_t> pulls_completed{0};
  std::atomic<uint64_t> connections_refused{0};

  State(const ModelLayout& layout_, PeerServeOptions options_)
      : layout(layout_), options(std::move(options_)), listener(Listener::tcp(options.listen)),
        auth(listener_auth(options.token, options.open_without_token, "peer server on " + listener.address())) {}

  void hash_parameters() {
    ParameterDigester digester;
    for (size_t i = 0; i < manifest.parameters.size(); ++i) {
      const Parameter& parameter = layout.parameters()[i];
      PeerParameter& served = manifest.parameters[i];
      served.piece_xxh64.clear();
      served.xxh64 = parameter.data ? digester.digest(parameter.data, layout.device(), parameter.bytes(),
                                                      manifest.digest_piece_bytes, served.piece_xxh64)
                                    : 0;
    }
  }

  std::string self() const { return "peer server on " + listener.address(); }
  /// Logs a connection refused or dropped, and counts it.
  void refused(const Connection& connection, const std::string& reason) {
    connections_refused.fetch_add(1, std::memory_order_relaxed);
    log_refused(connection, self(), reason);
  }
  void serve();
  void serve_puller(Puller& puller);
  /// Joins and forgets the pullers whose threads have ended.
  void reap_pullers();
};

PeerServer::PeerServer(const ModelLayout& layout, PeerServeInfo info, PeerServeOptions options)
    : state_(std::make_unique<State>(layout, std::move(options))) {
  State& state = *state_;
  const transfer::ucx::Memory memory =
      layout.device().is_cuda() ? transfer::ucx::Memory::kCuda : transfer::ucx::Memory::kHost;
  WS_EXPECT(memory == transfer::ucx::Memory::kHost || state.worker.moves_cuda_memory(), ErrorCode::kUnsupported,
            "peer server: " + layout.description() + " lives on " + layout.device().name() + ", and UCX " +
                transfer::ucx::library_version() +
                " is not CUDA-aware: serving GPU memory needs a CUDA-aware UCX (e.g. the libucx-cu13 wheel's)");
  PeerManifest& manifest = state.manifest;
  manifest.model_type = parse_model_config("config.json", info.config_json).model_type;
  manifest.parallel = info.parallel;
  manifest.dtype = layout_dtype(layout);
  manifest.quantization = info.quantization;
  manifest.checkpoint_identity = peer_checkpoint_identity(info.tensors, info.config_json);
  WS_EXPECT(info.content_digest.empty() || is_content_digest(info.content_digest), ErrorCode::kInvalidArgument,
            "peer server: content digest '" + info.content_digest + "' is not 16 lowercase hex digits");
  manifest.content_digest = std::move(info.content_digest);
  manifest.version = 1;
  const uint64_t piece = state.options.digest_piece_bytes == 0 ? transfer::kPeerDigestPieceBytes : state.options.digest_piece_bytes;
  WS_EXPECT(piece >= 4096 && piece <= transfer::ParameterDigester::kHostStepBytes && (piece & (piece - 1)) == 0,
            ErrorCode::kInvalidArgument,
            "peer server: digest pieces of " + std::to_string(piece) + " bytes; they must be a power of two from 4 KiB to 4 MiB");
  manifest.digest_piece_bytes = piece;
  manifest.config_json = std::move(info.config_json);
  manifest.tensors = std::move(info.tensors);
  manifest.worker_address = state.worker.address();
  const transfer::ucx::Secret secret = transfer::ucx::random_secret();
  manifest.send_secret.assign(secret.begin(), secret.end());
  manifest.ucx_segment_bytes = transfer::ucx::receive_segment_bytes();
  for (const Parameter& parameter : layout.parameters()) {
    WS_EXPECT(parameter.data != nullptr || parameter.bytes() == 0, ErrorCode::kModel,
              "peer server: parameter " + parameter.name + " of " + layout.description() + " has no storage");
    PeerParameter& entry = manifest.parameters.emplace_back();
    entry.name = parameter.name;
    entry.dtype = parameter.dtype;
    entry.shape = parameter.shape;
    entry.bytes = parameter.bytes();
    entry.processing = parameter.processing;
    entry.parts = parameter.parts;
    if (entry.bytes > 0) {
      auto& registration = state.registrations.emplace_back(state.worker.register_memory(parameter.data, entry.bytes, memory));
      entry.remote_address = registration->address();
      entry.remote_key = registration->remote_key();
    }
  }
  state.hash_parameters();
  state.worker.answer_send_requests(secret);  // pullers whose endpoints have no native RMA
  state.worker.start_progress();
  WS_EXPECT(::pipe2(state.wake, O_CLOEXEC) == 0, ErrorCode::kIo, "peer server: cannot create a pipe: " + detail::errno_text(errno));
  state.thread = std::thread([&state] { state.serve(); });
}

PeerServer::~PeerServer() {
  State& state = *state_;
  state.stop = true;
  if (state.wake[1] >= 0) (void)!::write(state.wake[1], "x", 1);
  if (state.thread.joinable()) state.thread.join();
  // Pullers' threads wait on their sockets: shut down, every wait and send ends at once.
  for (State::Puller& puller : state.pullers) ::shutdown(puller.connection.fd(), SHUT_RDWR);
  for (State::Puller& puller : state.pullers) puller.thread.join();
  state.pullers.clear();
  state.worker.stop_progress();  // no read may be in flight while the memory is deregistered
  if (const uint64_t ended = state.worker.sends_ended_at_stop(); ended > 0) {
    std::fprintf(stderr,
                 "weightstream: peer server on %s: %llu sends to pullers that took none of their bytes for 2 s "
                 "(paused or frozen) were ended at shutdown\n",
                 state.listener.address().c_str(), static_cast<unsigned long long>(ended));
  }
  state.registrations.clear();
  for (int fd : state.wake) {
    if (fd >= 0) ::close(fd);
  }
}

const std::string& PeerServer::address() const noexcept { return state_->listener.address(); }

uint64_t PeerServer::version() const noexcept {
  std::lock_guard lock(state_->mutex);
  return state_->manifest.version;
}

std::string PeerServer::content_digest() const {
  std::lock_guard lock(state_->mutex);
  return state_->manifest.content_digest;
}

void PeerServer::begin_update() {
  std::lock_guard lock(state_->mutex);
  state_->updating = true;
  ++state_->manifest.version;
  // What an update writes is no checkpoint's content that anyone digested: unknown from now on.
  state_->manifest.content_digest.clear();
}

void PeerServer::end_update() {
  std::lock_guard lock(state_->mutex);
  state_->hash_parameters();
  state_->updating = false;
  ++state_->manifest.version;
}

PeerServeStats PeerServer::stats() const {
  const State& state = *state_;
  PeerServeStats stats;
  stats.pullers_connected = state.pullers_connected.load(std::memory_order_relaxed);
  stats.pullers_accepted = state.pullers_accepted.load(std::memory_order_relaxed);
  stats.manifests_sent = state.manifests_sent.load(std::memory_order_relaxed);
  stats.pulls_completed = state.pulls_completed.load(std::memory_order_relaxed);
  stats.connections_refused = state.connections_refused.load(std::memory_order_relaxed);
  stats.bytes_sent = state.worker.bytes_sent_on_request();
  std::lock_guard lock(state_->mutex);
  stats.parameters = state.manifest.parameters.size();
  for (const PeerParameter& parameter : state.manifest.parameters) stats.parameter_bytes += parameter.bytes;
  stats.version = state.manifest.version;
  stats.content_digest = state.manifest.content_digest;
  stats.updating = state.updating;
  return stats;
}

void PeerServer::State::reap_pullers() {
  for (auto it = pullers.begin(); it != pullers.end();) {
    if (!it->finished.load()) {
      ++it;
      continue;
    }
    it->thread.join();
    it = pullers.erase(it);
  }
}

void PeerServer::State::serve_puller(Puller& puller) {
  Connection& connection = puller.connection;
  try {
    PeerFrame frame = receive_peer_message(connection, options.timeout, "HELLO", kMaxPullerRequestBytes);
    if (frame.type != PeerMessage::kHello) {
      send_peer_message(connection, PeerMessage::kRefuse, {{"reason", "expected HELLO"}}, options.timeout);
      WS_FAIL(ErrorCode::kProtocol, "it sent peer message type " + std::to_string(static_cast<int>(frame.type)) +
                                        " where HELLO belongs");
    }
    nlohmann::json body;
    {
      std::lock_guard lock(mutex);
      body = manifest_json(manifest);
    }
    // Counted first: a puller that holds its manifest finds it counted.
    manifests_sent.fetch_add(1, std::memory_order_relaxed);
    send_peer_message(connection, PeerMessage::kManifest, body, options.timeout);
    // A puller keeps its connection for the pull and asks for the version at its end: it
    // may stay quiet as long as it likes between requests.
    for (;;) {
      pollfd entry{connection.fd(), POLLIN, 0};
      if (::poll(&entry, 1, -1) < 0 && errno != EINTR) break;
      if (stop.load()) break;
      frame = receive_peer_message(connection, options.timeout, "a peer request", kMaxPullerRequestBytes);
      WS_EXPECT(frame.type == PeerMessage::kVersion, ErrorCode::kProtocol,
                "it sent peer message type " + std::to_string(static_cast<int>(frame.type)) +
                    " where only VERSION belongs");
      {
        std::lock_guard lock(mutex);
        body = {{"version", manifest.version}, {"updating", updating}};
      }
      // A puller asks at the end of its reads: a pull completed (counted before the answer
      // that ends it).
      pulls_completed.fetch_add(1, std::memory_order_relaxed);
      send_peer_message(connection, PeerMessage::kVersion, body, options.timeout);
    }
  } catch (const Error& error) {
    // A puller that leaves is done; one that stalls or breaks the protocol is dropped, and said so.
    if (error.code() != ErrorCode::kNetwork && !stop.load()) refused(connection, error.what());
  }
  pullers_connected.fetch_sub(1, std::memory_order_relaxed);
  puller.finished = true;
}

void PeerServer::State::serve() {
  // Connections not yet past the handshake: a fixed record buffer and a deadline each.
  struct Handshaking {
    Connection connection;
    Clock::time_point deadline;
    ServerHandshake handshake;
  };
  std::vector<Handshaking> handshaking;
  constexpr auto kSendTimeout = std::chrono::milliseconds(500);
  while (!stop.load()) {
    reap_pullers();
    std::vector<pollfd> waits{{wake[0], POLLIN, 0}, {listener.fd(), POLLIN, 0}};
    auto wake_at = Clock::now() + std::chrono::milliseconds(200);  // also reaps pullers that ended
    for (const Handshaking& peer : handshaking) {
      waits.push_back({peer.connection.fd(), POLLIN, 0});
      wake_at = std::min(wake_at, peer.deadline);
    }
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(wake_at - Clock::now()).count();
    int ready = ::poll(waits.data(), waits.size(), static_cast<int>(std::clamp<long long>(wait, 0, 200)));
    if (ready < 0 && errno != EINTR) break;
    if (stop.load()) break;
    const auto now = Clock::now();
    std::vector<bool> drop(handshaking.size(), false);
    for (size_t i = 0; i < handshaking.size(); ++i) {
      Handshaking& peer = handshaking[i];
      try {
        if (ready > 0 && (waits[i + 2].revents & (POLLIN | POLLHUP | POLLERR)) != 0 &&
            peer.handshake.advance(peer.connection, kSendTimeout)) {
          drop[i] = true;  // leaves the handshaking, proven
          reap_pullers();
          if (pullers.size() >= kMaxPullers) {
            const std::string reason = "it serves " + std::to_string(kMaxPullers) + " pullers already; try again later";
            try {
              send_peer_message(peer.connection, PeerMessage::kRefuse, {{"reason", reason}}, kSendTimeout);
            } catch (const Error&) {
            }
            refused(peer.connection, reason);
            continue;
          }
          Puller& puller = pullers.emplace_back(std::move(peer.connection));
          pullers_accepted.fetch_add(1, std::memory_order_relaxed);
          pullers_connected.fetch_add(1, std::memory_order_relaxed);
          puller.thread = std::thread([this, &puller] { serve_puller(puller); });
          continue;
        }
        if (now >= peer.deadline) {
          drop[i] = true;
          refused(peer.connection, "no handshake within " + detail::seconds_text(kHandshakeTimeout) + " of connecting");
        }
      } catch (const Error& error) {
        drop[i] = true;
        // One that leaves before a byte (a port probe) is not worth a line; the rest are.
        if (error.code() != ErrorCode::kNetwork || peer.handshake.heard()) {
          refused(peer.connection, error.what());
        }
      }
    }
    for (size_t i = handshaking.size(); i-- > 0;) {
      if (drop[i]) handshaking.erase(handshaking.begin() + static_cast<ptrdiff_t>(i));
    }
    // Every connection queued is taken at once (up to a bound per turn), so the kernel's
    // queue never fills behind a flood.
    for (int taken = 0; ready > 0 && (waits[1].revents & POLLIN) != 0 && taken < 64; ++taken) {
      try {
        Connection accepted = listener.accept(std::chrono::milliseconds(0));
        if (handshaking.size() >= kMaxHandshakingConnections) {
          // The oldest makes room: a flood of idle strangers keeps no real puller out.
          refused(handshaking.front().connection,
                  "dropped mid-handshake to make room (" + std::to_string(kMaxHandshakingConnections) +
                      " connections at once were mid-handshake)");
          handshaking.erase(handshaking.begin());
        }
        handshaking.push_back(Handshaking{std::move(accepted), Clock::now() + kHandshakeTimeout,
                                          ServerHandshake(kPeerHandshake, auth)});
      } catch (const Error&) {
        break;  // none left (or accept() failed: the peer reset first, descriptors ran out): the next poll retries
      }
    }
  }
}

}  // namespace weightstream
