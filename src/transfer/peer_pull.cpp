// PeerSource: connects to the serving ranks of an instance, checks that their manifests
// agree, and pulls what a LoadSession's layout needs.
//
// Everything is mapped in checkpoint coordinates: each part of a puller's parameter is a
// rectangle of a checkpoint tensor (ModelLayout's rules), and so is each part of a serving
// parameter (its manifest). On a cold load, a puller parameter that a peer holds identically
// (same name, dtype and rectangles: the same layout) is read whole straight into the
// parameter's storage, then checked against its digest. Any other need is covered by serving
// parameters' rectangles: those parameters are read whole into staging (so that each is
// checked against its digest), and the rows the puller needs are assembled from them and
// handed to the session as a piece of the checkpoint tensor, exactly as a stream from
// storage would hand it. A reload or update overwrites parameters that serve, so it takes
// the staged path for everything: no byte reaches the session or the parameters before its
// digest has been checked. Staging is bounded and reused: batches of whole layers, each read
// into one of a few buffers the source keeps, checked whole, then handed to the session on
// a thread of its own while the next batches' reads land.

#include <algorithm>
#include <array>
#include <cctype>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <stop_token>
#include <thread>

#include "device/shared/digests.hpp"
#include "storage/shared/read_destination.hpp"
#include "transfer/peer_protocol.hpp"
#include "transfer/socket.hpp"
#include "transfer/ucx.hpp"
#include "weightstream/error.hpp"
#include "weightstream/peer.hpp"

namespace weightstream {
namespace {

/// PeerPullOptions::pause_after_bytes on host reads: the pause waits for a parameter of at
/// least this many digest pieces (8 MiB at 512 KiB), more than the sockets between two
/// processes buffer, so the peer is still sending it when the pull pauses.
constexpr size_t kPausePieces = 16;

using Clock = std::chrono::steady_clock;
using namespace transfer;

/// Reads into GPU memory are issued in pieces of at most this many bytes, so several are in
/// flight; reads into host memory go by the manifest's digest pieces (PieceDigests).
constexpr uint64_t kReadPieceBytes = 8ull << 20;

/// Parameters read in place run this far ahead of the one being checked against its digest,
/// so that hashing one overlaps the transfer of the next ones.
constexpr uint64_t kReadAheadBytes = 128ull << 20;
/// A staged pull (a reload or update, or a layout unlike the server's) reads batches into
/// this many staging buffers in turn: the session writes one batch (on the committer's
/// thread) while the reads of the next two land, so the pipe to the peers never drains
/// between batches.
constexpr size_t kStagingSlots = 3;
/// The size of each, or of the largest layer where larger, but at most
/// PeerPullOptions::memory_limit / kStagingSlots (a single serving parameter larger than
/// that gets a buffer its size): a few layers of a model, never a copy of all of it.
constexpr uint64_t kStagingSlotBytes = 32ull << 20;
/// Where each serving parameter and each assembled tensor starts in a staging buffer.
constexpr uint64_t kStagingAlign = 64;
/// GPU parameters that have landed are checked on the device, piece by piece against the
/// manifest, in launches of about this many bytes (one thread hashes a piece: a launch wants
/// thousands of pieces to keep the device busy).
constexpr uint64_t kDeviceCheckBytes = 1ull << 30;

/// A rectangle [row_begin, row_end) x [column_begin, column_end) of a tensor's 2-D view.
struct Rect {
  int64_t row_begin = 0, row_end = 0, column_begin = 0, column_end = 0;
  bool empty() const { return row_begin >= row_end || column_begin >= column_end; }
  static Rect of(const ParameterPart& part) {
    return {part.row_begin, part.row_begin + part.rows, part.column_begin, part.column_begin + part.columns};
  }
  Rect intersect(const Rect& other) const {
    return {std::max(row_begin, other.row_begin), std::min(row_end, other.row_end),
            std::max(column_begin, other.column_begin), std::min(column_end, other.column_end)};
  }
  /// This rectangle minus `cut`: at most four rectangles.
  std::vector<Rect> minus(const Rect& cut) const {
    Rect inner = intersect(cut);
    if (inner.empty()) return {*this};
    std::vector<Rect> left;
    auto keep = [&](Rect r) {
      if (!r.empty()) left.push_back(r);
    };
    keep({row_begin, inner.row_begin, column_begin, column_end});
    keep({inner.row_end, row_end, column_begin, column_end});
    keep({inner.row_begin, inner.row_end, column_begin, inner.column_begin});
    keep({inner.row_begin, inner.row_end, inner.column_end, column_end});
    return left;
  }
  std::string text() const {
    return "rows " + std::to_string(row_begin) + "-" + std::to_string(row_end) + ", columns " +
           std::to_string(column_begin) + "-" + std::to_string(column_end);
  }
};

uint64_t element_bytes(Dtype dtype) { return std::max<uint64_t>(dtype_bits(dtype) / 8, 1); }

bool same_parts(const std::vector<ParameterPart>& a, const std::vector<ParameterPart>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].tensor != b[i].tensor || a[i].row_begin != b[i].row_begin || a[i].rows != b[i].rows ||
        a[i].column_begin != b[i].column_begin || a[i].columns != b[i].columns ||
        a[i].element_offset != b[i].element_offset || a[i].shape != b[i].shape) {
      return false;
    }
  }
  return true;
}

std::string peer_text(const PeerManifest& manifest) {
  return "peer " + manifest.address + " (tp rank " + std::to_string(manifest.parallel.tp_rank) + " of " +
         std::to_string(manifest.parallel.tp_size) + ", ep rank " + std::to_string(manifest.parallel.ep_rank) + " of " +
         std::to_string(manifest.parallel.ep_size) + ")";
}

/// Runs jobs in order on a thread of its own, started by the first post(): a staged pull's
/// commits (rows assembled, views handed to the session), so that the session writes one
/// batch while the next one's reads land. A job that throws ends it: the jobs after it are
/// dropped, and wait() rethrows its error. The destructor waits for the jobs posted (each
/// posted batch was checked whole, so a pull that fails later still writes it: what a failed
/// pull leaves does not depend on how far the committer had got).
class Committer {
 public:
  Committer() = default;
  Committer(const Committer&) = delete;
  Committer& operator=(const Committer&) = delete;
  ~Committer() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  /// Queues `job`; returns its ticket for wait().
  size_t post(std::function<void()> job) {
    std::lock_guard lock(mutex_);
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
    jobs_.push_back(std::move(job));
    changed_.notify_all();
    return ++posted_;
  }
  /// Whether the job of `ticket` and every one before it have ended (0: none), waiting at
  /// most `timeout` for it; rethrows the error of a job that failed.
  bool ended(size_t ticket, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    const bool done = changed_.wait_for(lock, timeout, [&] { return ended_ >= ticket || error_; });
    if (error_) std::rethrow_exception(error_);
    return done;
  }
  /// Waits until the job of `ticket` and every one before it have ended (0: none); rethrows
  /// the error of a job that failed.
  void wait(size_t ticket) {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return ended_ >= ticket || error_; });
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      std::exception_ptr error;
      try {
        job();
      } catch (...) {
        error = std::current_exception();
      }
      {
        std::lock_guard lock(mutex_);
        ++ended_;
        if (error && !error_) error_ = error;
        if (error_) jobs_.clear();
      }
      changed_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::function<void()>> jobs_;
  size_t posted_ = 0;
  size_t ended_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace

struct PeerSource::State {
  struct Link {
    std::string address;
    std::optional<Connection> connection;
    PeerManifest manifest;
    std::unique_ptr<ucx::Endpoint> endpoint;
    std::vector<uint32_t> keys;  // per parameter of the manifest
    std::map<std::string, size_t, std::less<>> by_name;
    uint64_t bytes_read = 0;  // by every pull of the source (PeerSource::stats)
  };
  std::string uri;
  PeerPullOptions options;
  std::unique_ptr<ucx::Worker> worker;  // before the links: endpoints close first
  std::vector<Link> links;
  std::vector<PeerManifest> manifests;
  /// A staged pull's buffers (kStagingSlots), kept for the next pull of this source.
  struct Staging {
    std::unique_ptr<std::byte[]> bytes;
    uint64_t capacity = 0;
  };
  std::array<Staging, kStagingSlots> staging;
  uint64_t digest_failures = 0;  // by every pull of the source (PeerSource::stats)

  void check_content() const;
  void check_agreement() const;
  void check_versions();
};

PeerSource::PeerSource(std::string_view uri, PeerPullOptions options) : state_(std::make_unique<State>()) {
  State& state = *state_;
  state.uri = std::string(uri);
  state.options = std::move(options);
  std::vector<std::string> addresses = peer_addresses(uri);
  std::string& expected = state.options.expect_digest;
  std::transform(expected.begin(), expected.end(), expected.begin(), [](unsigned char c) { return std::tolower(c); });
  WS_EXPECT(expected.empty() || is_content_digest(expected), ErrorCode::kInvalidArgument,
            "expected content digest '" + state.options.expect_digest + "' for " + state.uri +
                " is not 16 hex digits (what `weightstream digest --hash xxh64` or `serve` prints as the content digest)");
  state.worker = std::make_unique<ucx::Worker>();
  for (const std::string& address : addresses) {
    State::Link& link = state.links.emplace_back();
    link.address = address;
    try {
      link.connection.emplace(connect_to(address, state.options.timeout, "serving peer"));
      link.connection->set_peer("serving peer " + address);
    } catch (const Error& error) {
      WS_FAIL(error.code(), "cannot reach peer " + address + " of " + state.uri + ": " + error.what());
    }
    prove_to_server(*link.connection, kPeerHandshake, state.options.token, state.options.timeout, "peer " + address);
    send_peer_message(*link.connection, PeerMessage::kHello, nlohmann::json::object(), state.options.timeout);
    PeerFrame answer = receive_peer_message(*link.connection, state.options.timeout, "its manifest");
    if (answer.type == PeerMessage::kRefuse) {
      WS_FAIL(ErrorCode::kProtocol, "peer " + address + " refused this puller: " + answer.body.value("reason", std::string("no reason given")));
    }
    WS_EXPECT(answer.type == PeerMessage::kManifest, ErrorCode::kProtocol,
              "peer " + address + " answered HELLO with message type " + std::to_string(static_cast<int>(answer.type)));
    link.manifest = parse_manifest(answer.body, "peer " + address);
    link.manifest.address = address;
    for (size_t i = 0; i < link.manifest.parameters.size(); ++i) link.by_name.emplace(link.manifest.parameters[i].name, i);
  }
  state.check_content();
  state.check_agreement();
  for (State::Link& link : state.links) {
    transfer::ucx::Secret secret{};
    std::copy(link.manifest.send_secret.begin(), link.manifest.send_secret.end(), secret.begin());
    // Before the endpoint exists: the server's fragments must fit this process's segments.
    transfer::ucx::check_receive_segments(link.manifest.ucx_segment_bytes, "peer " + link.address);
    link.endpoint = state.worker->connect(link.manifest.worker_address, "peer " + link.address, state.options.ucx_path, secret);
    link.manifest.ucx_path = std::string(ucx::path_name(link.endpoint->path()));
    link.manifest.ucx_transports = link.endpoint->transports();
    for (const PeerParameter& parameter : link.manifest.parameters) {
      link.keys.push_back(parameter.remote_key.empty() ? 0 : link.endpoint->add_remote_key(parameter.remote_key));
    }
    state.manifests.push_back(link.manifest);
  }
}

PeerSource::~PeerSource() = default;
PeerSource::PeerSource(PeerSource&&) noexcept = default;
PeerSource& PeerSource::operator=(PeerSource&&) noexcept = default;

const std::string& PeerSource::uri() const noexcept { return state_->uri; }
const std::vector<PeerManifest>& PeerSource::manifests() const noexcept { return state_->manifests; }
const std::string& PeerSource::config_json() const noexcept { return state_->links.front().manifest.config_json; }
const std::vector<PeerTensor>& PeerSource::tensors() const noexcept { return state_->links.front().manifest.tensors; }
PeerPullStats PeerSource::stats() const {
  PeerPullStats stats;
  for (const State::Link& link : state_->links) {
    stats.peers.push_back({link.manifest.address, link.manifest.ucx_transports, link.bytes_read});
  }
  stats.digest_failures = state_->digest_failures;
  return stats;
}

const std::string& PeerSource::content_digest() const noexcept { return state_->links.front().manifest.content_digest; }

void PeerSource::State::check_content() const {
  // Before any endpoint or read: content that is not one checkpoint's is never mixed, and
  // content other than the one asked for never lands.
  auto served = [](const PeerManifest& m) {
    return m.content_digest.empty() ? std::string("unknown content (updated since it was loaded)") : m.content_digest;
  };
  auto all_peers = [&] {
    std::string text;
    for (const Link& link : links) text += (text.empty() ? "" : ", ") + link.address + " serves " + served(link.manifest);
    return text;
  };
  const std::string& expected = options.expect_digest;
  if (!expected.empty()) {
    std::string refused;
    for (const Link& link : links) {
      if (link.manifest.content_digest == expected) continue;
      refused += (refused.empty() ? "" : ", ") + link.address + " serves " + served(link.manifest);
    }
    WS_EXPECT(refused.empty(), ErrorCode::kProtocol,
              "peers of " + uri + " do not serve the expected content digest " + expected + ": " + refused +
                  "; refusing to pull from them");
    return;
  }
  if (links.size() == 1) return;  // one peer's content, known or not, is one content
  for (const Link& link : links) {
    WS_EXPECT(!link.manifest.content_digest.empty(), ErrorCode::kProtocol,
              "peers of " + uri + ": the content of updated peers cannot be compared (" + all_peers() +
                  "); refusing to mix them. Pull from peers not updated since they loaded their checkpoint, from one "
                  "peer alone, or from storage (--fallback URI)");
  }
  for (const Link& link : links) {
    WS_EXPECT(link.manifest.content_digest == links.front().manifest.content_digest, ErrorCode::kProtocol,
              "peers of " + uri + " disagree on the checkpoint's content: " + all_peers() + "; refusing to mix them");
  }
}

void PeerSource::State::check_agreement() const {
  const PeerManifest& first = links.front().manifest;
  auto refuse = [&](const PeerManifest& other, const std::string& field, const std::string& a, const std::string& b) {
    WS_FAIL(ErrorCode::kModel, "peers of " + uri + " disagree on " + field + ": " + first.address + " serves " + a +
                                   ", " + other.address + " serves " + b + "; refusing to mix them");
  };
  std::set<std::pair<int64_t, int64_t>> ranks;
  for (const Link& link : links) {
    const PeerManifest& m = link.manifest;
    if (m.checkpoint_identity != first.checkpoint_identity) {
      refuse(m, "the checkpoint (identity digest of index and config.json)", first.checkpoint_identity, m.checkpoint_identity);
    }
    if (m.model_type != first.model_type) refuse(m, "model_type", first.model_type, m.model_type);
    if (m.dtype != first.dtype) refuse(m, "dtype", first.dtype, m.dtype);
    if (m.quantization != first.quantization) refuse(m, "quantization", first.quantization, m.quantization);
    if (m.parallel.tp_size != first.parallel.tp_size) {
      refuse(m, "tp size", std::to_string(first.parallel.tp_size), std::to_string(m.parallel.tp_size));
    }
    if (m.parallel.ep_size != first.parallel.ep_size) {
      refuse(m, "ep size", std::to_string(first.parallel.ep_size), std::to_string(m.parallel.ep_size));
    }
    if (m.version != first.version) refuse(m, "version", std::to_string(first.version), std::to_string(m.version));
    WS_EXPECT(ranks.emplace(m.parallel.tp_rank, m.parallel.ep_rank).second, ErrorCode::kModel,
              "peers of " + uri + ": " + m.address + " serves tp rank " + std::to_string(m.parallel.tp_rank) +
                  ", ep rank " + std::to_string(m.parallel.ep_rank) + ", which another peer listed before it serves too");
  }
}

void PeerSource::State::check_versions() {
  for (Link& link : links) {
    send_peer_message(*link.connection, PeerMessage::kVersion, nlohmann::json::object(), options.timeout);
    PeerFrame answer = receive_peer_message(*link.connection, options.timeout, "its version");
    WS_EXPECT(answer.type == PeerMessage::kVersion, ErrorCode::kProtocol,
              "peer " + link.address + " did not answer the version request");
    const uint64_t version = answer.body.value("version", uint64_t{0});
    const bool updating = answer.body.value("updating", false);
    WS_EXPECT(version == link.manifest.version && !updating, ErrorCode::kProtocol,
              "peer " + link.address + " changed its parameters during the pull (version " +
                  std::to_string(link.manifest.version) + " at the start, " + std::to_string(version) +
                  (updating ? ", an update in progress" : "") +
                  " at the end): the bytes pulled may mix two versions and are refused; pull again");
  }
}

PeerPullReport PeerSource::pull(LoadSession& session) {
  State& state = *state_;
  const auto started = Clock::now();
  const ModelLayout& layout = session.layout();
  const auto timeout = state.options.timeout;
  PeerPullReport report;

  std::map<std::string, const PeerTensor*, std::less<>> tensors;
  for (const PeerTensor& tensor : state.links.front().manifest.tensors) tensors.emplace(tensor.name, &tensor);

  // ---- what the layout needs, per checkpoint tensor ----
  struct Need {
    size_t parameter = 0;
    size_t part = 0;
    Rect rect;
  };
  std::map<std::string, std::vector<Need>, std::less<>> needs;
  std::vector<std::string> order;  // tensors in the order the layout's parameters first want them
  for (size_t p = 0; p < layout.parameters().size(); ++p) {
    const Parameter& parameter = layout.parameters()[p];
    for (size_t k = 0; k < parameter.parts.size(); ++k) {
      const ParameterPart& part = parameter.parts[k];
      WS_EXPECT(tensors.count(part.tensor) == 1, ErrorCode::kModel,
                "parameter " + parameter.name + " of " + layout.description() + " wants tensor " + part.tensor +
                    ", which the checkpoint served by " + state.uri + " does not have");
      auto [at, inserted] = needs.try_emplace(part.tensor);
      if (inserted) order.push_back(part.tensor);
      at->second.push_back(Need{p, k, Rect::of(part)});
    }
  }

  // ---- parameters a peer holds identically: read whole, in place (cold loads only) ----
  struct Direct {
    size_t link = 0;
    size_t served = 0;
    size_t parameter = 0;
  };
  std::vector<Direct> directs;
  std::set<std::string, std::less<>> direct_tensors;
  // GPU parameters are read into straight from the peers only by a CUDA-aware UCX; otherwise
  // their bytes come through host staging like anything assembled.
  const bool gpu_direct = layout.device().is_cuda() && state.worker->moves_cuda_memory();
  // A parameter read in place holds unchecked bytes until its digest is compared: harmless
  // while nothing uses the layout, a corrupted live parameter on a reload or update.
  const bool in_place = session.mode() == LoadMode::kCold;
  for (size_t p = 0; in_place && p < layout.parameters().size(); ++p) {
    const Parameter& parameter = layout.parameters()[p];
    if (parameter.parts.empty() || parameter.processing != Processing::kNone || parameter.data == nullptr) continue;
    bool shared_tensor = false;
    for (const ParameterPart& part : parameter.parts) shared_tensor |= needs[part.tensor].size() != 1;
    if (shared_tensor) continue;
    for (size_t l = 0; l < state.links.size(); ++l) {
      const State::Link& link = state.links[l];
      auto found = link.by_name.find(parameter.name);
      if (found == link.by_name.end()) continue;
      const PeerParameter& served = link.manifest.parameters[found->second];
      if (served.dtype != parameter.dtype || served.bytes != parameter.bytes() || served.processing != Processing::kNone ||
          !same_parts(served.parts, parameter.parts) || !parameter.padding.empty()) {
        continue;
      }
      const uint64_t size = element_bytes(parameter.dtype);
      bool writable = true;
      for (const ParameterPart& part : parameter.parts) {
        const uint64_t row_bytes = static_cast<uint64_t>(part.tensor_columns()) * size;
        std::byte* at = session.direct_destination(part.tensor, parameter.dtype, part.shape,
                                                   static_cast<uint64_t>(part.row_begin) * row_bytes,
                                                   static_cast<uint64_t>(part.rows) * row_bytes, gpu_direct);
        writable &= at == parameter.data + part.element_offset * size;
      }
      if (!writable) continue;
      directs.push_back(Direct{l, found->second, p});
      for (const ParameterPart& part : parameter.parts) direct_tensors.insert(part.tensor);
      break;
    }
  }

  // Ends the reads still in flight when a scope is left by an exception: they land in
  // memory, and run Landed callbacks on digests, that the scope is about to free.
  struct CancelOnError {
    std::vector<State::Link>& links;
    int exceptions = std::uncaught_exceptions();
    ~CancelOnError() {
      if (std::uncaught_exceptions() > exceptions) {
        for (State::Link& link : links) link.endpoint->cancel();
      }
    }
  };
  auto wait_all = [&] {
    for (State::Link& link : state.links) link.endpoint->wait(timeout);
  };
  bool paused = false;
  auto pause_due = [&] {
    return !paused && state.options.pause_after_bytes > 0 && report.bytes_from_peers >= state.options.pause_after_bytes;
  };
  auto pause_if_asked = [&] {
    if (pause_due()) {
      paused = true;
      wait_all();  // what was read so far has landed: the pause falls between two parameters
      if (state.options.on_pause) state.options.on_pause();
    }
  };
  // Host reads pause in the middle of a parameter instead: its reads issued, one landed and
  // the others in flight (the peer still sending), as a peer that freezes or dies mid-read
  // finds them. Counted here, not in the lambda: the reads' callbacks outlive it.
  uint64_t pieces_landed_before_pause = 0;
  // Reads a served parameter whole into GPU memory at `destination`, counted in `landed_bytes`.
  auto read_into_gpu = [&](State::Link& link, size_t served, std::byte* destination, uint64_t* landed_bytes) {
    pause_if_asked();
    const PeerParameter& parameter = link.manifest.parameters[served];
    for (uint64_t done = 0; done < parameter.bytes; done += kReadPieceBytes) {
      const uint64_t bytes = std::min(kReadPieceBytes, parameter.bytes - done);
      link.endpoint->get(destination + done, parameter.remote_address + done, link.keys[served], bytes, timeout,
                         ucx::Memory::kCuda, [landed_bytes, bytes] { *landed_bytes += bytes; });
    }
    report.bytes_from_peers += parameter.bytes;
    link.bytes_read += parameter.bytes;
  };
  // Reads the digest pieces `pieces` of a served parameter into host memory at `destination`
  // (where the whole parameter lies), each hashed as it lands.
  auto read_pieces = [&](State::Link& link, size_t served, std::byte* destination, PieceDigests& pieces) {
    if (!state.options.pause_mid_parameter) pause_if_asked();
    const bool pause_here = state.options.pause_mid_parameter && pause_due() && pieces.size() >= kPausePieces;
    const PeerParameter& parameter = link.manifest.parameters[served];
    WS_EXPECT(!parameter.piece_xxh64.empty() || parameter.bytes == 0, ErrorCode::kProtocol,
              "parameter " + parameter.name + " served by " + peer_text(link.manifest) + " has no piece digests");
    uint64_t* landed = pause_here ? &pieces_landed_before_pause : nullptr;
    for (size_t k = 0; k < pieces.size(); ++k) {
      const auto [offset, bytes] = pieces.range(k);
      link.endpoint->get(destination + offset, parameter.remote_address + offset, link.keys[served], bytes, timeout,
                         ucx::Memory::kHost, [&pieces, destination, k, landed] {
                           pieces.landed(k, destination);
                           if (landed) ++*landed;
                         });
      report.bytes_from_peers += bytes;
      link.bytes_read += bytes;
    }
    if (pause_here) {
      paused = true;
      link.endpoint->wait_until(pieces_landed_before_pause, 1, timeout);
      if (state.options.on_pause) state.options.on_pause();
    }
  };
  ParameterDigester digester;
  // Reads ahead keep landing while a GPU parameter is hashed: UCX moves bytes over tcp only
  // while this process turns its worker.
  auto turn_workers = [&] {
    for (State::Link& link : state.links) link.endpoint->progress();
  };
  // `what` names the bytes checked when they are part of the parameter ("bytes 0-65536: ").
  auto fail_digest = [&](const State::Link& link, const PeerParameter& parameter, const std::string& what,
                         uint64_t digest, uint64_t expected) {
    char text[96];
    std::snprintf(text, sizeof(text), "xxh64 %016llx, the manifest says %016llx", static_cast<unsigned long long>(digest),
                  static_cast<unsigned long long>(expected));
    ++state.digest_failures;
    WS_FAIL(ErrorCode::kProtocol, "parameter " + parameter.name + " read from " + peer_text(link.manifest) +
                                      " does not match its digest (" + what + text +
                                      "): its bytes changed in the peer's memory or in transit; the pull is refused");
  };
  auto check_digest = [&](const State::Link& link, size_t served, uint64_t digest) {
    const PeerParameter& parameter = link.manifest.parameters[served];
    if (digest != parameter.xxh64) fail_digest(link, parameter, "", digest, parameter.xxh64);
    ++report.parameters_read;
  };
  auto check_pieces = [&](const State::Link& link, size_t served, const PieceDigests& pieces) {
    const PeerParameter& parameter = link.manifest.parameters[served];
    for (size_t k = 0; k < pieces.size(); ++k) {
      const uint64_t expected = parameter.piece_xxh64[pieces.index(k)];
      if (pieces.digest(k) == expected) continue;
      const auto [offset, bytes] = pieces.range(k);
      fail_digest(link, parameter, "bytes " + std::to_string(offset) + "-" + std::to_string(offset + bytes) + ": ",
                  pieces.digest(k), expected);
    }
    ++report.parameters_read;
  };

  // GPU parameters landed and waiting to be checked on the device (device_hashes_xxh64()):
  // each digest piece of each, hashed in one launch, compared with the manifest's pieces.
  struct DeviceCheck {
    size_t link = 0;
    size_t served = 0;
    size_t first_range = 0;  ///< its first piece in `ranges`
  };
  std::vector<DeviceCheck> device_checks;
  std::vector<DeviceDigestRange> device_ranges;
  uint64_t device_check_bytes = 0;
  const bool check_on_device = gpu_direct && device_hashes_xxh64();
  auto run_device_checks = [&] {
    if (device_checks.empty()) return;
    const std::vector<uint64_t> digests = xxh64_on_device(layout.device(), device_ranges);
    for (size_t c = 0; c < device_checks.size(); ++c) {
      const DeviceCheck& check = device_checks[c];
      const PeerParameter& parameter = state.links[check.link].manifest.parameters[check.served];
      const size_t end = c + 1 < device_checks.size() ? device_checks[c + 1].first_range : device_ranges.size();
      const uint64_t piece_bytes = state.links[check.link].manifest.digest_piece_bytes;
      for (size_t r = check.first_range; r < end; ++r) {
        const size_t k = r - check.first_range;
        if (digests[r] == parameter.piece_xxh64[k]) continue;
        fail_digest(state.links[check.link], parameter,
                    "bytes " + std::to_string(k * piece_bytes) + "-" +
                        std::to_string(k * piece_bytes + device_ranges[r].bytes) + ": ",
                    digests[r], parameter.piece_xxh64[k]);
      }
      ++report.parameters_read;
    }
    device_checks.clear();
    device_ranges.clear();
    device_check_bytes = 0;
  };
  // Queues a landed GPU parameter's pieces for run_device_checks().
  auto check_on_device_later = [&](size_t link_index, size_t served, const std::byte* data) {
    const State::Link& link = state.links[link_index];
    const PeerParameter& parameter = link.manifest.parameters[served];
    const uint64_t piece_bytes = link.manifest.digest_piece_bytes;
    const uint64_t pieces = piece_bytes == 0 ? 0 : (parameter.bytes + piece_bytes - 1) / piece_bytes;
    WS_EXPECT(parameter.piece_xxh64.size() == pieces, ErrorCode::kProtocol,
              "parameter " + parameter.name + " served by " + peer_text(link.manifest) + " has " +
                  std::to_string(parameter.piece_xxh64.size()) + " piece digests for " + std::to_string(pieces) +
                  " pieces");
    device_checks.push_back({link_index, served, device_ranges.size()});
    for (uint64_t k = 0; k < pieces; ++k) {
      device_ranges.push_back({data + k * piece_bytes, std::min(piece_bytes, parameter.bytes - k * piece_bytes)});
    }
    device_check_bytes += parameter.bytes;
    if (device_check_bytes >= kDeviceCheckBytes) run_device_checks();
  };

  {
    // A fresh host layout's pages would be first touched as the bytes land, by the thread that
    // turns UCX; a helper populates them ahead of the reads instead, on a core the pull leaves
    // idle (populating never changes a byte, so it may overlap a read into the same pages).
    std::jthread populator;
    if (!layout.device().is_cuda()) {
      populator = std::jthread([&](const std::stop_token& stop) {
        for (const Direct& direct : directs) {
          if (stop.stop_requested()) return;
          const Parameter& parameter = layout.parameters()[direct.parameter];
          storage::populate_destination(std::span(parameter.data, parameter.bytes()));
        }
      });
    }
    // Each parameter is checked as soon as it has landed, while the reads of the next ones
    // (up to kReadAheadBytes) are in flight.
    std::vector<std::unique_ptr<PieceDigests>> digests(directs.size());  // host parameters in flight
    std::vector<uint64_t> landed_bytes(directs.size(), 0);                // GPU parameters
    size_t issued = 0;
    uint64_t ahead = 0;
    // A digest that fails leaves later reads in flight, into the layout, `digests` and
    // `landed_bytes`.
    CancelOnError cancel_on_error{state.links};
    for (size_t checked = 0; checked < directs.size(); ++checked) {
      while (issued < directs.size() && (issued == checked || ahead < kReadAheadBytes)) {
        const Direct& direct = directs[issued];
        const Parameter& parameter = layout.parameters()[direct.parameter];
        State::Link& link = state.links[direct.link];
        if (gpu_direct) {
          read_into_gpu(link, direct.served, parameter.data, &landed_bytes[issued]);
        } else {
          const std::pair<uint64_t, uint64_t> whole{0, parameter.bytes()};
          digests[issued] = std::make_unique<PieceDigests>(link.manifest.digest_piece_bytes, parameter.bytes(),
                                                           std::span(&whole, 1));
          read_pieces(link, direct.served, parameter.data, *digests[issued]);
        }
        ahead += parameter.bytes();
        ++issued;
      }
      const Direct& direct = directs[checked];
      const Parameter& parameter = layout.parameters()[direct.parameter];
      ucx::Endpoint& endpoint = *state.links[direct.link].endpoint;
      if (const std::unique_ptr<PieceDigests>& pieces = digests[checked]) {
        endpoint.wait_until(pieces->landed_count(), pieces->size(), timeout);
        check_pieces(state.links[direct.link], direct.served, *pieces);
        digests[checked].reset();
      } else {
        endpoint.wait_until(landed_bytes[checked], parameter.bytes(), timeout);
        if (check_on_device) {
          check_on_device_later(direct.link, direct.served, parameter.data);
        } else {
          check_digest(state.links[direct.link], direct.served,
                       digester.digest(parameter.data, layout.device(), parameter.bytes(), turn_workers));
        }
      }
      ahead -= parameter.bytes();
    }
    run_device_checks();
    wait_all();
    std::vector<TensorView> views;
    for (const Direct& direct : directs) {
      const Parameter& parameter = layout.parameters()[direct.parameter];
      report.bytes_in_place += parameter.bytes();
      const uint64_t size = element_bytes(parameter.dtype);
      for (const ParameterPart& part : parameter.parts) {
        const uint64_t row_bytes = static_cast<uint64_t>(part.tensor_columns()) * size;
        views.push_back(TensorView{.name = part.tensor,
                                   .dtype = parameter.dtype,
                                   .shape = part.shape,
                                   .data = parameter.data + part.element_offset * size,
                                   .device = layout.device(),
                                   .offset = static_cast<uint64_t>(part.row_begin) * row_bytes,
                                   .bytes = static_cast<uint64_t>(part.rows) * row_bytes});
      }
    }
    if (!views.empty()) session.load(views);
    report.tensors += views.size();
  }

  // ---- everything else: covered by serving parameters' rectangles, assembled ----
  struct Piece {
    size_t link = 0;
    size_t served = 0;
    const ParameterPart* part = nullptr;  // the serving part
    Rect rect;                            // what it contributes
  };
  struct Assembly {
    std::string tensor;
    int64_t layer = -1;  // of the first parameter that wants it
    Dtype dtype = Dtype::kBF16;
    int64_t row_begin = 0, row_end = 0;
    std::vector<Piece> pieces;
  };
  std::vector<Assembly> assemblies;
  for (const std::string& name : order) {
    if (direct_tensors.count(name) != 0) continue;
    const std::vector<Need>& wanted = needs[name];
    Assembly assembly;
    assembly.tensor = name;
    assembly.layer = layout.parameters()[wanted.front().parameter].layer;
    assembly.row_begin = wanted.front().rect.row_begin;
    assembly.row_end = wanted.front().rect.row_end;
    std::vector<Rect> left;
    for (const Need& need : wanted) {
      assembly.row_begin = std::min(assembly.row_begin, need.rect.row_begin);
      assembly.row_end = std::max(assembly.row_end, need.rect.row_end);
      left.push_back(need.rect);
    }
    std::string processed;  // a peer that holds the tensor only processed, for the error
    std::optional<Dtype> dtype;
    for (size_t l = 0; l < state.links.size() && !left.empty(); ++l) {
      const PeerManifest& manifest = state.links[l].manifest;
      for (size_t s = 0; s < manifest.parameters.size() && !left.empty(); ++s) {
        const PeerParameter& served = manifest.parameters[s];
        for (const ParameterPart& part : served.parts) {
          if (part.tensor != name) continue;
          if (served.processing != Processing::kNone) {
            processed = served.name + " of " + peer_text(manifest);
            continue;
          }
          const Rect have = Rect::of(part);
          std::vector<Rect> next;
          for (const Rect& rect : left) {
            Rect inner = rect.intersect(have);
            if (inner.empty()) {
              next.push_back(rect);
              continue;
            }
            WS_EXPECT(!dtype || *dtype == served.dtype, ErrorCode::kModel,
                      "tensor " + name + " is held in " + std::string(dtype_name(*dtype)) + " and in " +
                          std::string(dtype_name(served.dtype)) + " by the peers of " + state.uri);
            dtype = served.dtype;
            assembly.pieces.push_back(Piece{l, s, &part, inner});
            for (const Rect& rest : rect.minus(inner)) next.push_back(rest);
          }
          left = std::move(next);
        }
      }
    }
    if (!left.empty()) {
      const Need& need = wanted.front();
      WS_FAIL(ErrorCode::kModel,
              "no peer of " + state.uri + " holds " + left.front().text() + " of tensor " + name + " (wanted by " +
                  layout.parameters()[need.parameter].name + " of " + layout.description() + ")" +
                  (processed.empty() ? std::string()
                                     : "; " + processed + " holds it processed (quantized), which cannot be read back "
                                                          "as checkpoint bytes: serve without --quantize"));
    }
    assembly.dtype = *dtype;
    assemblies.push_back(std::move(assembly));
  }

  // Whole layers together, in the order the layout first wants each: a batch that holds every
  // tensor of its layers lets a whole-layer commit write them at once, holding nothing back.
  {
    std::map<int64_t, size_t> rank;  // layer -> the order of its first assembly
    for (const Assembly& assembly : assemblies) rank.try_emplace(assembly.layer, rank.size());
    std::stable_sort(assemblies.begin(), assemblies.end(),
                     [&](const Assembly& a, const Assembly& b) { return rank[a.layer] < rank[b.layer]; });
  }
  // An assembly whose one piece is whole rows of its tensor on both sides (the puller's part
  // and the server's) is handed to the session straight from the staged serving parameter:
  // no rows to assemble. On a reload or update, where every parameter comes this way, that
  // saves a copy of the whole model.
  auto staged_as_is = [&](const Assembly& assembly, int64_t columns) {
    if (assembly.pieces.size() != 1) return false;
    const Piece& piece = assembly.pieces.front();
    return piece.part->column_begin == 0 && piece.part->columns == columns && piece.rect.column_begin == 0 &&
           piece.rect.column_end == columns && piece.rect.row_begin == assembly.row_begin &&
           piece.rect.row_end == assembly.row_end;
  };
  auto columns_of = [&](const Assembly& assembly) {
    return ParameterPart{.shape = tensors.find(assembly.tensor)->second->shape}.tensor_columns();
  };

  // ---- staged batches: a few layers each, read into reused staging, checked, then written ----
  // Each batch lays out in one staging buffer the serving parameters its assemblies read from
  // (whole, at their own offsets, though only the digest pieces holding what is needed are
  // read) and the rows assembled from them. A batch ends at a layer's end once the next
  // layer would take it past the buffer's size; a layer larger than that is split (its
  // earlier batches then wait in the session, copied, for the rest: LayerCommit::kWholeLayer).
  using ServedKey = std::pair<size_t, size_t>;  // link, serving parameter
  struct StagedRead {
    uint64_t offset = 0;                                 // where the serving parameter lies
    std::vector<std::pair<uint64_t, uint64_t>> ranges;  // the bytes of it that are needed
  };
  struct Batch {
    size_t first = 0, end = 0;  // assemblies [first, end)
    std::map<ServedKey, StagedRead> reads;
    std::vector<uint64_t> rows;  // per assembly: where its rows are assembled (kAsIs: none)
    uint64_t bytes = 0;
  };
  constexpr uint64_t kAsIs = ~uint64_t{0};
  auto aligned = [](uint64_t bytes) { return (std::max<uint64_t>(bytes, 1) + kStagingAlign - 1) / kStagingAlign * kStagingAlign; };
  // Bytes `assembly` adds to `batch`.
  auto cost = [&](const Batch& batch, const Assembly& assembly, std::set<ServedKey>& fresh) {
    const int64_t columns = columns_of(assembly);
    uint64_t more = staged_as_is(assembly, columns)
                        ? 0
                        : aligned(static_cast<uint64_t>(assembly.row_end - assembly.row_begin) * columns *
                                  element_bytes(assembly.dtype));
    for (const Piece& piece : assembly.pieces) {
      const ServedKey key{piece.link, piece.served};
      if (batch.reads.count(key) == 0 && fresh.insert(key).second) {
        more += aligned(state.links[piece.link].manifest.parameters[piece.served].bytes);
      }
    }
    return more;
  };
  auto add = [&](Batch& batch, size_t a) {
    const Assembly& assembly = assemblies[a];
    const int64_t columns = columns_of(assembly);
    const uint64_t size = element_bytes(assembly.dtype);
    for (const Piece& piece : assembly.pieces) {
      const ServedKey key{piece.link, piece.served};
      auto [at, inserted] = batch.reads.try_emplace(key);
      if (inserted) {
        at->second.offset = batch.bytes;
        batch.bytes += aligned(state.links[piece.link].manifest.parameters[piece.served].bytes);
      }
      // Whole rows of the serving part: one range of the serving parameter.
      const ParameterPart& part = *piece.part;
      const uint64_t row_bytes = static_cast<uint64_t>(part.columns) * size;
      const uint64_t start = part.element_offset * size;
      at->second.ranges.emplace_back(start + static_cast<uint64_t>(piece.rect.row_begin - part.row_begin) * row_bytes,
                                     start + static_cast<uint64_t>(piece.rect.row_end - part.row_begin) * row_bytes);
    }
    if (staged_as_is(assembly, columns)) {
      batch.rows.push_back(kAsIs);
    } else {
      batch.rows.push_back(batch.bytes);
      batch.bytes += aligned(static_cast<uint64_t>(assembly.row_end - assembly.row_begin) * columns * size);
    }
    batch.end = a + 1;
  };
  // Layer groups of the assemblies: [layers[i], layers[i + 1]).
  std::vector<size_t> layers;
  for (size_t a = 0; a < assemblies.size(); ++a) {
    if (a == 0 || assemblies[a].layer != assemblies[a - 1].layer) layers.push_back(a);
  }
  layers.push_back(assemblies.size());
  // A batch holds kStagingSlotBytes, or the largest layer where the memory limit allows: a
  // layer split across batches is held in the session until its last batch (copied: the
  // staging is reused at once), an extra copy of it.
  uint64_t largest_layer = 0;
  for (size_t i = 0; i + 1 < layers.size(); ++i) {
    Batch alone;
    std::set<ServedKey> fresh;
    uint64_t bytes = 0;
    for (size_t a = layers[i]; a < layers[i + 1]; ++a) bytes += cost(alone, assemblies[a], fresh);
    largest_layer = std::max(largest_layer, bytes);
  }
  const uint64_t slot_budget = std::max<uint64_t>(
      std::min<uint64_t>(std::max(kStagingSlotBytes, largest_layer), state.options.memory_limit / kStagingSlots),
      kStagingAlign);
  std::vector<Batch> batches;
  {
    Batch batch;
    auto close = [&] {
      if (batch.end > batch.first) batches.push_back(std::move(batch));
      batch = Batch{};
      batch.first = batch.end = batches.empty() ? 0 : batches.back().end;
    };
    for (size_t i = 0, a = 0; i + 1 < layers.size(); ++i) {
      const size_t layer_end = layers[i + 1];
      std::set<ServedKey> fresh;
      uint64_t layer_bytes = 0;
      for (size_t k = a; k < layer_end; ++k) layer_bytes += cost(batch, assemblies[k], fresh);
      if (batch.bytes + layer_bytes > slot_budget) close();  // the layer starts a batch of its own
      for (; a < layer_end; ++a) {
        std::set<ServedKey> one;
        if (batch.end > batch.first && batch.bytes + cost(batch, assemblies[a], one) > slot_budget) close();
        add(batch, a);
      }
    }
    close();
  }

  // Writes batch `batch` from `base` (its staging): the rows assembled, every view handed to
  // the session, which has returned by the time this does, its copies done (lifetime kCall):
  // the staging is then free for the next batch's reads.
  auto commit = [&](const Batch& batch, std::byte* base) {
    std::vector<TensorView> views;
    for (size_t a = batch.first; a < batch.end; ++a) {
      const Assembly& assembly = assemblies[a];
      const PeerTensor& tensor = *tensors.find(assembly.tensor)->second;
      const int64_t columns = columns_of(assembly);
      const uint64_t size = element_bytes(assembly.dtype);
      const uint64_t row_bytes = static_cast<uint64_t>(columns) * size;
      const uint64_t bytes = static_cast<uint64_t>(assembly.row_end - assembly.row_begin) * row_bytes;
      TensorView view{.name = assembly.tensor,
                      .dtype = assembly.dtype,
                      .shape = tensor.shape,
                      .device = Device{},
                      .offset = static_cast<uint64_t>(assembly.row_begin) * row_bytes,
                      .bytes = bytes};
      const uint64_t rows_at = batch.rows[a - batch.first];
      if (rows_at == kAsIs) {
        const Piece& piece = assembly.pieces.front();
        view.data = base + batch.reads.at({piece.link, piece.served}).offset +
                    (piece.part->element_offset + static_cast<uint64_t>(piece.rect.row_begin - piece.part->row_begin) *
                                                      static_cast<uint64_t>(columns)) * size;
        views.push_back(view);
        continue;
      }
      std::byte* rows = base + rows_at;
      for (const Piece& piece : assembly.pieces) {
        const std::byte* source = base + batch.reads.at({piece.link, piece.served}).offset;
        const ParameterPart& part = *piece.part;
        const uint64_t width = static_cast<uint64_t>(piece.rect.column_end - piece.rect.column_begin) * size;
        if (part.column_begin == 0 && part.columns == columns && piece.rect.column_begin == 0 &&
            piece.rect.column_end == columns) {  // whole rows on both sides: one run
          std::memcpy(rows + static_cast<uint64_t>(piece.rect.row_begin - assembly.row_begin) * row_bytes,
                      source + (part.element_offset + static_cast<uint64_t>(piece.rect.row_begin - part.row_begin) *
                                                          static_cast<uint64_t>(columns)) * size,
                      static_cast<uint64_t>(piece.rect.row_end - piece.rect.row_begin) * row_bytes);
          continue;
        }
        for (int64_t row = piece.rect.row_begin; row < piece.rect.row_end; ++row) {
          const uint64_t from = (part.element_offset + static_cast<uint64_t>(row - part.row_begin) * part.columns +
                                 static_cast<uint64_t>(piece.rect.column_begin - part.column_begin)) * size;
          const uint64_t to = static_cast<uint64_t>(row - assembly.row_begin) * row_bytes +
                              static_cast<uint64_t>(piece.rect.column_begin) * size;
          std::memcpy(rows + to, source + from, width);
        }
      }
      view.data = rows;
      views.push_back(view);
    }
    if (!views.empty()) session.load(views);
  };
  // Staging buffers, allocated (and their pages populated) once per source and reused by
  // every batch of its pulls: batch b reads into buffer b % kStagingSlots, which the
  // committer has finished writing from (batch b - kStagingSlots) before the reads start.
  uint64_t slot_bytes = 0;
  for (const Batch& batch : batches) slot_bytes = std::max(slot_bytes, batch.bytes);
  Committer committer;
  // As many buffers as there are batches, up to kStagingSlots.
  const size_t slots = std::min(batches.size(), kStagingSlots);
  if (!batches.empty()) {
    for (size_t slot = 0; slot < slots; ++slot) {
      State::Staging& staging = state.staging[slot];
      if (staging.capacity >= slot_bytes) continue;
      staging.bytes.reset();
      staging.bytes = std::make_unique_for_overwrite<std::byte[]>(slot_bytes);
      staging.capacity = slot_bytes;
      // Populated on the committer's thread, which has nothing else to do yet: the first
      // batch's reads land meanwhile (populating never changes a byte).
      committer.post([bytes = staging.bytes.get(), slot_bytes] {
        storage::populate_destination(std::span(bytes, slot_bytes));
      });
    }
    for (size_t slot = 0; slot < slots; ++slot) report.staging_bytes += state.staging[slot].capacity;
  }
  // The reads of the next batches land while the committer writes the one before: a batch
  // is checked whole (every digest piece read against its digest) before the committer sees
  // it, so no parameter, live or not, ever holds a byte that failed or skipped its check.
  std::vector<size_t> committed(batches.size(), 0);  // the committer's ticket of each batch
  std::vector<std::map<ServedKey, std::unique_ptr<PieceDigests>>> pieces(batches.size());
  CancelOnError cancel_on_error{state.links};  // declared after `pieces`: ends their reads first
  // Batch b reads into staging b % kStagingSlots once the committer is done with the batch
  // before it there; the reads in flight keep moving meanwhile (over tcp, UCX moves bytes
  // only while this thread turns the worker).
  auto issue = [&](size_t b) {
    if (b >= kStagingSlots) {
      while (!committer.ended(committed[b - kStagingSlots], std::chrono::milliseconds(1))) turn_workers();
    }
    std::byte* base = state.staging[b % kStagingSlots].bytes.get();
    for (const auto& [key, read] : batches[b].reads) {
      State::Link& link = state.links[key.first];
      const PeerParameter& served = link.manifest.parameters[key.second];
      // Only the digest pieces that hold what the assemblies need.
      auto& digests = pieces[b][key] =
          std::make_unique<PieceDigests>(link.manifest.digest_piece_bytes, served.bytes, read.ranges);
      read_pieces(link, key.second, base + read.offset, *digests);
    }
  };
  for (size_t b = 0; b < std::min(batches.size(), kStagingSlots - 1); ++b) issue(b);
  for (size_t b = 0; b < batches.size(); ++b) {
    for (const auto& [key, digests] : pieces[b]) {
      state.links[key.first].endpoint->wait_until(digests->landed_count(), digests->size(), timeout);
    }
    for (const auto& [key, digests] : pieces[b]) check_pieces(state.links[key.first], key.second, *digests);
    pieces[b].clear();
    report.tensors += batches[b].end - batches[b].first;
    const Batch& batch = batches[b];
    std::byte* base = state.staging[b % kStagingSlots].bytes.get();
    committed[b] = committer.post([&commit, &batch, base] { commit(batch, base); });
    if (b + kStagingSlots - 1 < batches.size()) issue(b + kStagingSlots - 1);
  }
  if (!batches.empty()) committer.wait(committed.back());

  state.check_versions();
  report.seconds = std::chrono::duration<double>(Clock::now() - started).count();
  return report;
}

}  // namespace weightstream
