// The source of a peer:// URI: the ranks of a serving instance, connected at the first use,
// whose published config.json and tensors build the layout their parameters are pulled into.
#include <optional>

#include "source/sources.hpp"
#include "weightstream/error.hpp"

namespace weightstream {
namespace {

class PeersSource final : public Source {
 public:
  PeersSource(std::string uri, PeerPullOptions options) : uri_(std::move(uri)), options_(std::move(options)) {}

  SourceKind kind() const noexcept override { return SourceKind::kPeer; }
  std::string uri() const override { return uri_; }
  std::string config_json() override { return peers().config_json(); }

  ModelLayout layout(const EngineLayoutOptions& options) override {
    PeerSource& source = peers();
    const std::string object = uri_ + " (config.json published by the peer)";
    std::vector<std::string_view> names;
    for (const PeerTensor& tensor : source.tensors()) names.push_back(tensor.name);
    return engine_layout(parse_model_config(object, source.config_json()), object, names, options);
  }

  SourceLoad load(ModelLayout& layout, LoadMode mode, const ProgressCallback& progress) override {
    LoadSession session(layout);
    session.begin(mode);
    SourceLoad result = load_into(session, progress);
    session.finish();
    result.counters = session.counters();
    return result;
  }

  SourceLoad load_into(LoadSession& session, const ProgressCallback&) override {
    PeerSource& source = peers();  // a pull reports no progress
    SourceLoad result;
    result.uri = uri_;
    result.kind = SourceKind::kPeer;
    result.pull = source.pull(session);
    result.manifests = source.manifests();
    result.peers = source.stats();
    return result;
  }

  PeerServeInfo serve_info(const Parallelism& parallel, Processing quantize) override {
    return peer_serve_info(peers(), parallel, quantize);
  }

  PeerPullStats peer_stats() const override { return source_ ? source_->stats() : last_stats_; }

  void close() override {
    if (!source_) return;
    last_stats_ = source_->stats();
    source_.reset();
  }

 private:
  PeerSource& peers() {
    if (!source_) source_.emplace(uri_, options_);
    return *source_;
  }

  std::string uri_;
  PeerPullOptions options_;
  std::optional<PeerSource> source_;
  PeerPullStats last_stats_;
};

}  // namespace

std::unique_ptr<Source> peers_source(std::string uri, PeerPullOptions options) {
  return std::make_unique<PeersSource>(std::move(uri), std::move(options));
}

}  // namespace weightstream
