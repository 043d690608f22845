// The one fallback: a source that loads from its first source and, when that fails, from its
// second (the command's --fallback, the engine plugins' model sources behind peers).
#include <cstdio>
#include <type_traits>

#include "weightstream/error.hpp"
#include "weightstream/source.hpp"

namespace weightstream {
namespace {

class FallbackSource final : public Source {
 public:
  FallbackSource(std::unique_ptr<Source> first, std::unique_ptr<Source> second)
      : first_(std::move(first)), second_(std::move(second)) {}

  SourceKind kind() const noexcept override { return SourceKind::kFallback; }
  std::string uri() const override { return first_->uri(); }

  std::string config_json() override {
    return attempt([&](Source& source) { return source.config_json(); });
  }

  ModelLayout layout(const EngineLayoutOptions& options) override {
    return attempt([&](Source& source) { return source.layout(options); });
  }

  SourceLayout load_new(const EngineLayoutOptions& options, const ProgressCallback& progress) override {
    // Nothing of a failed load is kept: the second source builds a fresh layout.
    return with_failure(attempt([&](Source& source) { return source.load_new(options, progress); }));
  }

  SourceLoad load(ModelLayout& layout, LoadMode mode, const ProgressCallback& progress) override {
    return with_failure(
        attempt([&](Source& source) { return source.load(layout, mode, progress); }, layout.description()));
  }

  SourceLoad load_into(LoadSession& session, const ProgressCallback& progress) override {
    return with_failure(attempt([&](Source& source) { return source.load_into(session, progress); },
                                session.layout().description()));
  }

  PeerServeInfo serve_info(const Parallelism& parallel, Processing quantize) override {
    return attempt([&](Source& source) { return source.serve_info(parallel, quantize); });
  }

  PeerPullStats peer_stats() const override { return first_->peer_stats(); }

  void close() override {
    first_->close();
    second_->close();
  }

 private:
  /// `run` on the first source, else, after a failure that is not the caller's mistake, on
  /// the second; the error names both when neither serves, and `what` (a layout) if given.
  template <typename Run>
  std::invoke_result_t<Run, Source&> attempt(Run run, const std::string& what = "") {
    const std::string loading = "cannot load " + (what.empty() ? std::string() : what + " ");
    failure_.clear();
    try {
      return run(*first_);
    } catch (const Error& error) {
      if (error.code() == ErrorCode::kInvalidArgument) {
        WS_FAIL(error.code(), loading + "from " + first_->uri() + ": " + error.what());
      }
      failure_ = error.what();
    }
    first_->close();  // its connections and staging go before the second source loads
    std::fprintf(stderr, "weightstream: %s failed (%s); loading from %s\n",
                 first_->kind() == SourceKind::kPeer ? "peers" : first_->uri().c_str(), failure_.c_str(),
                 second_->uri().c_str());
    try {
      return run(*second_);
    } catch (const Error& error) {
      WS_FAIL(error.code(), loading + "from any source: " + first_->uri() + ": " + failure_ + "; " +
                                second_->uri() + ": " + error.what());
    }
  }

  SourceLoad with_failure(SourceLoad load) const {
    load.failure = failure_;
    if (!failure_.empty()) {
      PeerPullStats peers = first_->peer_stats();  // a failed pull's bytes count too
      load.peers = peers;
    }
    return load;
  }
  SourceLayout with_failure(SourceLayout layout) const {
    layout.load = with_failure(std::move(layout.load));
    return layout;
  }

  std::unique_ptr<Source> first_;
  std::unique_ptr<Source> second_;
  std::string failure_;
};

}  // namespace

std::unique_ptr<Source> fallback_source(std::unique_ptr<Source> first, std::unique_ptr<Source> second) {
  WS_EXPECT(first != nullptr && second != nullptr, ErrorCode::kInvalidArgument, "fallback_source: a null source");
  return std::make_unique<FallbackSource>(std::move(first), std::move(second));
}

}  // namespace weightstream
