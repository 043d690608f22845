#pragma once
/// @file source.hpp
/// Where a layout's parameters come from: one Source per kind of URI (a checkpoint in storage:
/// a local path or file://, s3://, gs://, az://; the serving peers of a peer:// URI) and a
/// fallback that loads from one source and, when that fails, from another. open_source() is
/// the one place that tells the kinds apart: the command, the Python package and the engine
/// plugins ask it for a source and never look at a URI's scheme themselves.

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "weightstream/load.hpp"
#include "weightstream/options.hpp"
#include "weightstream/peer.hpp"

namespace weightstream {

/// The kinds of source.
enum class SourceKind {
  kFile,      ///< a local path or file://
  kS3,        ///< s3://
  kGcs,       ///< gs://
  kAzure,     ///< az:// or an Azure Blob https:// URL
  kHttp,      ///< another http(s):// URL
  kPeer,      ///< peer://HOST:PORT[,HOST:PORT...]: the ranks of a serving instance
  kFallback,  ///< one source, then another when it fails
};

/// "file", "s3", "gs", "az", "http", "peer", "fallback".
std::string_view source_kind_name(SourceKind kind) noexcept;

/// Whether a source of `kind` is a checkpoint in storage, whose files hold its tensors as
/// written (a plain tensor load, a digest, an export that reads them): false for peers,
/// which serve a layout's parameters, and for a fallback.
bool source_is_checkpoint(SourceKind kind) noexcept;

/// The kind of source `uri` names, without opening it. Throws Error(kInvalidArgument) for an
/// empty or malformed URI (parse_uri, peer_addresses).
SourceKind source_kind(std::string_view uri);

/// What every kind of source takes; each reads its own fields.
struct SourceOptions {
  /// Storage, stream and UCX options (checkpoints; the peers' memory limit and UCX path are
  /// `peer`'s own).
  Options options;
  /// Peers: token, timeout, staging limit, the content digest they must serve.
  PeerPullOptions peer;
  /// A storage URI loaded when the peers fail (open_source of a peer:// URI); empty: none.
  std::string fallback;
};

/// The options of a source from `options`: the peers' token (options.peer_token), staging
/// limit (options.stream.memory_limit) and UCX path (options.ucx_path), no fallback.
SourceOptions source_options(const Options& options);

/// What a load from a source did.
struct SourceLoad {
  std::string uri;                      ///< the source that loaded (a fallback's second, when it did)
  SourceKind kind = SourceKind::kFile;  ///< its kind
  StreamStats stream;                   ///< a checkpoint's stream; zero from peers
  StorageStats storage;                 ///< a checkpoint's storage requests since it was opened
  LoadCounters counters;                ///< the session's counters
  PeerPullReport pull;                  ///< a pull's report; zero from a checkpoint
  std::vector<PeerManifest> manifests;  ///< the peers pulled from
  PeerPullStats peers;                  ///< bytes from each peer and digest failures, a failed pull's too
  std::string failure;                  ///< why a fallback's first source failed, when its second loaded
};

/// A layout built from a source and cold-loaded from it (Source::load_new).
struct SourceLayout {
  ModelLayout layout;
  SourceLoad load;
};

/// A place to load a layout from. Opened at its first use: a fallback's second source is
/// never touched while the first serves.
class Source {
 public:
  virtual ~Source() = default;
  virtual SourceKind kind() const noexcept = 0;
  /// The URI it was opened from (a checkpoint's as Checkpoint::uri() gives it, once opened).
  virtual std::string uri() const = 0;
  /// The model's config.json text. Throws Error(kNotFound) naming the source when it has none.
  virtual std::string config_json() = 0;
  /// engine_layout of the source's config.json, checked against its tensors. Throws what
  /// opening the source or building the layout throws.
  virtual ModelLayout layout(const EngineLayoutOptions& options) = 0;
  /// layout(), cold-loaded from this source in one session.
  virtual SourceLayout load_new(const EngineLayoutOptions& options, const ProgressCallback& progress = {});
  /// Loads `layout` (built before: a reload, or an engine's bound layout) in one session of
  /// `mode`. Throws what the load throws.
  virtual SourceLoad load(ModelLayout& layout, LoadMode mode, const ProgressCallback& progress = {}) = 0;
  /// Streams or pulls `session`'s layout into it (the session has begun; the caller finishes
  /// it): one load among the caller's batches.
  virtual SourceLoad load_into(LoadSession& session, const ProgressCallback& progress = {}) = 0;
  /// What a PeerServer publishing a layout of `parallel` loaded from this source announces
  /// (peer_serve_info of the checkpoint or of the peers).
  virtual PeerServeInfo serve_info(const Parallelism& parallel, Processing quantize) = 0;
  /// Bytes from each peer and digest failures of every pull so far, a failed one included;
  /// empty for a checkpoint.
  virtual PeerPullStats peer_stats() const { return {}; }
  /// Lets go of what it holds open (connections, staging); the next use opens it again.
  virtual void close() {}
};

/// The source `uri` names: a checkpoint (file, s3, gs, az, http) or the serving peers of a
/// peer:// URI, wrapped with options.fallback (a fallback_source) when that is given.
/// Nothing is opened yet. Throws Error(kInvalidArgument) for a malformed URI, or a fallback
/// given with a source that is not peers, or a fallback that is itself peers.
std::unique_ptr<Source> open_source(std::string_view uri, const SourceOptions& options);

/// A source that loads from `first` and, when that fails (any error but
/// Error(kInvalidArgument), which names a mistake of the caller's), from `second`: a fresh
/// layout for load_new (nothing of the failed load is kept), the same layout for load. It
/// writes "weightstream: peers failed (WHY); loading from URI" to stderr before it does.
/// Throws Error naming both sources and both causes when neither loads.
std::unique_ptr<Source> fallback_source(std::unique_ptr<Source> first, std::unique_ptr<Source> second);

}  // namespace weightstream
