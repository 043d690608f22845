// UpdateReceiver: accepts a sender, checks each bucket's manifest against the layout, and
// applies the bytes through a LoadSession in update mode, one layer at a time.
//
// Why layers are gated: a LoadSession writes each tensor as it arrives. If a sender died
// after half of a layer's tensors, that layer would hold a mix of old and new weights. So a
// piece of a layer that is not yet complete is held back (copied out of the bucket, which
// the sender will overwrite) and handed to the session together with the rest of its layer.
// Layers the update covers only in part are applied at FINISH.
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <unordered_map>

#include "transfer/socket.hpp"
#include "transfer/transport.hpp"
#include "transfer/wire.hpp"
#include "weightstream/options.hpp"
#include "weightstream/transfer.hpp"

namespace weightstream {
namespace {

using Clock = std::chrono::steady_clock;
using namespace transfer;

bool convertible(Dtype from, Dtype to) {
  auto is_float = [](Dtype dtype) { return dtype == Dtype::kBF16 || dtype == Dtype::kF16 || dtype == Dtype::kF32; };
  return from == to || (is_float(from) && is_float(to));
}

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

/// Compares two strings in time independent of where they differ (token checks).
bool same_secret(std::string_view a, std::string_view b) {
  unsigned char difference = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) difference |= static_cast<unsigned char>(a[i] ^ b[i % std::max<size_t>(b.size(), 1)]);
  return difference == 0;
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

/// The layer bookkeeping of one update: which tensors each layer needs, what has arrived,
/// and the held-back pieces of layers not yet complete.
class LayerGate {
 public:
  LayerGate(const ModelLayout& layout, TensorFormat format, const Device& device)
      : layout_(layout), format_(format), device_(device) {
    if (format == TensorFormat::kEngine) {
      // Engine names are parameters: tracks by parameter index, found by the same lookup
      // that checks the entry (one hash lookup a tensor, not two).
      engine_tracks_.resize(layout.parameters().size());
      auto layer_entry = layers_.end();  // parameters come layer by layer: one lookup a layer
      for (size_t i = 0; i < layout.parameters().size(); ++i) {
        const int64_t layer = layout.parameters()[i].layer;
        engine_tracks_[i].layer = layer;
        if (layer_entry == layers_.end() || layer_entry->first != layer) layer_entry = layers_.try_emplace(layer).first;
        ++layer_entry->second.needed;
      }
    } else {
      for (const std::string& tensor : layout.wanted_tensors()) {
        TensorRoute route = layout.route(tensor);
        if (route.kind != TensorRoute::Kind::kParameter || route.targets.empty()) continue;
        add(tensor, layout.parameters()[route.targets.front().first].layer);
      }
    }
  }

  /// What has arrived of one gated tensor in this update.
  struct Track {
    int64_t layer = -1;
    uint64_t received = 0;
    std::optional<Dtype> dtype;
    bool complete = false;
    bool seen_whole_in_bucket = false;  ///< check(): delivered whole earlier in the bucket
  };
  /// One checked entry: where its bytes are and the track of its tensor (null: no layer
  /// gates it, as for a checkpoint tensor the layout ignores).
  struct Checked {
    const std::byte* data = nullptr;
    Track* track = nullptr;
  };

  /// Checks every entry of a manifest against the layout, the pieces received so far and
  /// where its bytes are (`slot`: the bucket buffer; `transport`: the shared regions);
  /// throws Error(kModel) naming the tensor, the parameter and the rule, Error(kProtocol)
  /// for bytes outside their region. Changes nothing; returns what admit() takes.
  std::vector<Checked> check(const BucketManifest& manifest, const std::byte* slot, const ReceiverTransport& transport) {
    std::vector<Checked> checked(manifest.entries.size());
    std::unordered_map<const Track*, uint64_t> pending;  // bytes of pieces earlier in this bucket
    struct ClearMarks {
      LayerGate& gate;
      ~ClearMarks() { gate.clear_bucket_marks(); }
    } clear_marks{*this};
    for (size_t i = 0; i < manifest.entries.size(); ++i) {
      const BucketEntry& entry = manifest.entries[i];
      const std::string& tensor = entry.name;
      // Built only for a message: this runs for every tensor of every update.
      auto at_text = [&] { return "tensor " + tensor + " (entry of bucket " + std::to_string(manifest.index) + ")"; };
      if (entry.source == 0) {
        checked[i].data = slot + entry.source_offset;
      } else {
        std::span<const std::byte> region = transport.region(entry.source - 1);
        WS_EXPECT(!region.empty(), ErrorCode::kProtocol,
                  at_text() + " is in shared region " + std::to_string(entry.source - 1) + ", which was never shared");
        WS_EXPECT(entry.source_offset <= region.size() && entry.bytes <= region.size() - entry.source_offset,
                  ErrorCode::kProtocol,
                  at_text() + ": bytes " + std::to_string(entry.source_offset) + "+" + std::to_string(entry.bytes) +
                      " lie outside shared region " + std::to_string(entry.source - 1) + " of " +
                      std::to_string(region.size()) + " bytes");
        checked[i].data = region.data() + entry.source_offset;
      }
      Track* track_found = nullptr;
      if (format_ == TensorFormat::kEngine) {
        auto index = layout_.find(tensor);
        WS_EXPECT(index.has_value(), ErrorCode::kModel,
                  "engine-format " + at_text() + " names no parameter of " + layout_.description());
        const Parameter& parameter = layout_.parameters()[*index];
        track_found = &engine_tracks_[*index];
        WS_EXPECT(entry.dtype == parameter.dtype, ErrorCode::kModel,
                  "engine-format " + at_text() + " has dtype " + std::string(dtype_name(entry.dtype)) + " but parameter " +
                      parameter.name + " (" + layer_label(layout_, parameter.layer) + ") holds " +
                      std::string(dtype_name(parameter.dtype)));
        WS_EXPECT(std::ranges::equal(entry.shape, parameter.shape), ErrorCode::kModel,
                  "engine-format " + at_text() + " has shape " + shape_text(entry.shape) + " but parameter " + parameter.name +
                      " (" + layer_label(layout_, parameter.layer) + ") has shape " + shape_text(parameter.shape));
      } else {
        TensorRoute route = layout_.route(tensor);
        if (route.kind == TensorRoute::Kind::kIgnored || route.kind == TensorRoute::Kind::kSkipped) continue;
        WS_EXPECT(route.kind == TensorRoute::Kind::kParameter, ErrorCode::kModel,
                  at_text() + " matches no parameter of " + layout_.description() + " and no ignore rule");
        for (const auto& [index, part_index] : route.targets) {
          const Parameter& parameter = layout_.parameters()[index];
          const ParameterPart& part = parameter.parts[part_index];
          auto target = [&] {
            return "parameter " + parameter.name + " (part '" + part.id + "', " + layer_label(layout_, parameter.layer) +
                   ", rule " + part.rule + ")";
          };
          WS_EXPECT(std::ranges::equal(entry.shape, part.shape), ErrorCode::kModel,
                    at_text() + " has shape " + shape_text(entry.shape) + " but " + target() + " expects " + shape_text(part.shape));
          WS_EXPECT(convertible(entry.dtype, parameter.load_dtype), ErrorCode::kModel,
                    at_text() + " has dtype " + std::string(dtype_name(entry.dtype)) + " but " + target() + " is loaded as " +
                        std::string(dtype_name(parameter.load_dtype)) + " (only BF16, F16 and F32 convert)");
        }
      }
      if (track_found == nullptr) {
        auto found = tensors_.find(tensor);
        if (found == tensors_.end()) continue;
        track_found = &found->second;
      }
      Track& track = *track_found;
      checked[i].track = &track;
      // Most tensors come whole, once: the map of pieces is consulted only for the rest.
      const bool piece = entry.tensor_offset != 0 || entry.bytes != *tensor_byte_size(entry.dtype, entry.shape);
      uint64_t expected = track.received;
      if (!pending.empty()) {
        if (auto earlier = pending.find(&track); earlier != pending.end()) expected += earlier->second;
      }
      WS_EXPECT(!track.complete && entry.tensor_offset == expected && !track.seen_whole_in_bucket, ErrorCode::kModel,
                at_text() + (track.complete || track.seen_whole_in_bucket
                                 ? " was already delivered whole in this update"
                                 : ": piece at byte " + std::to_string(entry.tensor_offset) + ", expected byte " +
                                       std::to_string(expected) + " (pieces of a tensor come in order, once)"));
      WS_EXPECT(!track.dtype || *track.dtype == entry.dtype, ErrorCode::kModel,
                at_text() + ": a piece arrived as " + std::string(dtype_name(entry.dtype)) + " after earlier pieces as " +
                    std::string(dtype_name(*track.dtype)));
      if (piece) {
        pending[&track] += entry.bytes;
      } else {
        track.seen_whole_in_bucket = true;
        whole_in_bucket_.push_back(&track);
      }
    }
    return checked;
  }

  /// Accounts a checked bucket and returns the views to apply now: pieces of layers that are
  /// complete with this bucket (held-back pieces included) and tensors no layer gates. The
  /// pieces of other layers are copied out of `bucket` and held. Views stay valid until
  /// release_applied().
  ///
  /// A piece in a shared region is held by reference: the sender keeps the region unchanged
  /// until the update ends. Only bucket-buffer pieces are copied out.
  std::vector<TensorView> admit(const BucketManifest& manifest, const std::vector<Checked>& checked) {
    std::vector<size_t> gated;
    std::vector<TensorView> now;
    now.reserve(manifest.entries.size());
    for (size_t i = 0; i < manifest.entries.size(); ++i) {
      const BucketEntry& entry = manifest.entries[i];
      Track* track = checked[i].track;
      if (track == nullptr) {
        now.push_back(view(entry, checked[i].data, device_));
        continue;
      }
      track->dtype = entry.dtype;
      track->received += entry.bytes;
      if (track->received == *tensor_byte_size(entry.dtype, entry.shape) && !track->complete) {
        track->complete = true;
        ++layers_[track->layer].done;
      }
      gated.push_back(i);
    }
    std::vector<int64_t> completed_now;
    for (size_t i : gated) {
      const BucketEntry& entry = manifest.entries[i];
      int64_t layer = checked[i].track->layer;
      LayerState& state = layers_[layer];
      if (state.done == state.needed) {
        now.push_back(view(entry, checked[i].data, device_));
        if (completed_now.empty() || completed_now.back() != layer) completed_now.push_back(layer);
      } else if (entry.source != 0) {
        state.held.push_back(Held{entry, Buffer(), checked[i].data});
      } else {
        Held piece{entry, Buffer(device_, std::max<uint64_t>(entry.bytes, 1)), nullptr};
        copy_bytes(piece.bytes.data(), device_, checked[i].data, device_, entry.bytes);
        piece.data = piece.bytes.data();
        state.held.push_back(std::move(piece));
        held_bytes_ += entry.bytes;
      }
    }
    std::sort(completed_now.begin(), completed_now.end());
    completed_now.erase(std::unique(completed_now.begin(), completed_now.end()), completed_now.end());
    for (int64_t layer : completed_now) {
      for (Held& piece : layers_[layer].held) now.push_back(view(piece.entry, piece.data, device_));
      flushing_.push_back(layer);
      completing_.push_back(layer);
    }
    return now;
  }

  /// True when the views of the last admit include held pieces copied out of a bucket,
  /// which release_applied() frees: their copies must have landed first.
  bool releases_copies() const {
    for (int64_t layer : flushing_) {
      for (const Held& piece : layers_.at(layer).held) {
        if (piece.bytes.size() > 0) return true;
      }
    }
    return false;
  }

  /// Every held piece (layers the update covers in part), for FINISH.
  std::vector<TensorView> admit_rest() {
    std::vector<TensorView> now;
    for (auto& [layer, state] : layers_) {
      if (state.held.empty()) continue;
      for (Held& piece : state.held) now.push_back(view(piece.entry, piece.data, device_));
      flushing_.push_back(layer);
    }
    return now;
  }

  /// Frees the held pieces of layers handed over by the last admit, once the session has
  /// applied them (a batch the session rejects writes nothing, so nothing is released).
  void release_applied() {
    completed_.insert(completed_.end(), completing_.begin(), completing_.end());
    completing_.clear();
    for (int64_t layer : flushing_) {
      for (const Held& piece : layers_[layer].held) held_bytes_ -= piece.bytes.size() > 0 ? piece.entry.bytes : 0;
      layers_[layer].held.clear();
    }
    flushing_.clear();
  }

  /// Layers whose every tensor arrived, in the order they completed.
  const std::vector<int64_t>& completed() const noexcept { return completed_; }
  /// Tensors received whole.
  uint64_t tensors_complete() const {
    uint64_t count = 0;
    for (const auto& [name, track] : tensors_) count += track.complete ? 1 : 0;
    for (const Track& track : engine_tracks_) count += track.complete ? 1 : 0;
    return count;
  }

 private:
  struct Held {
    BucketEntry entry;
    Buffer bytes;                       ///< a copy out of the bucket buffer (empty: in a region)
    const std::byte* data = nullptr;    ///< the piece's bytes (in `bytes` or a shared region)
  };

  void clear_bucket_marks() {
    for (Track* track : whole_in_bucket_) track->seen_whole_in_bucket = false;
    whole_in_bucket_.clear();
  }
  struct LayerState {
    size_t needed = 0;
    size_t done = 0;
    std::vector<Held> held;
  };

  void add(const std::string& tensor, int64_t layer) {
    Track track;
    track.layer = layer;
    if (tensors_.emplace(tensor, track).second) ++layers_[layer].needed;
  }

  static TensorView view(const BucketEntry& entry, const std::byte* data, const Device& device) {
    return TensorView{entry.name, entry.dtype, entry.shape, data, device, entry.tensor_offset, entry.bytes};
  }

  const ModelLayout& layout_;
  TensorFormat format_;
  Device device_;
  std::unordered_map<std::string, Track, detail::StringHash, std::equal_to<>> tensors_;  // checkpoint format
  std::vector<Track> engine_tracks_;  // engine format, by parameter index
  std::vector<Track*> whole_in_bucket_;
  std::map<int64_t, LayerState> layers_;
  std::vector<int64_t> flushing_;
  std::vector<int64_t> completing_;
  std::vector<int64_t> completed_;
  uint64_t held_bytes_ = 0;
};

/// Sends `error` to the peer as an ERROR message, best effort: it may be the one that
/// vanished.
void tell_peer(Connection& connection, const Error& error) {
  Message failure;
  failure.type = MessageType::kError;
  failure.code = error.code();
  failure.text = error.what();
  try {
    connection.send(failure, std::chrono::milliseconds(1000));
  } catch (const Error&) {
  }
}

}  // namespace

struct UpdateReceiver::State {
  State(ModelLayout& layout_, ReceiverOptions options_, Listener listener_)
      : layout(layout_), options(std::move(options_)), listener(std::move(listener_)) {}
  ModelLayout& layout;
  ReceiverOptions options;
  Listener listener;
  // The connected sender, kept between its updates (one connection carries any number).
  std::optional<Connection> connection;
  // Peers that connected and have not been heard yet, each with the time by which its HELLO
  // must come. All are waited on at once: a silent one delays no other.
  struct Handshaking {
    Connection connection;
    Clock::time_point deadline;
  };
  std::vector<Handshaking> handshaking;
  std::unique_ptr<ReceiverTransport> transport;
  uint64_t bucket_bytes = 0;
  double connect_seconds = 0;  // set-up of the current connection, reported with its first update
  uint64_t updates = 0;        // updates finished on the current connection
  // One session for every update: begin() per update; its copy queue (and the arrays it
  // has grown) stays. Made anew after a failed update, which leaves it mid-load.
  std::optional<LoadSession> session;
  // The bookkeeping of the next update, begun before its START arrives (while the trainer
  // computes it) in the format of the last update: with 10,000 tensors it is about half a
  // millisecond that would otherwise come before the first copy. Used when START asks for
  // that format, begun anew otherwise.
  std::optional<LayerGate> gate;
  std::optional<TensorFormat> prepared;
  std::optional<TensorFormat> last_format;

  /// Forgets an update prepared ahead: its session was begun (nothing written), so the
  /// next update makes a new one.
  void discard_prepared() {
    if (prepared) session.reset();
    prepared.reset();
    gate.reset();
  }

  /// Begins the session and the layer gate of an update in `format`.
  void prepare(TensorFormat format) {
    if (prepared == format) return;
    discard_prepared();
    if (!session) session.emplace(layout);
    session->begin(LoadMode::kUpdate, format);
    gate.emplace(layout, format, transport->device());
    prepared = format;
  }

  /// Prepares the next update of the connection ahead of its START, when an update in some
  /// format ran before; a failure here is left for that update to meet and report.
  void prepare_ahead() {
    if (!last_format || prepared) return;
    try {
      prepare(*last_format);
    } catch (const Error&) {
      session.reset();  // begun, perhaps, before the gate failed
      discard_prepared();
    }
  }

  std::string self() const {
    return "update receiver at " + listener.address() + " (" + std::string(transport_name(options.transport)) + ")";
  }

  void drop_connection() {
    discard_prepared();  // prepared for this connection's transport (its device, its regions)
    transport.reset();
    connection.reset();
    updates = 0;
  }

  /// Accepts peers until one presents a HELLO, then sets up its transport: token,
  /// WELCOME, join. Peers silent for the handshake timeout are dropped meanwhile.
  void connect(std::chrono::milliseconds accept_timeout);
  /// Hears one peer's HELLO and sets up its transport. False when the peer left or stayed
  /// silent before its HELLO was complete (it is dropped); throws when it is refused.
  bool handshake(Connection accepted, Clock::time_point hello_deadline);
  /// Runs one update on the connection, from its START to its REPORT.
  UpdateReport run_update(const Message& start, Clock::time_point started);
};

namespace {

/// Where a same-host receiver listens: the path asked for, or a fresh one in the socket
/// directory (the caller's, or the TMPDIR of the environment).
std::string unix_socket_path(const ReceiverOptions& options) {
  if (!options.listen.empty()) return options.listen;
  return Listener::fresh_unix_socket_path(options.socket_directory.empty() ? temporary_directory(process_environment())
                                                                          : options.socket_directory);
}

std::string seconds_text(std::chrono::milliseconds duration) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.3g s", static_cast<double>(duration.count()) / 1000.0);
  return text;
}

}  // namespace

UpdateReceiver::UpdateReceiver(ModelLayout& layout, ReceiverOptions options)
    : state_(std::make_unique<State>(layout, options,
                                     options.transport == TransportKind::kShm || options.transport == TransportKind::kCudaIpc
                                         ? Listener::unix_socket(unix_socket_path(options))
                                         : Listener::tcp(options.listen))) {
  WS_EXPECT(transport_compiled(options.transport), ErrorCode::kUnsupported,
            "update receiver: the " + std::string(transport_name(options.transport)) +
                " transport is not compiled into this build");
}

UpdateReceiver::~UpdateReceiver() = default;

const std::string& UpdateReceiver::address() const noexcept { return state_->listener.address(); }

void UpdateReceiver::State::connect(std::chrono::milliseconds accept_timeout) {
  const auto deadline = Clock::now() + accept_timeout;
  uint64_t silent = 0;  // peers dropped for sending no HELLO in time
  uint64_t left = 0;    // peers that disconnected before their HELLO
  for (;;) {
    auto now = Clock::now();
    std::erase_if(handshaking, [&](Handshaking& peer) {
      if (peer.deadline > now || peer.connection.readable()) return false;
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
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(wake - now).count();
    int ready = ::poll(waits.data(), waits.size(), static_cast<int>(std::clamp<long long>(wait, 0, 1 << 30)));
    if (ready < 0 && errno == EINTR) continue;
    WS_EXPECT(ready >= 0, ErrorCode::kNetwork, self() + ": poll failed: " + detail::errno_text(errno));
    if (ready == 0) {
      if (Clock::now() < deadline) continue;  // a peer's handshake deadline: dropped above
      std::string dropped;
      if (silent > 0) {
        dropped += "; " + std::to_string(silent) + " peer(s) connected but sent no HELLO within the handshake timeout of " +
                   seconds_text(options.handshake_timeout) + " and were dropped";
      }
      if (left > 0) dropped += "; " + std::to_string(left) + " peer(s) disconnected before their HELLO";
      WS_FAIL(ErrorCode::kTimeout, "no sender connected to " + listener.address() + " within " +
                                       seconds_text(accept_timeout) + dropped);
    }
    // Peers already waiting are heard first, in the order they connected.
    for (size_t i = 0; i < handshaking.size(); ++i) {
      if ((waits[i + 1].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      Handshaking peer = std::move(handshaking[i]);
      handshaking.erase(handshaking.begin() + static_cast<ptrdiff_t>(i));
      if (handshake(std::move(peer.connection), peer.deadline)) return;
      ++left;  // or silent in the middle of its HELLO
      break;   // the indices of `waits` no longer match: poll again
    }
    if ((waits[0].revents & POLLIN) != 0) {
      handshaking.push_back(Handshaking{listener.accept(std::chrono::milliseconds(0)),
                                        Clock::now() + options.handshake_timeout});
    }
  }
}

bool UpdateReceiver::State::handshake(Connection accepted, Clock::time_point hello_deadline) {
  const auto timeout = options.timeout;
  const auto started = Clock::now();
  const std::string peer = accepted.peer();

  auto refuse = [&](const std::string& reason) {
    Message refusal;
    refusal.type = MessageType::kRefuse;
    refusal.text = reason;
    try {
      accepted.send(refusal, timeout);
    } catch (const Error&) {
      // The peer may already be gone; the refusal is reported here either way.
    }
    WS_FAIL(ErrorCode::kProtocol, self() + " refused " + peer + ": " + reason);
  };

  Received hello;
  try {
    // The HELLO is (at least in part) here already: the rest must come by the deadline.
    const auto hello_left = std::max(std::chrono::milliseconds(100), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                                        hello_deadline - Clock::now()));
    hello = accepted.receive(hello_left, "HELLO");
  } catch (const Error& error) {
    // A peer that leaves or stalls before saying who it is was no sender: it is dropped,
    // and the receiver goes on waiting for one.
    if (error.code() == ErrorCode::kNetwork || error.code() == ErrorCode::kTimeout) return false;
    throw;
  }
  if (hello.message.type != MessageType::kHello) {
    refuse("expected HELLO, got " + std::string(message_type_name(hello.message.type)));
  }
  if (!options.token.empty() && !same_secret(hello.message.token, options.token)) refuse("wrong or missing token");
  if (hello.message.transport != options.transport) {
    refuse("the sender asked for transport " + std::string(transport_name(hello.message.transport)) +
           " but this receiver serves " + std::string(transport_name(options.transport)));
  }
  if (hello.message.bucket_bytes > options.max_bucket_bytes) {
    refuse("bucket size " + std::to_string(hello.message.bucket_bytes) + " bytes exceeds this receiver's limit of " +
           std::to_string(options.max_bucket_bytes));
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
  connect_seconds = std::chrono::duration<double>(Clock::now() - started).count();
  updates = 0;
  return true;
}

UpdateReport UpdateReceiver::receive(std::chrono::milliseconds accept_timeout) {
  State& state = *state_;
  const auto deadline = Clock::now() + accept_timeout;
  auto left = [&] {
    return std::max(std::chrono::milliseconds(0),
                    std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
  };
  for (;;) {
    if (!state.connection) state.connect(left());
    // A connected sender may take its time between updates (a trainer computing the next
    // weights): START is awaited as long as the caller waits for an update.
    Received start;
    try {
      state.prepare_ahead();
      start = state.connection->receive(left(), "START");
    } catch (const Error& error) {
      const bool between_updates = state.updates > 0;
      const std::string peer = state.connection->peer();
      state.drop_connection();
      // A sender that leaves after its last update is done; wait for the next one.
      if (between_updates && error.code() == ErrorCode::kNetwork) continue;
      WS_FAIL(error.code(), "update from " + peer + " to " + state.self() + " failed before it started: " + error.what());
    }
    const auto started = Clock::now();
    return state.run_update(start.message, started);
  }
}

UpdateReport UpdateReceiver::State::run_update(const Message& start_message, Clock::time_point started) {
  const auto timeout = options.timeout;
  Connection& link = *connection;
  const std::string peer = link.peer();
  uint64_t buckets = 0;       // buckets received and applied
  uint64_t bytes = 0;
  uint64_t shared_bytes = 0;  // bytes read in place from shared regions
  uint32_t regions_open = 0;  // regions the sender shared in this update
  UpdatePhases phases;

  std::optional<uint64_t> current;  // the bucket being checked and applied
  auto last_bucket_text = [&] {
    if (current) return "at bucket " + std::to_string(*current) + " (" + std::to_string(buckets) + " applied before it)";
    return buckets == 0 ? std::string("before any bucket arrived")
                        : "after bucket " + std::to_string(buckets - 1) + " (the last received)";
  };
  try {
    WS_EXPECT(start_message.type == MessageType::kStart, ErrorCode::kProtocol,
              "expected START, got " + std::string(message_type_name(start_message.type)));
    const TensorFormat format = start_message.format;
    timed(phases.preparing, [&] { prepare(format); });  // nothing to do when prepared ahead
    prepared.reset();  // this update's now
    last_format = format;

    // ---- buckets, then finish ----
    for (;;) {
      Received received = timed(phases.waiting, [&] {
        return link.receive(timeout, "bucket " + std::to_string(buckets) + " or FINISH");
      });
      phases.waiting -= received.parse_seconds;
      phases.parsing += received.parse_seconds;
      if (buckets == 0) phases.first_bucket = std::chrono::duration<double>(Clock::now() - started).count();
      Message& message = received.message;
      if (message.type == MessageType::kFinish) {
        WS_EXPECT(message.buckets == buckets, ErrorCode::kProtocol,
                  "FINISH says " + std::to_string(message.buckets) + " buckets were sent but " +
                      std::to_string(buckets) + " arrived");
        timed(phases.checking, [&] {
          std::vector<TensorView> rest = gate->admit_rest();
          if (!rest.empty()) session->load(rest);
        });
        gate->release_applied();
        timed(phases.copying, [&] {
          session->settle();
          wait_for_copies(transport->device());
        });
        timed(phases.finishing, [&] { session->finish(); });
        timed(phases.closing, [&] { transport->end_update(); });
        UpdateReport report;
        report.format = format;
        report.buckets = buckets;
        report.bytes = bytes;
        report.shared_bytes = shared_bytes;
        report.regions = regions_open;
        report.tensors = gate->tensors_complete();
        report.seconds = std::chrono::duration<double>(Clock::now() - started).count();
        report.connect_seconds = updates == 0 ? connect_seconds : 0;
        report.counters = session->counters();
        report.phases = phases;
        report.completed_layers = session->completed_layers();
        Message answer;
        answer.type = MessageType::kReport;
        answer.report = report;
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
      for (const SharedRegion& region : manifest.regions) {
        WS_EXPECT(region.id == regions_open, ErrorCode::kProtocol,
                  "bucket " + std::to_string(manifest.index) + " shares region " + std::to_string(region.id) +
                      " where region " + std::to_string(regions_open) + " was due");
        timed(phases.opening, [&] { transport->open_region(region); });
        ++regions_open;
      }
      if (manifest.bytes > 0) {
        timed(phases.waiting, [&] {
          transport->receive(link, manifest.slot, manifest.bytes, timeout,
                             "the " + std::to_string(manifest.bytes) + "-byte payload of bucket " +
                                 std::to_string(manifest.index));
        });
      }
      timed(phases.checking, [&] {
        // Every entry is checked before any byte of the bucket is written (or held back).
        auto checked = gate->check(manifest, transport->slot(manifest.slot), *transport);
        std::vector<TensorView> views = gate->admit(manifest, checked);
        // Copies within the GPU are only issued: the next bucket's checks overlap them.
        if (!views.empty()) session->load(views, SourceLifetime::kSession);
      });
      if (manifest.bytes > 0 || gate->releases_copies()) {
        // The sender refills this slot once it hears APPLIED, and held copies are freed
        // now: on a GPU the copies out of them must be done by then, not merely issued.
        timed(phases.copying, [&] {
          session->settle();
          wait_for_copies(transport->device());
        });
      }
      gate->release_applied();
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
    std::string applied = gate ? join_layers(layout, gate->completed()) : "none";
    session.reset();  // waits for copies issued from the sender's regions before closing them
    drop_connection();  // closes the regions
    WS_FAIL(error.code(), "update from " + peer + " to " + self() + " failed " + last_bucket_text() + ": " +
                              error.what() + "; layers completed and applied before the failure: " + applied +
                              "; every other layer keeps its old values (a reload restores a consistent model)");
  }
}

}  // namespace weightstream
