// The one function that tells the kinds of URI apart, and the checkpoint source: a checkpoint
// in storage (local files, S3, GCS, Azure Blob, HTTP), opened at its first use.
#include <optional>

#include "source/sources.hpp"
#include "weightstream/error.hpp"
#include "weightstream/storage.hpp"

namespace weightstream {
namespace {

class CheckpointSource final : public Source {
 public:
  CheckpointSource(std::string uri, SourceKind kind, Options options)
      : uri_(std::move(uri)), kind_(kind), options_(std::move(options)) {}

  SourceKind kind() const noexcept override { return kind_; }
  std::string uri() const override { return checkpoint_ ? checkpoint_->uri() : uri_; }

  std::string config_json() override {
    const Checkpoint& opened = checkpoint();
    WS_EXPECT(opened.config_json().has_value(), ErrorCode::kNotFound,
              opened.uri() + " has no config.json beside its shards");
    return *opened.config_json();
  }

  ModelLayout layout(const EngineLayoutOptions& options) override { return engine_layout(checkpoint(), options); }

  SourceLoad load(ModelLayout& layout, LoadMode mode, const ProgressCallback& progress) override {
    LayoutLoad loaded = load_layout(layout, checkpoint(), mode, options_.stream, progress);
    SourceLoad result = described();
    result.stream = loaded.stream;
    result.counters = loaded.counters;
    result.storage = checkpoint_->storage().stats();
    return result;
  }

  SourceLoad load_into(LoadSession& session, const ProgressCallback& progress) override {
    LoadPlan plan = plan_layout_load(session.layout(), checkpoint());
    SourceLoad result = described();
    result.stream = stream_into_session(checkpoint(), plan, session, options_.stream, progress);
    result.storage = checkpoint_->storage().stats();
    return result;
  }

  PeerServeInfo serve_info(const Parallelism& parallel, Processing quantize) override {
    return peer_serve_info(checkpoint(), parallel, quantize, options_.stream);
  }

 private:
  const Checkpoint& checkpoint() {
    if (!checkpoint_) checkpoint_.emplace(Checkpoint::open(uri_, options_));
    return *checkpoint_;
  }
  SourceLoad described() const {
    SourceLoad result;
    result.uri = uri();
    result.kind = kind_;
    return result;
  }

  std::string uri_;
  SourceKind kind_;
  Options options_;
  std::optional<Checkpoint> checkpoint_;
};

}  // namespace

SourceLayout Source::load_new(const EngineLayoutOptions& options, const ProgressCallback& progress) {
  SourceLayout result{layout(options), {}};
  result.load = load(result.layout, LoadMode::kCold, progress);
  return result;
}

std::string_view source_kind_name(SourceKind kind) noexcept {
  switch (kind) {
    case SourceKind::kFile: return "file";
    case SourceKind::kS3: return "s3";
    case SourceKind::kGcs: return "gs";
    case SourceKind::kAzure: return "az";
    case SourceKind::kHttp: return "http";
    case SourceKind::kPeer: return "peer";
    case SourceKind::kFallback: return "fallback";
  }
  return "unknown";
}

bool source_is_checkpoint(SourceKind kind) noexcept {
  return kind != SourceKind::kPeer && kind != SourceKind::kFallback;
}

SourceKind source_kind(std::string_view uri) {
  if (is_peer_uri(uri)) {
    peer_addresses(uri);  // throws naming a malformed address
    return SourceKind::kPeer;
  }
  switch (parse_uri(uri).scheme) {
    case Uri::Scheme::kFile: return SourceKind::kFile;
    case Uri::Scheme::kS3: return SourceKind::kS3;
    case Uri::Scheme::kGcs: return SourceKind::kGcs;
    case Uri::Scheme::kAzure: return SourceKind::kAzure;
    case Uri::Scheme::kHttp: return SourceKind::kHttp;
  }
  return SourceKind::kFile;
}

SourceOptions source_options(const Options& options) {
  SourceOptions result;
  result.options = options;
  result.peer.token = options.peer_token;
  result.peer.memory_limit = options.stream.memory_limit;
  result.peer.ucx_path = options.ucx_path;
  return result;
}

std::unique_ptr<Source> open_source(std::string_view uri, const SourceOptions& options) {
  const SourceKind kind = source_kind(uri);
  std::unique_ptr<Source> source = kind == SourceKind::kPeer
                                       ? peers_source(std::string(uri), options.peer)
                                       : std::make_unique<CheckpointSource>(std::string(uri), kind, options.options);
  if (options.fallback.empty()) return source;
  WS_EXPECT(kind == SourceKind::kPeer, ErrorCode::kInvalidArgument,
            "a storage fallback is for a source of peers; " + std::string(uri) + " is a checkpoint");
  const SourceKind second = source_kind(options.fallback);
  WS_EXPECT(second != SourceKind::kPeer, ErrorCode::kInvalidArgument,
            "the fallback of " + std::string(uri) + " is storage (a directory, file://, s3://, gs://, az://), not " +
                options.fallback);
  SourceOptions storage = options;
  storage.fallback.clear();
  return fallback_source(std::move(source), open_source(options.fallback, storage));
}

}  // namespace weightstream
