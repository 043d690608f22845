// The library's sources in Python (source.hpp): the options load_checkpoint takes for them,
// what a load from one reports, the config.json of a source, and the PeerServer that
// publishes a layout loaded from one.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <optional>
#include <string>

#include "bindings.hpp"
#include "weightstream/error.hpp"
#include "weightstream/source.hpp"
#include "weightstream/transfer.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace weightstream::python {

SourceOptions python_source_options(nb::dict given) {
  // The peers' own keys; the rest are stream options (memory_limit bounds a pull's staging too).
  nb::dict stream;
  std::optional<std::string> token, expect_digest;
  double timeout_seconds = 30;
  for (auto [key, value] : given) {
    const std::string name = nb::cast<std::string>(key);
    if (name == "token") {
      if (!value.is_none()) token = nb::cast<std::string>(value);
    } else if (name == "timeout") {
      timeout_seconds = nb::cast<double>(value);
    } else if (name == "expect_digest") {
      if (!value.is_none()) expect_digest = nb::cast<std::string>(value);
    } else {
      stream[key] = value;
    }
  }
  SourceOptions options = source_options(resolve_options(environment_options(), stream));
  if (token) options.peer.token = *token;
  options.peer.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000));
  options.peer.expect_digest = expect_digest.value_or("");
  return options;
}

nb::dict source_load_dict(const SourceLoad& load) {
  if (source_is_checkpoint(load.kind)) return stats_dict(stat_fields(load.stream));
  nb::dict result;
  result["bytes_from_peers"] = load.pull.bytes_from_peers;
  result["bytes_in_place"] = load.pull.bytes_in_place;
  result["parameters_read"] = load.pull.parameters_read;
  result["tensors"] = load.pull.tensors;
  result["staging_bytes"] = load.pull.staging_bytes;
  result["bytes_read"] = 0;
  result["seconds"] = load.pull.seconds;
  result["gbps"] = load.pull.gbps();
  nb::list by_peer;
  for (const PeerBytes& peer : load.peers.peers) {
    nb::dict entry;
    entry["address"] = peer.address;
    entry["transports"] = peer.transports;
    entry["bytes"] = peer.bytes;
    by_peer.append(entry);
  }
  result["peers"] = by_peer;
  result["digest_failures"] = load.peers.digest_failures;
  return result;
}

std::string peer_config_json(const std::string& uri, const std::optional<std::string>& token, double timeout_seconds) {
  nb::gil_scoped_release release;
  SourceOptions options = source_options(environment_options());
  if (token) options.peer.token = *token;
  options.peer.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000));
  return open_source(uri, options)->config_json();
}

namespace {

/// A PeerServer publishing a Python layout; it holds the layout object, so the memory it
/// serves lives as long as the server.
class PeerServerHandle {
 public:
  /// `source` is the checkpoint the layout was loaded from (a Checkpoint), or the URI of the
  /// source it was loaded from (a checkpoint, or peers, who publish the checkpoint's
  /// config.json and tensors).
  PeerServerHandle(nb::object layout_object, nb::object source, const std::string& listen,
                   const std::optional<std::string>& token, double timeout_seconds, bool open_without_token,
                   const std::optional<std::string>& expect_digest)
      : layout_object_(std::move(layout_object)) {
    const ModelLayout& layout = python_layout(layout_object_);
    WS_EXPECT(layout.loads_finished() > 0, ErrorCode::kModel,
              "cannot serve " + layout.description() + ": it has not been loaded (load it, then serve it)");
    PeerServeOptions options;
    options.listen = listen;
    // An open server asked for takes no token from the environment (the two would conflict).
    options.token = token.value_or(open_without_token ? std::string() : environment_options().peer_token);
    options.open_without_token = open_without_token;
    // Refused before a pull from peers (the server refuses it too, when it starts).
    require_listener_token(options.token, options.open_without_token, "peer server on " + listen);
    options.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000));
    const LayoutOptions& built = python_layout_options(layout_object_);
    if (nb::isinstance<CheckpointHandle>(source)) {
      const Checkpoint& checkpoint = nb::cast<const CheckpointHandle&>(source).checkpoint();
      refuse_pinned_checkpoint(expect_digest, checkpoint.uri());
      nb::gil_scoped_release release;
      start(layout, peer_serve_info(checkpoint, built.parallel, built.quantize), std::move(options));
      return;
    }
    const std::string uri = nb::cast<std::string>(source);
    nb::gil_scoped_release release;
    SourceOptions source_options_ = source_options(environment_options());
    source_options_.peer.token = options.token;
    source_options_.peer.timeout = options.timeout;
    source_options_.peer.expect_digest = expect_digest.value_or("");
    std::unique_ptr<Source> opened = open_source(uri, source_options_);
    if (source_is_checkpoint(opened->kind())) refuse_pinned_checkpoint(expect_digest, uri);
    start(layout, opened->serve_info(built.parallel, built.quantize), std::move(options));
  }

  const std::string& address() const { return address_; }
  uint64_t version() const { return server_ ? server_->version() : 0; }
  std::string content_digest() const { return server_ ? server_->content_digest() : std::string(); }
  bool serving() const { return server_ != nullptr; }
  void begin_update() { live().begin_update(); }
  void end_update() {
    nb::gil_scoped_release release;
    live().end_update();  // rehashes every parameter
  }
  /// Stops serving (pullers' reads fail from then on); the layout is released.
  void close() {
    {
      nb::gil_scoped_release release;
      server_.reset();
    }
    layout_object_ = nb::none();
  }

 private:
  static void refuse_pinned_checkpoint(const std::optional<std::string>& expect_digest, const std::string& uri) {
    WS_EXPECT(!expect_digest, ErrorCode::kInvalidArgument,
              "expect_digest pins what a layout pulled from peers serves; " + uri +
                  " is a checkpoint, whose content digest is computed from its bytes");
  }
  void start(const ModelLayout& layout, PeerServeInfo info, PeerServeOptions options) {
    server_ = std::make_unique<PeerServer>(layout, std::move(info), std::move(options));
    address_ = server_->address();
  }
  PeerServer& live() {
    WS_EXPECT(server_ != nullptr, ErrorCode::kInvalidArgument, "peer server " + address_ + " was closed");
    return *server_;
  }
  nb::object layout_object_;
  std::unique_ptr<PeerServer> server_;
  std::string address_;
};

}  // namespace

/// A source whose load is a Python callable's: the engine plugins' pull into a bound layout
/// and their own sources behind it (their resolution, and the model's load_weights), which
/// load_with_fallback joins with the library's fallback_source. weightstream.Error (its code
/// kept) and FileNotFoundError become Errors the fallback sees; any other exception passes.
class CallableSource final : public Source {
 public:
  CallableSource(SourceKind kind, std::string description, nb::callable load)
      : kind_(kind), description_(std::move(description)), load_(std::move(load)) {}

  SourceKind kind() const noexcept override { return kind_; }
  std::string uri() const override { return description_; }
  std::string config_json() override { unsupported("config_json"); }
  ModelLayout layout(const EngineLayoutOptions&) override { unsupported("layout"); }
  SourceLoad load(ModelLayout&, LoadMode, const ProgressCallback&) override {
    nb::gil_scoped_acquire acquire;
    try {
      load_();
    } catch (nb::python_error& error) {
      const bool ours = error.matches(nb::handle(python_error_type()));
      if (!ours && !error.matches(PyExc_FileNotFoundError)) throw;
      ErrorCode code = ErrorCode::kNotFound;
      if (ours) code = error_code_of(nb::getattr(error.value(), "code", nb::none()));
      throw Error(code, nb::str(error.value()).c_str());
    }
    SourceLoad result;
    result.uri = description_;
    result.kind = kind_;
    return result;
  }
  SourceLoad load_into(LoadSession&, const ProgressCallback&) override { unsupported("load_into"); }
  PeerServeInfo serve_info(const Parallelism&, Processing) override { unsupported("serve_info"); }

 private:
  [[noreturn]] void unsupported(const char* what) const {
    WS_FAIL(ErrorCode::kInternal, description_ + " is a Python load: it has no " + what);
  }
  static ErrorCode error_code_of(nb::handle name) {
    if (nb::isinstance<nb::str>(name)) {
      const std::string text = nb::cast<std::string>(name);
      for (int value = 0; value <= static_cast<int>(ErrorCode::kInternal); ++value) {
        if (error_code_name(static_cast<ErrorCode>(value)) == text) return static_cast<ErrorCode>(value);
      }
    }
    return ErrorCode::kIo;
  }
  SourceKind kind_;
  std::string description_;
  nb::callable load_;
};

/// load_with_fallback: `pull()` (a load from the peers of `uri`), else, when it fails,
/// `own_sources()`. Returns why the pull failed ("" when it served).
std::string load_with_fallback(nb::handle layout, const std::string& uri, nb::callable pull,
                               const std::string& description, nb::callable own_sources) {
  std::unique_ptr<Source> source =
      fallback_source(std::make_unique<CallableSource>(source_kind(uri), uri, std::move(pull)),
                      std::make_unique<CallableSource>(SourceKind::kFile, description, std::move(own_sources)));
  ModelLayout& loaded = python_layout(layout);
  nb::gil_scoped_release release;
  return source->load(loaded, LoadMode::kCold).failure;
}

void bind_sources(nb::module_& m) {
  m.def("peer_config", &peer_config_json, "uri"_a, "token"_a = nb::none(), "timeout"_a = 30.0,
        "The config.json text a source publishes: the serving peers of a peer:// URI (their token needed), or "
        "a checkpoint's.");
  m.def("source_kind", [](const std::string& uri) { return std::string(source_kind_name(source_kind(uri))); },
        "uri"_a, "The kind of source a URI names (file, s3, gs, az, http, peer); weightstream.Error for a "
        "malformed one.");
  m.def("load_with_fallback", &load_with_fallback, "layout"_a, "uri"_a, "pull"_a, "description"_a, "own_sources"_a,
        "The library's fallback (fallback_source) over two Python loads of `layout`: pull() from the source "
        "`uri` names, else own_sources() (described by `description` in messages). Returns why the first "
        "failed, empty when it served; raises weightstream.Error naming both when neither serves.");
  nb::class_<PeerServerHandle>(m, "PeerServer")
      .def(nb::init<nb::object, nb::object, const std::string&, const std::optional<std::string>&, double, bool,
                    const std::optional<std::string>&>(),
           "layout"_a, "source"_a, "listen"_a = "127.0.0.1:0", "token"_a = nb::none(), "timeout"_a = 30.0,
           nb::kw_only(), "open_without_token"_a = false, "expect_digest"_a = nb::none())
      .def_prop_ro("address", &PeerServerHandle::address)
      .def_prop_ro("version", &PeerServerHandle::version)
      .def_prop_ro("content_digest", &PeerServerHandle::content_digest,
                   "The content digest published (16 hex digits); empty once the parameters were updated.")
      .def_prop_ro("serving", &PeerServerHandle::serving)
      .def("begin_update", &PeerServerHandle::begin_update,
           "Before the served parameters change: pulls that overlap the change are refused.")
      .def("end_update", &PeerServerHandle::end_update, "After they changed: rehashes and publishes a new version.")
      .def("close", &PeerServerHandle::close, "Stops serving; pullers' reads fail from then on.")
      .def("__enter__", [](nb::handle self) { return nb::borrow(self); })
      .def("__exit__", [](PeerServerHandle& handle, nb::args) { handle.close(); });
}

}  // namespace weightstream::python
