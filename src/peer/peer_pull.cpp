// PeerSource: connects to the serving ranks of an instance, checks that their manifests
// agree, and pulls what a LoadSession's layout needs in four steps: plan (pull_plan.hpp:
// what each parameter needs and which peer's parameters cover it), fetch (reads over UCX),
// verify (what landed against the manifest's digests) and deliver (to the session).
//
// On a cold load, a parameter a peer holds identically is read whole straight into its
// storage, then checked against its digest. A reload or update overwrites parameters that
// serve, so it takes the staged path for everything: no byte reaches the session or the
// parameters before its digest has been checked. Staging is bounded and reused: batches of
// whole layers, each read into one of a few buffers the source keeps, checked whole, then
// handed to the session on a thread of its own while the next batches' reads land.

#include <algorithm>
#include <array>
#include <cctype>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stop_token>
#include <thread>

#include "device/shared/digests.hpp"
#include "net/socket.hpp"
#include "net/ucx.hpp"
#include "peer/committer.hpp"
#include "peer/peer_protocol.hpp"
#include "peer/pull_plan.hpp"
#include "storage/shared/read_destination.hpp"
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
using pull::element_bytes;
using pull::kStagingSlots;
using pull::peer_text;

/// Reads into GPU memory are issued in pieces of at most this many bytes, so several are in
/// flight; reads into host memory go by the manifest's digest pieces (PieceDigests).
constexpr uint64_t kReadPieceBytes = 8ull << 20;

/// Parameters read in place run this far ahead of the one being checked against its digest,
/// so that hashing one overlaps the transfer of the next ones.
constexpr uint64_t kReadAheadBytes = 128ull << 20;
/// GPU parameters that have landed are checked on the device, piece by piece against the
/// manifest, in launches of about this many bytes (one thread hashes a piece: a launch wants
/// thousands of pieces to keep the device busy).
constexpr uint64_t kDeviceCheckBytes = 1ull << 30;

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
  /// The serving peers as a plan sees them.
  std::vector<pull::ServingPeer> serving_peers() const;
  class Pull;
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

std::vector<pull::ServingPeer> PeerSource::State::serving_peers() const {
  std::vector<pull::ServingPeer> peers;
  for (const Link& link : links) peers.push_back({&link.manifest, &link.by_name});
  return peers;
}

/// One pull of a PeerSource into a LoadSession, step by step.
class PeerSource::State::Pull {
 public:
  Pull(State& state, LoadSession& session)
      : state_(state),
        session_(session),
        layout_(session.layout()),
        timeout_(state.options.timeout),
        // GPU parameters are read into straight from the peers only by a CUDA-aware UCX;
        // otherwise their bytes come through host staging like anything assembled.
        gpu_direct_(layout_.device().is_cuda() && state.worker->moves_cuda_memory()),
        check_on_device_(gpu_direct_ && device_hashes_xxh64()) {}

  /// What each parameter needs, which parameters are read in place, the staged batches.
  void plan();
  /// Fetches, verifies and delivers the parameters read in place.
  void read_in_place();
  /// Fetches, verifies and delivers the staged batches.
  void read_staged();

  PeerPullReport report;

 private:
  /// Ends the reads still in flight when a scope is left by an exception: they land in
  /// memory, and run Landed callbacks on digests, that the scope is about to free.
  struct CancelOnError {
    std::vector<Link>& links;
    int exceptions = std::uncaught_exceptions();
    ~CancelOnError() {
      if (std::uncaught_exceptions() > exceptions) {
        for (Link& link : links) link.endpoint->cancel();
      }
    }
  };
  /// The parameters read in place whose reads are in flight: host ones hashed as they land,
  /// GPU ones counted.
  struct InPlaceReads {
    std::vector<std::unique_ptr<PieceDigests>> digests;
    std::vector<uint64_t> landed_bytes;
  };
  /// GPU parameters landed and waiting to be checked on the device (device_hashes_xxh64()):
  /// each digest piece of each, hashed in one launch, compared with the manifest's pieces.
  struct DeviceCheck {
    size_t link = 0;
    size_t served = 0;
    size_t first_range = 0;  ///< its first piece in `device_ranges_`
  };
  using StagedDigests = std::map<pull::ServedKey, std::unique_ptr<PieceDigests>>;

  // ---- fetch ----
  bool pause_due() const {
    return !paused_ && state_.options.pause_after_bytes > 0 && report.bytes_from_peers >= state_.options.pause_after_bytes;
  }
  void pause_if_asked();
  void wait_all() {
    for (Link& link : state_.links) link.endpoint->wait(timeout_);
  }
  /// Reads ahead keep landing while a GPU parameter is hashed: UCX moves bytes over tcp only
  /// while this process turns its worker.
  void turn_workers() {
    for (Link& link : state_.links) link.endpoint->progress();
  }
  void fetch_into_gpu(Link& link, size_t served, std::byte* destination, uint64_t* landed_bytes);
  void fetch_pieces(Link& link, size_t served, std::byte* destination, PieceDigests& pieces);
  void fetch_in_place(size_t i, InPlaceReads& reads);
  void fetch_batch(size_t b, pull::Committer& committer, const std::vector<size_t>& committed, StagedDigests& digests);
  std::jthread populate_in_place() const;
  void prepare_staging(pull::Committer& committer);

  // ---- verify ----
  [[noreturn]] void fail_digest(const Link& link, const PeerParameter& parameter, const std::string& what,
                                uint64_t digest, uint64_t expected);
  void verify_whole(const Link& link, size_t served, uint64_t digest);
  void verify_pieces(const Link& link, size_t served, const PieceDigests& pieces);
  void verify_on_device_later(size_t link_index, size_t served, const std::byte* data);
  void run_device_checks();
  void verify_in_place(size_t i, InPlaceReads& reads);
  void verify_batch(const StagedDigests& digests);

  // ---- deliver ----
  void deliver_in_place();
  void deliver_batch(size_t b, std::byte* base);

  State& state_;
  LoadSession& session_;
  const ModelLayout& layout_;
  const std::chrono::milliseconds timeout_;
  const bool gpu_direct_;
  const bool check_on_device_;
  pull::PullPlan plan_;
  bool paused_ = false;
  // Host reads pause in the middle of a parameter instead: its reads issued, one landed and
  // the others in flight (the peer still sending), as a peer that freezes or dies mid-read
  // finds them. Counted here: the reads' callbacks outlive the call that issues them.
  uint64_t pieces_landed_before_pause_ = 0;
  ParameterDigester digester_;
  std::vector<DeviceCheck> device_checks_;
  std::vector<DeviceDigestRange> device_ranges_;
  uint64_t device_check_bytes_ = 0;
};

void PeerSource::State::Pull::plan() {
  for (const PeerTensor& tensor : state_.links.front().manifest.tensors) plan_.tensors.emplace(tensor.name, &tensor);
  const std::vector<pull::ServingPeer> peers = state_.serving_peers();
  pull::plan_needs(plan_, layout_, state_.uri);
  // A parameter read in place holds unchecked bytes until its digest is compared: harmless
  // while nothing uses the layout, a corrupted live parameter on a reload or update.
  if (session_.mode() == LoadMode::kCold) pull::plan_directs(plan_, session_, peers, gpu_direct_);
  pull::plan_assemblies(plan_, layout_, peers, state_.uri);
  pull::plan_batches(plan_, peers, state_.options.memory_limit);
}

// ---- fetch ----------------------------------------------------------------------------------

void PeerSource::State::Pull::pause_if_asked() {
  if (pause_due()) {
    paused_ = true;
    wait_all();  // what was read so far has landed: the pause falls between two parameters
    if (state_.options.on_pause) state_.options.on_pause();
  }
}

// Reads a served parameter whole into GPU memory at `destination`, counted in `landed_bytes`.
void PeerSource::State::Pull::fetch_into_gpu(Link& link, size_t served, std::byte* destination,
                                             uint64_t* landed_bytes) {
  pause_if_asked();
  const PeerParameter& parameter = link.manifest.parameters[served];
  for (uint64_t done = 0; done < parameter.bytes; done += kReadPieceBytes) {
    const uint64_t bytes = std::min(kReadPieceBytes, parameter.bytes - done);
    link.endpoint->get(destination + done, parameter.remote_address + done, link.keys[served], bytes, timeout_,
                       ucx::Memory::kCuda, [landed_bytes, bytes] { *landed_bytes += bytes; });
  }
  report.bytes_from_peers += parameter.bytes;
  link.bytes_read += parameter.bytes;
}

// Reads the digest pieces `pieces` of a served parameter into host memory at `destination`
// (where the whole parameter lies), each hashed as it lands.
void PeerSource::State::Pull::fetch_pieces(Link& link, size_t served, std::byte* destination, PieceDigests& pieces) {
  if (!state_.options.pause_mid_parameter) pause_if_asked();
  const bool pause_here = state_.options.pause_mid_parameter && pause_due() && pieces.size() >= kPausePieces;
  const PeerParameter& parameter = link.manifest.parameters[served];
  WS_EXPECT(!parameter.piece_xxh64.empty() || parameter.bytes == 0, ErrorCode::kProtocol,
            "parameter " + parameter.name + " served by " + peer_text(link.manifest) + " has no piece digests");
  uint64_t* landed = pause_here ? &pieces_landed_before_pause_ : nullptr;
  for (size_t k = 0; k < pieces.size(); ++k) {
    const auto [offset, bytes] = pieces.range(k);
    link.endpoint->get(destination + offset, parameter.remote_address + offset, link.keys[served], bytes, timeout_,
                       ucx::Memory::kHost, [&pieces, destination, k, landed] {
                         pieces.landed(k, destination);
                         if (landed) ++*landed;
                       });
    report.bytes_from_peers += bytes;
    link.bytes_read += bytes;
  }
  if (pause_here) {
    paused_ = true;
    link.endpoint->wait_until(pieces_landed_before_pause_, 1, timeout_);
    if (state_.options.on_pause) state_.options.on_pause();
  }
}

void PeerSource::State::Pull::fetch_in_place(size_t i, InPlaceReads& reads) {
  const pull::Direct& direct = plan_.directs[i];
  const Parameter& parameter = layout_.parameters()[direct.parameter];
  Link& link = state_.links[direct.link];
  if (gpu_direct_) {
    fetch_into_gpu(link, direct.served, parameter.data, &reads.landed_bytes[i]);
  } else {
    const std::pair<uint64_t, uint64_t> whole{0, parameter.bytes()};
    reads.digests[i] =
        std::make_unique<PieceDigests>(link.manifest.digest_piece_bytes, parameter.bytes(), std::span(&whole, 1));
    fetch_pieces(link, direct.served, parameter.data, *reads.digests[i]);
  }
}

// A fresh host layout's pages would be first touched as the bytes land, by the thread that
// turns UCX; a helper populates them ahead of the reads instead, on a core the pull leaves
// idle (populating never changes a byte, so it may overlap a read into the same pages).
std::jthread PeerSource::State::Pull::populate_in_place() const {
  if (layout_.device().is_cuda()) return {};
  return std::jthread([this](const std::stop_token& stop) {
    for (const pull::Direct& direct : plan_.directs) {
      if (stop.stop_requested()) return;
      const Parameter& parameter = layout_.parameters()[direct.parameter];
      storage::populate_destination(std::span(parameter.data, parameter.bytes()));
    }
  });
}

// Staging buffers, allocated (and their pages populated) once per source and reused by
// every batch of its pulls: batch b reads into buffer b % kStagingSlots, which the
// committer has finished writing from (batch b - kStagingSlots) before the reads start.
void PeerSource::State::Pull::prepare_staging(pull::Committer& committer) {
  if (plan_.batches.empty()) return;
  uint64_t slot_bytes = 0;
  for (const pull::Batch& batch : plan_.batches) slot_bytes = std::max(slot_bytes, batch.bytes);
  // As many buffers as there are batches, up to kStagingSlots.
  const size_t slots = std::min(plan_.batches.size(), kStagingSlots);
  for (size_t slot = 0; slot < slots; ++slot) {
    Staging& staging = state_.staging[slot];
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
  for (size_t slot = 0; slot < slots; ++slot) report.staging_bytes += state_.staging[slot].capacity;
}

// Batch b reads into staging b % kStagingSlots once the committer is done with the batch
// before it there; the reads in flight keep moving meanwhile (over tcp, UCX moves bytes
// only while this thread turns the worker).
void PeerSource::State::Pull::fetch_batch(size_t b, pull::Committer& committer, const std::vector<size_t>& committed,
                                          StagedDigests& digests) {
  if (b >= kStagingSlots) {
    while (!committer.ended(committed[b - kStagingSlots], std::chrono::milliseconds(1))) turn_workers();
  }
  std::byte* base = state_.staging[b % kStagingSlots].bytes.get();
  for (const auto& [key, read] : plan_.batches[b].reads) {
    Link& link = state_.links[key.first];
    const PeerParameter& served = link.manifest.parameters[key.second];
    // Only the digest pieces that hold what the assemblies need.
    auto& pieces = digests[key] = std::make_unique<PieceDigests>(link.manifest.digest_piece_bytes, served.bytes, read.ranges);
    fetch_pieces(link, key.second, base + read.offset, *pieces);
  }
}

// ---- verify ---------------------------------------------------------------------------------

// `what` names the bytes checked when they are part of the parameter ("bytes 0-65536: ").
void PeerSource::State::Pull::fail_digest(const Link& link, const PeerParameter& parameter, const std::string& what,
                                          uint64_t digest, uint64_t expected) {
  char text[96];
  std::snprintf(text, sizeof(text), "xxh64 %016llx, the manifest says %016llx", static_cast<unsigned long long>(digest),
                static_cast<unsigned long long>(expected));
  ++state_.digest_failures;
  WS_FAIL(ErrorCode::kProtocol, "parameter " + parameter.name + " read from " + peer_text(link.manifest) +
                                    " does not match its digest (" + what + text +
                                    "): its bytes changed in the peer's memory or in transit; the pull is refused");
}

void PeerSource::State::Pull::verify_whole(const Link& link, size_t served, uint64_t digest) {
  const PeerParameter& parameter = link.manifest.parameters[served];
  if (digest != parameter.xxh64) fail_digest(link, parameter, "", digest, parameter.xxh64);
  ++report.parameters_read;
}

void PeerSource::State::Pull::verify_pieces(const Link& link, size_t served, const PieceDigests& pieces) {
  const PeerParameter& parameter = link.manifest.parameters[served];
  for (size_t k = 0; k < pieces.size(); ++k) {
    const uint64_t expected = parameter.piece_xxh64[pieces.index(k)];
    if (pieces.digest(k) == expected) continue;
    const auto [offset, bytes] = pieces.range(k);
    fail_digest(link, parameter, "bytes " + std::to_string(offset) + "-" + std::to_string(offset + bytes) + ": ",
                pieces.digest(k), expected);
  }
  ++report.parameters_read;
}

void PeerSource::State::Pull::run_device_checks() {
  if (device_checks_.empty()) return;
  const std::vector<uint64_t> digests = xxh64_on_device(layout_.device(), device_ranges_);
  for (size_t c = 0; c < device_checks_.size(); ++c) {
    const DeviceCheck& check = device_checks_[c];
    const PeerParameter& parameter = state_.links[check.link].manifest.parameters[check.served];
    const size_t end = c + 1 < device_checks_.size() ? device_checks_[c + 1].first_range : device_ranges_.size();
    const uint64_t piece_bytes = state_.links[check.link].manifest.digest_piece_bytes;
    for (size_t r = check.first_range; r < end; ++r) {
      const size_t k = r - check.first_range;
      if (digests[r] == parameter.piece_xxh64[k]) continue;
      fail_digest(state_.links[check.link], parameter,
                  "bytes " + std::to_string(k * piece_bytes) + "-" +
                      std::to_string(k * piece_bytes + device_ranges_[r].bytes) + ": ",
                  digests[r], parameter.piece_xxh64[k]);
    }
    ++report.parameters_read;
  }
  device_checks_.clear();
  device_ranges_.clear();
  device_check_bytes_ = 0;
}

// Queues a landed GPU parameter's pieces for run_device_checks().
void PeerSource::State::Pull::verify_on_device_later(size_t link_index, size_t served, const std::byte* data) {
  const Link& link = state_.links[link_index];
  const PeerParameter& parameter = link.manifest.parameters[served];
  const uint64_t piece_bytes = link.manifest.digest_piece_bytes;
  const uint64_t pieces = piece_bytes == 0 ? 0 : (parameter.bytes + piece_bytes - 1) / piece_bytes;
  WS_EXPECT(parameter.piece_xxh64.size() == pieces, ErrorCode::kProtocol,
            "parameter " + parameter.name + " served by " + peer_text(link.manifest) + " has " +
                std::to_string(parameter.piece_xxh64.size()) + " piece digests for " + std::to_string(pieces) +
                " pieces");
  device_checks_.push_back({link_index, served, device_ranges_.size()});
  for (uint64_t k = 0; k < pieces; ++k) {
    device_ranges_.push_back({data + k * piece_bytes, std::min(piece_bytes, parameter.bytes - k * piece_bytes)});
  }
  device_check_bytes_ += parameter.bytes;
  if (device_check_bytes_ >= kDeviceCheckBytes) run_device_checks();
}

// Waits for parameter `i` read in place to land, and checks it (or queues its check).
void PeerSource::State::Pull::verify_in_place(size_t i, InPlaceReads& reads) {
  const pull::Direct& direct = plan_.directs[i];
  const Parameter& parameter = layout_.parameters()[direct.parameter];
  ucx::Endpoint& endpoint = *state_.links[direct.link].endpoint;
  if (const std::unique_ptr<PieceDigests>& pieces = reads.digests[i]) {
    endpoint.wait_until(pieces->landed_count(), pieces->size(), timeout_);
    verify_pieces(state_.links[direct.link], direct.served, *pieces);
    reads.digests[i].reset();
  } else {
    endpoint.wait_until(reads.landed_bytes[i], parameter.bytes(), timeout_);
    if (check_on_device_) {
      verify_on_device_later(direct.link, direct.served, parameter.data);
    } else {
      verify_whole(state_.links[direct.link], direct.served,
                   digester_.digest(parameter.data, layout_.device(), parameter.bytes(), [this] { turn_workers(); }));
    }
  }
}

// A batch is checked whole (every digest piece read against its digest) before the
// committer sees it, so no parameter, live or not, ever holds a byte that failed or skipped
// its check.
void PeerSource::State::Pull::verify_batch(const StagedDigests& digests) {
  for (const auto& [key, pieces] : digests) {
    state_.links[key.first].endpoint->wait_until(pieces->landed_count(), pieces->size(), timeout_);
  }
  for (const auto& [key, pieces] : digests) verify_pieces(state_.links[key.first], key.second, *pieces);
}

// ---- deliver --------------------------------------------------------------------------------

void PeerSource::State::Pull::deliver_in_place() {
  std::vector<TensorView> views;
  for (const pull::Direct& direct : plan_.directs) {
    const Parameter& parameter = layout_.parameters()[direct.parameter];
    report.bytes_in_place += parameter.bytes();
    const uint64_t size = element_bytes(parameter.dtype);
    for (const ParameterPart& part : parameter.parts) {
      const uint64_t row_bytes = static_cast<uint64_t>(part.tensor_columns()) * size;
      views.push_back(TensorView{.name = part.tensor,
                                 .dtype = parameter.dtype,
                                 .shape = part.shape,
                                 .data = parameter.data + part.element_offset * size,
                                 .device = layout_.device(),
                                 .offset = static_cast<uint64_t>(part.row_begin) * row_bytes,
                                 .bytes = static_cast<uint64_t>(part.rows) * row_bytes});
    }
  }
  if (!views.empty()) session_.load(views);
  report.tensors += views.size();
}

// Writes batch `b` from `base` (its staging): the rows assembled, every view handed to the
// session, which has returned by the time this does, its copies done (lifetime kCall): the
// staging is then free for the next batch's reads.
void PeerSource::State::Pull::deliver_batch(size_t b, std::byte* base) {
  const std::vector<TensorView> views = pull::batch_views(plan_, plan_.batches[b], base);
  if (!views.empty()) session_.load(views);
}

// ---- the steps together ---------------------------------------------------------------------

// Each parameter is checked as soon as it has landed, while the reads of the next ones (up to
// kReadAheadBytes) are in flight.
void PeerSource::State::Pull::read_in_place() {
  std::jthread populator = populate_in_place();
  const size_t count = plan_.directs.size();
  InPlaceReads reads{std::vector<std::unique_ptr<PieceDigests>>(count), std::vector<uint64_t>(count, 0)};
  size_t issued = 0;
  uint64_t ahead = 0;
  // A digest that fails leaves later reads in flight, into the layout and `reads`.
  CancelOnError cancel_on_error{state_.links};
  for (size_t checked = 0; checked < count; ++checked) {
    while (issued < count && (issued == checked || ahead < kReadAheadBytes)) {
      fetch_in_place(issued, reads);
      ahead += layout_.parameters()[plan_.directs[issued].parameter].bytes();
      ++issued;
    }
    verify_in_place(checked, reads);
    ahead -= layout_.parameters()[plan_.directs[checked].parameter].bytes();
  }
  run_device_checks();
  wait_all();
  deliver_in_place();
}

// The reads of the next batches land while the committer writes the one before.
void PeerSource::State::Pull::read_staged() {
  const std::vector<pull::Batch>& batches = plan_.batches;
  pull::Committer committer;
  prepare_staging(committer);
  std::vector<size_t> committed(batches.size(), 0);  // the committer's ticket of each batch
  std::vector<StagedDigests> digests(batches.size());
  CancelOnError cancel_on_error{state_.links};  // declared after `digests`: ends their reads first
  for (size_t b = 0; b < std::min(batches.size(), kStagingSlots - 1); ++b) {
    fetch_batch(b, committer, committed, digests[b]);
  }
  for (size_t b = 0; b < batches.size(); ++b) {
    verify_batch(digests[b]);
    digests[b].clear();
    report.tensors += batches[b].end - batches[b].first;
    std::byte* base = state_.staging[b % kStagingSlots].bytes.get();
    committed[b] = committer.post([this, b, base] { deliver_batch(b, base); });
    if (b + kStagingSlots - 1 < batches.size()) fetch_batch(b + kStagingSlots - 1, committer, committed, digests[b + kStagingSlots - 1]);
  }
  if (!batches.empty()) committer.wait(committed.back());
}

PeerPullReport PeerSource::pull(LoadSession& session) {
  const auto started = Clock::now();
  State::Pull pull(*state_, session);
  pull.plan();
  pull.read_in_place();
  pull.read_staged();
  state_->check_versions();
  pull.report.seconds = std::chrono::duration<double>(Clock::now() - started).count();
  return pull.report;
}

}  // namespace weightstream
