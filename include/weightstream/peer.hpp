#pragma once
/// @file peer.hpp
/// Peers: a process holding a loaded rank publishes its parameters (`PeerServer`), and a
/// new instance pulls what its own layout needs from the serving ranks (`PeerSource`),
/// over UCX from memory the server registered with ucp_mem_map, so the serving process's CPU
/// copies nothing: one-sided (ucp_get) where the endpoint's lanes carry RMA, else sent by the
/// server's UCX worker on request (a tagged rendezvous send, as over UCX's tcp;
/// PeerPullOptions::ucx_path). Control (token, manifest, version) travels on a
/// TCP connection to the server's `HOST:PORT`; bytes travel by UCX.
///
/// What a server publishes is a manifest: model_type, tp/ep size and rank, dtype,
/// quantization, the checkpoint's identity (a digest of its tensor index and config.json),
/// its content digest (a digest of every tensor's bytes: content_digest in stream.hpp;
/// unknown once the served parameters were updated), a version that changes with every update, config.json, the checkpoint tensors' names,
/// dtypes and shapes, and each parameter's name, dtype, shape, byte size, xxh64 digest and
/// the checkpoint rectangles (ModelLayout parts) it holds. A puller at any tp/ep layout maps
/// each of its parts to the serving ranks' rectangles in checkpoint coordinates, reads the
/// serving parameters it needs whole, checks each against its digest, and hands the bytes
/// to its LoadSession as checkpoint tensors (straight into its own parameters where the
/// layouts agree). Uses the model, device and format layers.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "weightstream/format.hpp"
#include "weightstream/model.hpp"
#include "weightstream/options.hpp"
#include "weightstream/stream.hpp"

namespace weightstream {

/// "peer://HOST:PORT[,HOST:PORT...]".
inline constexpr std::string_view kPeerScheme = "peer://";

/// True for a URI of the peer:// scheme.
bool is_peer_uri(std::string_view uri) noexcept;

/// The "HOST:PORT" addresses of a peer:// URI. Throws Error(kInvalidArgument) naming the
/// URI when it has none or a malformed one.
std::vector<std::string> peer_addresses(std::string_view uri);

/// A checkpoint tensor as the serving peer's checkpoint has it.
struct PeerTensor {
  std::string name;
  Dtype dtype = Dtype::kBF16;
  std::vector<int64_t> shape;
  std::string shard;  ///< the shard file holding it (part of the checkpoint identity)
};

/// One parameter a peer serves.
struct PeerParameter {
  std::string name;
  Dtype dtype = Dtype::kBF16;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
  uint64_t xxh64 = 0;  ///< of the parameter's bytes as served
  /// xxh64 of each piece of the manifest's digest_piece_bytes, in order (empty for a
  /// parameter without bytes): a puller that needs part of a parameter reads and checks
  /// only the pieces that hold it.
  std::vector<uint64_t> piece_xxh64;
  Processing processing = Processing::kNone;
  std::vector<ParameterPart> parts;  ///< checkpoint rectangles it holds (empty: derived)
  uint64_t remote_address = 0;       ///< where the peer registered it
  std::vector<std::byte> remote_key;  ///< packed UCX remote key
};

/// What one serving rank publishes.
struct PeerManifest {
  std::string address;        ///< "HOST:PORT" it was fetched from
  std::string model_type;
  Parallelism parallel;
  std::string dtype;          ///< the layout's parameter dtype ("BF16"), or "mixed"
  std::string quantization;   ///< "none", "fp8" (per-tensor, processed), "fp8-block" (checkpoint)
  std::string checkpoint_identity;  ///< xxh64 hex of the tensor index and config.json
  /// The content digest of the checkpoint it serves (content_digest in stream.hpp: 16 hex
  /// digits over every tensor's name, dtype, shape and bytes), the same at every rank of an
  /// instance. Empty: unknown, because the served parameters were updated since they were
  /// loaded (PeerServer::begin_update), or they were pulled from such a peer.
  std::string content_digest;
  uint64_t version = 1;             ///< changes with every update of the served parameters
  uint64_t digest_piece_bytes = 0;  ///< the pieces of PeerParameter::piece_xxh64
  std::string config_json;
  std::vector<PeerTensor> tensors;
  std::vector<PeerParameter> parameters;
  std::vector<std::byte> worker_address;  ///< the server's UCX worker
  /// What a puller presents with each request that the server send it a range (the
  /// rendezvous path); like the remote keys, sent only to a puller that proved the token.
  std::vector<std::byte> send_secret;
  /// The server's UCX tcp receive segment size, which a puller's must equal (ucx.hpp).
  uint64_t ucx_segment_bytes = 0;
  /// Filled by the puller, not published: how its UCX endpoint to this peer moves bytes
  /// ("rma" or "rendezvous") and the transports of the endpoint's lanes ("tcp/eth0").
  std::string ucx_path;
  std::string ucx_transports;
};

/// The digest that names a checkpoint: xxh64 (16 hex digits) over its tensors' names,
/// dtypes, shapes and shards, in name order, and config.json.
std::string peer_checkpoint_identity(std::span<const PeerTensor> tensors, std::string_view config_json);

/// Options of a serving peer.
struct PeerServeOptions {
  /// "HOST:PORT" to listen on (port 0 picks a free one); default "127.0.0.1:0".
  std::string listen;
  /// Token a puller must prove it knows (a mutual challenge-response: the token never
  /// crosses the wire). Required: a server with an empty token refuses to start
  /// (Error(kInvalidArgument)) unless `open_without_token` is set. Never logged or published.
  std::string token;
  /// Serve any puller, with no token. Must be asked for in so many words; warned about on
  /// stderr once, when the server starts. Set together with a token, Error(kInvalidArgument).
  bool open_without_token = false;
  /// How long a connected puller has for each message (its HELLO, a version request).
  std::chrono::milliseconds timeout{30'000};
  /// The pieces each parameter's bytes are also hashed in (PeerParameter::piece_xxh64);
  /// 0: the default, 512 KiB. A power of two from 4 KiB to 4 MiB.
  uint64_t digest_piece_bytes = 0;
};

/// What a PeerServer publishes besides the layout.
struct PeerServeInfo {
  std::string config_json;
  std::vector<PeerTensor> tensors;  ///< every tensor of the checkpoint
  /// PeerManifest::content_digest: 16 hex digits, or empty for unknown content.
  std::string content_digest;
  Parallelism parallel;
  std::string quantization = "none";
};

/// What a server of a layout loaded from `checkpoint` publishes besides the layout: its
/// config.json and tensors, its content digest, `parallel`, and its quantization ("fp8" for
/// a layout that quantizes, "fp8-block" for a block-scaled checkpoint, else "none"). The
/// content digest covers every tensor, not only the rank's: the whole checkpoint is read
/// once more (streamed with `options`, hashed with xxh64; checkpoint_content_digest in
/// load.hpp). Throws Error(kNotFound) naming the checkpoint when it has no config.json, and
/// what the read throws.
PeerServeInfo peer_serve_info(const Checkpoint& checkpoint, const Parallelism& parallel, Processing quantize,
                              const StreamOptions& options = {});

class PeerSource;

/// The same for a layout pulled from the peers of `source`: their config.json, tensors and
/// content digest (a puller serves in turn what it pulled; unknown content stays unknown).
PeerServeInfo peer_serve_info(const PeerSource& source, const Parallelism& parallel, Processing quantize);

/// What a PeerServer has done since it started, and what it publishes now
/// (PeerServer::stats): for monitoring (`serve --metrics-listen`, docs/METRICS.md).
struct PeerServeStats {
  uint64_t pullers_connected = 0;    ///< pullers past the handshake, connected now
  uint64_t pullers_accepted = 0;     ///< pullers that proved the token, since the start
  uint64_t manifests_sent = 0;       ///< manifests sent (one per accepted puller: a pull started)
  /// Pulls that read their bytes and asked, at their end, whether the version still holds.
  uint64_t pulls_completed = 0;
  uint64_t connections_refused = 0;  ///< connections refused or dropped, each logged on stderr
  /// Parameter bytes sent on pullers' requests (the rendezvous path, UcxPath::kRendezvous).
  /// A one-sided read (kRma) is the puller's alone: the server never sees it.
  uint64_t bytes_sent = 0;
  uint64_t parameters = 0;       ///< parameters published
  uint64_t parameter_bytes = 0;  ///< their bytes
  uint64_t version = 0;          ///< PeerServer::version()
  std::string content_digest;    ///< PeerServer::content_digest() (empty: unknown)
  bool updating = false;         ///< between begin_update() and end_update()
};

/// Publishes a loaded layout's parameters until destroyed. Every parameter is registered
/// with UCX for remote reads (ucp_mem_map; GPU memory as UCS_MEMORY_TYPE_CUDA) and hashed
/// (xxh64; GPU memory through bounded host copies) once; pullers connect to address(),
/// prove the token, receive the manifest and read the bytes (one-sided, or sent on request).
class PeerServer {
 public:
  /// Throws Error(kInvalidArgument) for an empty token without `open_without_token` or an
  /// info.content_digest neither empty nor 16 lowercase hex digits,
  /// Error(kUnsupported) for a build without UCX, or a layout on a GPU where UCX does
  /// not handle CUDA memory (not a CUDA-aware UCX),
  /// Error(kNetwork) when it cannot listen, Error(kModel) for a parameter without storage.
  PeerServer(const ModelLayout& layout, PeerServeInfo info, PeerServeOptions options);
  ~PeerServer();
  PeerServer(const PeerServer&) = delete;
  PeerServer& operator=(const PeerServer&) = delete;

  /// "HOST:PORT" pullers connect to.
  const std::string& address() const noexcept;
  /// The version now published.
  uint64_t version() const noexcept;
  /// The content digest now published (PeerManifest::content_digest; empty: unknown).
  std::string content_digest() const;
  /// Before the served parameters change (an update): pullers that ask for the version
  /// from now on see it change, so a pull that overlaps the update is refused.
  void begin_update();
  /// After they changed: digests are recomputed and a new version is published. From
  /// begin_update on, the content digest published is empty (unknown): what is served is no
  /// longer known to be the checkpoint's, and pullers of several peers refuse it
  /// (PeerSource).
  void end_update();
  /// Its counters and what it publishes now. Safe from any thread while it serves.
  PeerServeStats stats() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

/// Options of a pull.
struct PeerPullOptions {
  /// The serving peers' token, proven (after each peer has proven it), never sent. Empty:
  /// only an open server (PeerServeOptions::open_without_token) serves this puller.
  std::string token;
  /// How long a connect, a message or a read may go without progress before the pull fails.
  std::chrono::milliseconds timeout{30'000};
  /// The content digest (16 hex digits, content_digest in stream.hpp) every peer must
  /// publish; empty (the default): any, as long as all the peers publish the same known one
  /// (a single peer may publish unknown content).
  std::string expect_digest;
  /// Bounds the host staging of bytes that do not land in place (every byte of a reload or
  /// update, and parameters another layout holds differently): they are read in batches of
  /// whole layers into three buffers, each 32 MiB or the largest layer's bytes, but at most
  /// a third of this; a single serving parameter larger than that gets a buffer its size.
  /// The source keeps the buffers for its next pull.
  uint64_t memory_limit = 1ull << 30;
  /// How UCX moves the bytes from each peer (Options::ucx_path, WEIGHTSTREAM_UCX_PATH): by
  /// default one-sided reads where the endpoint's lanes carry RMA, the peer's tagged sends
  /// (rendezvous) where they do not (tcp).
  UcxPath ucx_path = UcxPath::kAuto;
  /// Test hook: once this many bytes from peers have landed, `on_pause` runs once on the
  /// pulling thread, so that a test can kill or freeze a serving peer mid-pull without
  /// timing: into host memory, in the middle of the next parameter of at least 16 digest
  /// pieces (its reads issued, one landed, the rest in flight); into GPU memory, before
  /// the next serving parameter is read. 0 (the default) never pauses.
  uint64_t pause_after_bytes = 0;
  std::function<void()> on_pause;
  /// With pause_after_bytes: false pauses host reads between two parameters instead, every
  /// read so far landed (a server destroyed in the pause on the pulling thread owes it nothing).
  bool pause_mid_parameter = true;
};

/// What a pull did.
struct PeerPullReport {
  uint64_t bytes_from_peers = 0;   ///< bytes read from serving peers
  uint64_t bytes_in_place = 0;     ///< of those, read straight into this layout's parameters
  uint64_t parameters_read = 0;    ///< serving parameters read (each checked against its digest)
  uint64_t tensors = 0;            ///< checkpoint tensors (or slices) handed to the session
  /// Host staging the source holds for bytes that do not land in place (every byte of a
  /// reload or update): its buffers, reused by every batch and by the source's next pulls.
  uint64_t staging_bytes = 0;
  double seconds = 0;
  double gbps() const noexcept { return seconds > 0 ? static_cast<double>(bytes_from_peers) / seconds / 1e9 : 0; }
};

/// Bytes a puller read from one serving peer.
struct PeerBytes {
  std::string address;     ///< the peer's "HOST:PORT" (PeerManifest::address)
  std::string transports;  ///< the lanes of this puller's UCX endpoint to it (PeerManifest::ucx_transports: "tcp/lo")
  uint64_t bytes = 0;      ///< bytes read from it, every pull of the source together
};

/// What a source's pulls did so far, failed pulls included (PeerSource::stats()).
struct PeerPullStats {
  std::vector<PeerBytes> peers;  ///< one per serving peer, in the order of the URI
  /// Parameters (or digest pieces of them) whose bytes did not match the manifest's digest:
  /// each fails its pull.
  uint64_t digest_failures = 0;
};

/// The serving ranks of one instance, connected: their manifests (checked to agree) and
/// UCX endpoints.
class PeerSource {
 public:
  /// Connects to every address of `uri` (peer://...), proves the token and fetches the
  /// manifests. Throws Error(kNetwork)/Error(kTimeout) naming the peer, Error(kPermission)
  /// when a peer cannot prove the token or refuses this puller's proof, Error(kInvalidArgument)
  /// for an expect_digest that is not 16 hex digits, and, before any endpoint or read:
  /// Error(kProtocol) naming every peer and its content digest when the peers' content
  /// digests differ or, of several peers, one's is unknown (updated), or when one's is not
  /// options.expect_digest; Error(kModel) naming both peers and the field
  /// when manifests disagree (checkpoint identity, model_type, dtype, quantization, tp/ep
  /// size, version) or two peers serve the same rank.
  PeerSource(std::string_view uri, PeerPullOptions options);
  ~PeerSource();
  PeerSource(PeerSource&&) noexcept;
  PeerSource& operator=(PeerSource&&) noexcept;

  const std::string& uri() const noexcept;
  const std::vector<PeerManifest>& manifests() const noexcept;
  /// The config.json the peers publish.
  const std::string& config_json() const noexcept;
  /// The checkpoint tensors, as the peers' checkpoint has them.
  const std::vector<PeerTensor>& tensors() const noexcept;
  /// The content digest every peer publishes (empty: unknown, from a single updated peer).
  const std::string& content_digest() const noexcept;

  /// Pulls every part of `session`'s layout into it (the session has begun, checkpoint
  /// format). Into a layout on a GPU, parameters land in place only where this process's
  /// UCX handles CUDA memory (each then checked against its digest through bounded host
  /// copies); otherwise every byte is staged in host memory and the session copies it.
  /// Throws Error(kModel) naming the tensor when no peer holds part of it or a peer holds it
  /// processed, Error(kProtocol) naming the parameter and the peer when a digest does not
  /// match, Error(kNetwork)/Error(kTimeout) naming the peer
  /// when it dies or stalls, Error(kProtocol) when a peer's version changed during the pull.
  PeerPullReport pull(LoadSession& session);

  /// Bytes read from each peer and digest failures of every pull so far, a failed one
  /// included (its bytes up to the failure). Call it on the pulling thread, between pulls.
  PeerPullStats stats() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace weightstream
