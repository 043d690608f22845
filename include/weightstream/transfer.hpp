#pragma once
/// @file transfer.hpp
/// The transfer layer: weight updates pushed by a trainer into a live model. An
/// `UpdateSender` packs named tensors into buckets (one packed buffer plus a manifest of
/// names, dtypes, shapes and offsets) and moves them through a transport; an
/// `UpdateReceiver` checks every manifest against its `ModelLayout` and applies the bytes
/// through a `LoadSession` in update mode. Two bucket buffers alternate: the sender fills
/// one while the receiver applies the other.
///
/// Phases on the wire: connect (both sides prove the shared token, which is never sent), start (checkpoint or engine
/// format, and the manifest of every tensor the update sends, checked whole by each receiver
/// before any bucket), any number of buckets, finish (the model hooks run once). A layer's tensors are
/// written into its parameters only when every tensor of the layer has arrived (or at
/// finish, for a layer the update covers in part): when the sender disappears mid-update,
/// layers not completed keep their old values, and a plain reload restores a consistent
/// model. Uses the model, device and format layers only.

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "weightstream/device.hpp"
#include "weightstream/format.hpp"
#include "weightstream/model.hpp"
#include "weightstream/options.hpp"

namespace weightstream {

/// How bucket bytes travel from sender to receiver. Control messages always go over a
/// socket: a Unix socket for the same-host transports, TCP otherwise.
enum class TransportKind : uint8_t {
  kShm = 1,      ///< same host, host memory: two memfd buckets mapped by both sides, Unix-socket control
  kTcp = 2,      ///< any host: bucket bytes follow their manifest on the TCP connection
  kCudaIpc = 3,  ///< same host, GPU: two device buckets exported once at connect (cudaIpcGetMemHandle)
  kNccl = 4,     ///< across GPUs and hosts: ncclBroadcast from the sender's bucket, TCP control
  kUcx = 5,      ///< across hosts, host memory: the sender moves each bucket over UCX into each receiver's
                 ///< registered buckets (ucp_put where the lanes carry RMA, RDMA; rendezvous active messages
                 ///< where they do not, tcp; SenderOptions::ucx_path), TCP control
};

/// "shm", "tcp", "cuda-ipc", "nccl", "ucx".
std::string_view transport_name(TransportKind kind) noexcept;
/// Parses a transport name. Throws Error(kInvalidArgument) listing the accepted names.
TransportKind parse_transport(std::string_view text);
/// True when this build can use `kind` (CUDA IPC needs CUDA, NCCL needs NCCL, ucx needs UCX compiled in).
bool transport_compiled(TransportKind kind) noexcept;

/// Default bucket size: large enough that the fixed cost per bucket (one round trip) is
/// small against its copy, small enough that two of them fit beside a model.
inline constexpr uint64_t kDefaultBucketBytes = 256ull << 20;

/// Smallest bucket a sender accepts (SenderOptions::bucket_bytes).
inline constexpr uint64_t kMinBucketBytes = 4096;

/// Smallest sender allocation shared in place over CUDA IPC (SenderOptions).
inline constexpr uint64_t kDefaultShareMinimumBytes = 256ull << 20;

/// Default of SenderOptions::delta_dense_fraction.
inline constexpr double kDefaultDeltaDenseFraction = 0.25;

/// The one rule of every listener (UpdateReceiver, PeerServer): it starts only with a
/// non-empty token, or with `open_without_token` asked for explicitly, never both. `listener`
/// names it in the message ("peer server on 10.0.0.5:7000"). Throws Error(kInvalidArgument)
/// otherwise. The listeners apply it themselves when they start (and warn once on stderr
/// when open); a command calls it too to refuse before a long load.
void require_listener_token(const std::string& token, bool open_without_token, const std::string& listener);

/// Options of the receiving side.
struct ReceiverOptions {
  TransportKind transport = TransportKind::kTcp;
  /// Where to listen. TCP and NCCL: "HOST:PORT" (default "127.0.0.1:0", a free loopback
  /// port; a non-loopback host must be given explicitly). shm and CUDA IPC: a Unix socket
  /// path (default: a fresh one in `socket_directory`), created mode 0600, removed on
  /// destruction and when SIGTERM ends the process; a stale socket file nobody listens on
  /// is replaced, a live one or another kind of file is Error(kNetwork).
  std::string listen;
  /// Shared token a sender must prove it knows (a mutual challenge-response: the token never
  /// crosses the wire). Required: a receiver with an empty token refuses to start
  /// (Error(kInvalidArgument)) unless `open_without_token` is set.
  std::string token;
  /// Accept any sender, with no token: only the loopback or Unix-socket binding then
  /// protects the receiver. Must be asked for in so many words; warned about on stderr once,
  /// when the receiver starts. Set together with a token, Error(kInvalidArgument).
  bool open_without_token = false;
  /// Largest bucket a sender may ask for (the receiver allocates two of them).
  uint64_t max_bucket_bytes = 4ull << 30;
  /// How long to wait for the next message of a connected sender before the update fails.
  std::chrono::milliseconds timeout{30'000};
  /// How long a peer that connected has for its whole handshake and HELLO (one deadline,
  /// not one per byte). Peers are heard concurrently, so one that connects and stays silent
  /// or trickles delays no other; it is dropped after this long.
  std::chrono::milliseconds handshake_timeout{3'000};
  /// shm and CUDA IPC with an empty `listen`: the directory of the fresh socket. Empty: the
  /// one Options::temporary_directory names (TMPDIR, default /tmp).
  std::string socket_directory;
  /// Where CUDA IPC and NCCL buckets live (the model's GPU); ignored by shm and TCP.
  Device device;
};

/// Options of the sending side.
struct SenderOptions {
  TransportKind transport = TransportKind::kTcp;
  /// Token the receiver expects; proven, never sent. Empty: only an open receiver
  /// (ReceiverOptions::open_without_token) accepts this sender.
  std::string token;
  /// Bytes per bucket; a tensor larger than a bucket travels in pieces over several.
  uint64_t bucket_bytes = kDefaultBucketBytes;
  /// How long to wait for the receiver (connect, a free bucket, the final result).
  std::chrono::milliseconds timeout{30'000};
  /// Where the sender's CUDA IPC / NCCL bucket staging lives; ignored by shm and TCP.
  Device device;
  /// CUDA IPC: tensors in an allocation of `device` at least `share_minimum_bytes` large
  /// are not copied into buckets; the receiver opens the allocation the first time an update
  /// announces it, keeps it open while later updates of the connection announce it again,
  /// and reads the tensors in place (one copy per byte instead of two). Opening one costs as
  /// much as copying a few hundred MB once (bench/HISTORY.md), paid on the first update;
  /// the default shares only large allocations (flat buffers, allocator segments).
  bool share_allocations = true;
  uint64_t share_minimum_bytes = kDefaultShareMinimumBytes;
  /// ucx: how bucket bytes travel to each receiver (Options::ucx_path, WEIGHTSTREAM_UCX_PATH):
  /// by default one-sided puts where the endpoint's lanes carry RMA, active messages
  /// (rendezvous) where they do not (tcp).
  UcxPath ucx_path = UcxPath::kAuto;
  /// Delta updates (UpdateSender::send_changes): a tensor whose changed elements would take
  /// more than this fraction of its dense bytes (or more than a bucket) is sent whole.
  double delta_dense_fraction = kDefaultDeltaDenseFraction;
  /// Delta updates: threads that compare a large tensor (16 MiB and more) with its base, range
  /// by range; 0: one per core.
  unsigned delta_threads = 0;
};

/// The versions an update names, as content digests (16 lowercase hex digits, what
/// `weightstream digest` prints; at most kMaxVersionBytes). docs/DELTA.md.
struct UpdateVersions {
  /// The version the update applies to. Set: a delta update (checkpoint format, host
  /// transports), refused before its first byte by a receiver that holds another version or
  /// an unknown one. Empty: a full update.
  std::string base;
  /// The version the receiver holds once the update has landed; empty: unknown.
  std::string target;
};

/// Longest version an update may name.
inline constexpr size_t kMaxVersionBytes = 128;

/// What an update did, reported by the receiver (and echoed to the sender).
/// Where the receiver's time in one update went, in seconds; together they make up about
/// UpdateReport::seconds. `waiting` large: the sender (or the link) is the bottleneck;
/// `copying` large: the GPU's copies are; `checking` large: host work per tensor is.
struct UpdatePhases {
  double preparing = 0;     ///< the session's begin() and the update's bookkeeping, before any bucket
  double first_bucket = 0;  ///< from START until the first bucket's manifest had arrived and been decoded (counted in `preparing`, `checking` (the update's manifest, and ACCEPTED), `waiting` and `parsing`)
  double waiting = 0;       ///< for the sender: manifests and payload bytes in transit
  double parsing = 0;       ///< decoding manifests
  double opening = 0;       ///< opening the sender's shared regions (CUDA IPC)
  double checking = 0;      ///< checking entries against the layout and issuing their copies
  double copying = 0;       ///< waiting for copies to land (before a buffer is refilled, and at the end)
  double finishing = 0;     ///< the session's finish(): completeness, layer processing, model hooks
  double verifying = 0;     ///< a delta's check of what the receiver holds against the sender's digests
  double closing = 0;       ///< closing shared regions the update no longer needs
};

/// Every phase and its name, in one order: the wire, the Python report and the benchmark
/// list them from here.
inline constexpr std::array<std::pair<const char*, double UpdatePhases::*>, 10> kUpdatePhases = {{
    {"preparing", &UpdatePhases::preparing},
    {"first_bucket", &UpdatePhases::first_bucket},
    {"waiting", &UpdatePhases::waiting},
    {"parsing", &UpdatePhases::parsing},
    {"opening", &UpdatePhases::opening},
    {"checking", &UpdatePhases::checking},
    {"copying", &UpdatePhases::copying},
    {"finishing", &UpdatePhases::finishing},
    {"verifying", &UpdatePhases::verifying},
    {"closing", &UpdatePhases::closing},
}};

struct UpdateReport {
  TensorFormat format = TensorFormat::kCheckpoint;
  uint64_t buckets = 0;
  uint64_t tensors = 0;      ///< distinct tensors received whole
  uint64_t bytes = 0;        ///< bucket bytes received
  uint64_t shared_bytes = 0; ///< bytes read in place from the sender's shared regions (CUDA IPC)
  /// Bucket bytes that landed straight in their parameters (ucx's messages), not copied
  /// there out of the receiver's buffer.
  uint64_t placed_bytes = 0;
  uint64_t regions = 0;      ///< shared regions opened
  double seconds = 0;        ///< from START to the end of finish()
  /// Set-up of the connection (buffers allocated, exported and opened; NCCL joined), for
  /// the first update of a connection; 0 for the updates after it.
  double connect_seconds = 0;
  /// Tensors that arrived as changed elements (a delta update), and those that arrived whole.
  uint64_t sparse_tensors = 0;
  uint64_t dense_tensors = 0;
  /// Tensors of a delta whose elements this receiver holds were checked, after the update
  /// landed, against the sender's digest of them in the target version (docs/DELTA.md).
  uint64_t checked_tensors = 0;
  LoadCounters counters;     ///< of the receiver's LoadSession
  UpdatePhases phases;       ///< where the receiver's `seconds` went
  std::vector<int64_t> completed_layers;
  /// Tensor bytes moved (through buckets and in place) per second of the update.
  double gbps() const noexcept {
    return seconds > 0 ? static_cast<double>(bytes + shared_bytes) / seconds / 1e9 : 0;
  }
};

/// One tensor an update declares before its first bucket: its name, dtype and shape (whole,
/// however it then travels in pieces).
struct DeclaredTensor {
  std::string name;
  Dtype dtype = Dtype::kBF16;
  std::vector<int64_t> shape;
};

/// The manifest of `tensors`: each name once, in the order of first appearance (the pieces
/// of one tensor declare it once). Throws Error(kInvalidArgument) when two views of one name
/// disagree on dtype or shape.
std::vector<DeclaredTensor> declared_tensors(std::span<const TensorView> tensors);

/// What an UpdateReceiver has done since it was made (UpdateReceiver::stats): for
/// monitoring (`audit --via --metrics-listen`, docs/METRICS.md).
struct ReceiverStats {
  uint64_t connections_refused = 0;  ///< peers refused or dropped before an update (each logged on stderr)
  uint64_t senders_accepted = 0;     ///< senders that proved the token and were welcomed
  uint64_t updates_started = 0;      ///< updates whose START arrived
  uint64_t updates_completed = 0;    ///< of those, applied whole
  uint64_t updates_failed = 0;       ///< of those, failed, cancelled or refused (refuse())
  bool updating = false;             ///< an update is under way: its START arrived, it has not ended
};

/// Receives updates into a layout. Listens when constructed; each receive() applies one
/// update (start, buckets, finish) through a LoadSession in update mode, accepting a sender
/// first when none is connected. A sender stays connected between its updates (connect
/// once, update every few minutes); when it leaves, the next receive() accepts the next
/// one. The layout must have been loaded before (update mode requires it). Errors name the
/// peer, the bucket, the tensor and the cause; a failed update leaves layers it did not
/// complete as they were, lists those it did, and drops the connection.
class UpdateReceiver {
 public:
  /// Binds the listener (loopback by default). Throws Error(kInvalidArgument) for an empty
  /// token without `open_without_token`, Error(kNetwork) naming the address,
  /// Error(kUnsupported) when the build lacks the transport.
  UpdateReceiver(ModelLayout& layout, ReceiverOptions options);
  ~UpdateReceiver();
  UpdateReceiver(const UpdateReceiver&) = delete;
  UpdateReceiver& operator=(const UpdateReceiver&) = delete;

  /// The address a sender connects to: "HOST:PORT" or a Unix socket path.
  const std::string& address() const noexcept;
  /// Runs the next update to its end, waiting at most `accept_timeout` for it to start (and
  /// for a sender to connect, when none is). Peers that connect are heard concurrently (at
  /// most 64 mid-handshake; one more evicts the oldest): one silent for the options'
  /// handshake_timeout, one that cannot prove the token, speaks another protocol or version,
  /// or sends a HELLO this receiver refuses (another transport, too large a bucket) is told
  /// why where it can be, logged once on stderr ("weightstream: refused a connection from
  /// ADDR ..."), and dropped; the call goes on waiting for the next sender. Throws
  /// Error(kTimeout) when none came within `accept_timeout` (counting those dropped, with
  /// the last refusal's reason), Error(kTimeout) when a connected sender goes
  /// silent for longer than the options' timeout, Error(kNetwork) when it disconnects,
  /// Error(kModel) when a manifest does not fit the layout; each names the last bucket.
  ///
  /// An update's manifest (every tensor it will send, declared at START) is checked whole
  /// against the layout before its first bucket: names the layout does not know, shapes
  /// and dtypes it cannot take, tensors declared twice, and FP8 block-scaled weights whose
  /// codes and block scales are not declared together (a BF16, F16 or F32 weight, quantized
  /// here, comes without them). A refused manifest writes nothing; its reason (every
  /// problem, the first 20 with a count beyond) goes back to the sender, and this call throws
  /// Error(kModel) with it. A bucket entry the manifest does not declare, or declares with
  /// another dtype or shape, fails the update as Error(kProtocol); FINISH before every
  /// declared tensor has arrived whole fails it by name (Error(kModel)) before the layers
  /// still held are written.
  UpdateReport receive(std::chrono::milliseconds accept_timeout = std::chrono::minutes(10));

  /// Refuses the next update without applying anything: waits for a sender and its START
  /// as receive() does, answers it with `reason` (the sender's start() throws it), drops the
  /// connection and always throws: Error(kModel) naming the peer and `reason`. For a check only the
  /// engine can make (it replaced a parameter the layout is bound to): the sender learns
  /// why instead of timing out. Throws what receive() throws while waiting.
  void refuse(const std::string& reason, std::chrono::milliseconds accept_timeout = std::chrono::minutes(10));

  /// Stops receive(): waiting for a sender or for its next update, it throws
  /// Error(kCancelled) at once; in the middle of an update, the connection is shut down and
  /// the update fails as a vanished sender's would (layers not completed keep their old
  /// values), with Error(kCancelled). Every receive() after this call throws it too. Safe to
  /// call from any other thread while receive() runs: an engine shutting down calls it, or a
  /// supervisor whose sender process ended. The receiver must outlive the call.
  void cancel() noexcept;

  /// Its counters. Safe from any thread while it receives.
  ReceiverStats stats() const noexcept;
  /// Declares the version the layout holds (its checkpoint's content digest, after a load):
  /// the base a delta update must name. Each update that lands replaces it with the version
  /// it names as its target (unknown when it names none); a failed update makes it unknown.
  /// Empty: unknown, and every delta update is refused. Call it between updates only.
  void set_version(std::string content_digest);
  /// The version the layout holds, as set_version() and the updates left it; empty: unknown.
  std::string version() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

/// Sends updates to a receiver over one connection. Usage: UpdateSender(address, options)
/// once; then for each update start(format, manifest), send(tensor) for every declared
/// tensor, finish().
/// After an error the sender is unusable: make a new one. Not thread-safe: one thread sends.
class UpdateSender {
 public:
  /// Connects to `address` ("HOST:PORT" or a Unix socket path), proves the token (after the
  /// receiver has proven it) and sets up the transport (maps the shared buckets, opens the
  /// CUDA IPC handles once, joins the NCCL communicator). Throws Error(kNetwork) when it
  /// cannot connect, Error(kPermission) when the receiver cannot prove the token (nothing
  /// derived from the token is sent then) or refuses this sender's proof, Error(kProtocol)
  /// when the receiver refuses otherwise (its reason is in the message).
  UpdateSender(const std::string& address, SenderOptions options);
  /// Feeds several receivers at once (the tensor-parallel ranks of one engine, every
  /// replica): each update goes to all of them, over NCCL as one broadcast of each bucket
  /// (one communicator of the sender and every receiver) or over TCP as one stream each.
  /// A bucket buffer is refilled once every receiver has applied it; finish() returns the
  /// report of the slowest receiver; a failure at any receiver fails the update. Throws
  /// Error(kInvalidArgument) for no address or for shm and cuda-ipc (one receiver each),
  /// and what the single-address constructor throws, naming the receiver.
  UpdateSender(const std::vector<std::string>& addresses, SenderOptions options);
  ~UpdateSender();
  UpdateSender(const UpdateSender&) = delete;
  UpdateSender& operator=(const UpdateSender&) = delete;

  /// Starts an update: checkpoint-format names (mapped and reprocessed by the receiver's
  /// layout) or engine-format names (parameters, bytes copied in place), declaring every
  /// tensor it will send (`manifest`; declared_tensors() makes one from views). Each
  /// receiver checks the manifest against its model before any bucket and answers; the call
  /// returns once every receiver has accepted it. Throws Error(kInvalidArgument) while an
  /// update is open, and for a manifest with an empty, overlong or repeated name, more than
  /// kMaxTensorRank dimensions, a shape without a valid byte size, or too many tensors for one message;
  /// a receiver's refusal as its error code with its reason ("update receiver at ADDR refused
  /// the update: ..."), nothing of the update applied.
  ///
  /// With `versions.base` set, a delta update (docs/DELTA.md): checkpoint format only, tensors
  /// sent with send_changes() (or send(), whole); each receiver refuses it before its first
  /// byte unless it holds that version. Throws Error(kInvalidArgument) for a delta in engine
  /// format, or a version longer than kMaxVersionBytes.
  void start(TensorFormat format, std::span<const DeclaredTensor> manifest, const UpdateVersions& versions = {});
  /// In a delta update: sends `tensor` (whole, on the host) as its elements that differ from
  /// `base` (the same tensor as the receiver holds it: same dtype and shape, on the host), or
  /// whole, as send() does, when that encoding would take more than
  /// SenderOptions::delta_dense_fraction of its bytes or more than a bucket. Returns true when
  /// it went as changed elements. Throws send()'s errors, and Error(kInvalidArgument) outside a
  /// delta update, for a piece or device memory, or a base of another dtype, shape or size.
  bool send_changes(const TensorView& base, const TensorView& tensor);
  /// send_changes() of many tensors: `bases[i]` is the base of `tensors[i]`. Their comparisons
  /// run at once on up to SenderOptions::delta_threads threads (a model's small tensors
  /// together), and they are queued in the order given. Every tensor is checked before any is
  /// sent; throws send_changes()'s errors, and Error(kInvalidArgument) for spans of different
  /// lengths or a tensor given twice. Returns how many went as changed elements.
  uint64_t send_changes(std::span<const TensorView> bases, std::span<const TensorView> tensors);
  /// In a delta update of an FP8 block-scaled model: quantizes `tensor` (a BF16, F16 or F32
  /// weight on the host, viewed as [shape[0], the rest]) by the checkpoint's rule
  /// (quantize_fp8_blocks) in blocks of `block`, and sends its codes as the changes since
  /// `base_codes` (F8_E4M3, the weight's shape, named as `tensor`) and its block scales as the
  /// changes since `base_scales` (F32 [ceil(rows / block rows), ceil(columns / block columns)]),
  /// each declared so in the manifest, as send_changes() does: a change that moves no code and no
  /// scale sends nothing. Returns how many of the two went as changed elements. Throws
  /// send_changes()'s errors, and Error(kInvalidArgument) for bases of other names, dtypes or shapes.
  uint64_t send_quantized_changes(const TensorView& base_codes, const TensorView& base_scales, const TensorView& tensor,
                                  std::array<int64_t, 2> block = {128, 128});
  /// Queues a tensor, or one piece of it (view.offset, view.bytes), packing it into the
  /// current bucket; a full bucket is sent, and the call waits only when both buckets are
  /// in flight. Pieces of one tensor must come in order. Host bytes are copied before the
  /// call returns; device bytes (CUDA IPC, NCCL) are copied when their bucket is sealed, or
  /// read in place by the receiver (CUDA IPC, large allocations: SenderOptions), so a
  /// device tensor must stay allocated and unchanged until finish() returns (a trainer's
  /// parameters do). Work queued on the device before a bucket is sealed is waited for, so
  /// a tensor computed on any stream just before send() goes complete. Throws
  /// Error(kInvalidArgument), before anything of the tensor is sent, when the manifest
  /// does not declare it, declares another dtype or shape, it was sent whole already, or
  /// the piece does not start where the last one ended; the receiver's error when it
  /// rejected an earlier bucket.
  void send(const TensorView& tensor);
  /// Sends the current bucket now, even if it is not full (a trainer that sends layer by
  /// layer flushes at each layer's end, so no bucket mixes two layers).
  void flush();
  /// Sends the last bucket and the finish message, and waits for the receiver's report
  /// (its model hooks have run once when this returns). The next update may start. Throws
  /// Error(kInvalidArgument) naming the declared tensors not sent whole (the receivers are
  /// told the update is abandoned, and keep the layers it did not complete; the sender is
  /// unusable after it).
  UpdateReport finish();

  /// Buckets sent so far in this update.
  uint64_t buckets_sent() const noexcept;

  /// How the bytes travel to each receiver, in the order of the addresses, where the
  /// transport chooses per receiver: over ucx "rendezvous (tcp/eth0)" or "rma (rc_mlx5/mlx5_0:1)"
  /// (SenderOptions::ucx_path); empty for the other transports.
  std::vector<std::string> paths() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace weightstream
