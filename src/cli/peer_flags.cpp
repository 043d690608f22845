#include "cli/peer_flags.hpp"

#include <signal.h>

#include <cstdio>
#include <iostream>

#include "cli/draft_flags.hpp"
#include "weightstream/error.hpp"

namespace weightstream::cli {
namespace {

PeerPullOptions pull_options(const PeerFlags& flags, const Options& options) {
  PeerPullOptions pull;
  pull.token = flags.token_stdin ? peer_token(flags) : options.peer_token;
  pull.timeout = std::chrono::milliseconds(static_cast<int64_t>(flags.timeout_seconds * 1000));
  pull.memory_limit = options.stream.memory_limit;
  pull.ucx_path = options.ucx_path;
  pull.expect_digest = flags.expect_digest;
  if (options.test_pull_stop_after > 0) {
    // WEIGHTSTREAM_TEST_PULL_STOP_AFTER: the test that kills a server mid-pull waits for
    // this stop (waitpid WUNTRACED), kills the server, and continues the puller.
    pull.pause_after_bytes = options.test_pull_stop_after;
    pull.on_pause = [] { ::raise(SIGSTOP); };
  }
  return pull;
}

}  // namespace

PeerSource connect_peers(const std::string& uri, const PeerFlags& flags, const Options& options) {
  return PeerSource(uri, pull_options(flags, options));
}

ModelLayout peer_layout(const PeerSource& source, const LayoutFlags& layout_flags, const Device& device) {
  const std::string object = source.uri() + " (config.json published by the peer)";
  ModelConfig config = parse_model_config(object, source.config_json());
  std::vector<std::string_view> names;
  for (const PeerTensor& tensor : source.tensors()) names.push_back(tensor.name);
  check_checkpoint_layers(config, object, names);
  LayoutOptions options = layout_options_from_flags(layout_flags);
  options.max_tensors = layout_tensor_bound(names.size());
  ModelLayout layout = build_model_layout(config, options);
  layout.allocate(device);
  add_engine_hooks(layout, config);
  return layout;
}

void add_peer_flags(CLI::App& command, PeerFlags& flags, bool token_flag) {
  if (token_flag) command.add_flag("--token-stdin", flags.token_stdin, "peer:// sources: read the serving peers' token from the first line of stdin (else WEIGHTSTREAM_PEER_TOKEN)");
  command.add_option("--fallback", flags.fallback,
                     "peer:// sources: a checkpoint (directory, file://, s3://, gs://, az://) loaded instead when the peers fail");
  command.add_option("--peer-timeout", flags.timeout_seconds,
                     "peer:// sources: seconds a connect, message or read may go without progress (default 30)")
      ->check(CLI::Range(0.1, 86400.0));
  command.add_option("--expect-digest", flags.expect_digest,
                     "peer:// sources: the content digest (16 hex digits, as `digest --hash xxh64`, `inspect --content` "
                     "and `serve` print it) every peer must serve; a peer serving other or unknown (updated) content "
                     "is refused before a byte is pulled");
}

std::string peer_token(const PeerFlags& flags) {
  return flags.token_stdin ? token_from_stdin() : environment_options().peer_token;
}

PeerLoad load_from_peers(const std::string& uri, const LayoutFlags& layout_flags, const Device& device,
                         const PeerFlags& flags, const Options& options) {
  PeerLoad result;
  std::optional<PeerSource> source;  // outside the try: a failed pull's stats are kept
  try {
    source.emplace(uri, pull_options(flags, options));
    ModelLayout layout = peer_layout(*source, layout_flags, device);
    LoadSession session(layout);
    session.begin(LoadMode::kCold);
    result.pull = source->pull(session);
    session.finish();
    result.layout = std::move(layout);
    result.source = uri;
    result.manifests = source->manifests();
    result.peers = source->stats();
    return result;
  } catch (const Error& error) {
    if (source) {
      result.peers = source->stats();
      source.reset();  // its connections and staging go before the fallback loads
    }
    if (flags.fallback.empty() || error.code() == ErrorCode::kInvalidArgument) {
      WS_FAIL(error.code(), std::string("cannot load from ") + uri + ": " + error.what() +
                                (flags.fallback.empty() ? "; no storage fallback given (--fallback URI)" : ""));
    }
    result.peer_failure = error.what();
  }
  // Nothing of the failed pull is kept: the fallback loads a fresh layout.
  std::fprintf(stderr, "weightstream: peers failed (%s); loading from %s\n", result.peer_failure.c_str(),
               flags.fallback.c_str());
  try {
    Checkpoint checkpoint = Checkpoint::open(flags.fallback, options);
    result.layout = checkpoint_layout(checkpoint, layout_flags, device);
    result.storage = load_layout(result.layout, checkpoint, LoadMode::kCold, options.stream).stream;
    result.source = checkpoint.uri();
  } catch (const Error& error) {
    WS_FAIL(error.code(), "cannot load from any source: " + uri + ": " + result.peer_failure + "; " + flags.fallback +
                              ": " + error.what());
  }
  return result;
}

PeerPullReport reload_from_peers(ModelLayout& layout, const std::string& uri, const PeerFlags& flags) {
  PeerSource source(uri, pull_options(flags, environment_options()));
  LoadSession session(layout);
  session.begin(LoadMode::kReload);
  PeerPullReport report = source.pull(session);
  session.finish();
  return report;
}

nlohmann::json peer_load_json(const PeerLoad& load) {
  nlohmann::json peers = nlohmann::json::array();
  for (const PeerManifest& manifest : load.manifests) {
    peers.push_back({{"address", manifest.address},
                     {"tp_rank", manifest.parallel.tp_rank},
                     {"tp_size", manifest.parallel.tp_size},
                     {"ep_rank", manifest.parallel.ep_rank},
                     {"ep_size", manifest.parallel.ep_size},
                     {"version", manifest.version},
                     {"checkpoint_identity", manifest.checkpoint_identity},
                     {"content_digest", manifest.content_digest},
                     {"ucx_path", manifest.ucx_path},
                     {"ucx_transports", manifest.ucx_transports}});
  }
  nlohmann::json result = {{"source", load.source},
                           {"layout", load.layout.description()},
                           {"parameters", load.layout.parameters().size()},
                           {"bytes_from_peers", load.pull.bytes_from_peers},
                           {"bytes_in_place", load.pull.bytes_in_place},
                           {"parameters_read", load.pull.parameters_read},
                           {"staging_bytes", load.pull.staging_bytes},
                           {"bytes_read", load.storage.bytes_read},
                           {"seconds", load.peer_failure.empty() ? load.pull.seconds : load.storage.seconds},
                           {"gbps", load.peer_failure.empty() ? load.pull.gbps() : load.storage.gbps()},
                           {"peers", peers}};
  if (!load.peer_failure.empty()) result["peer_failure"] = load.peer_failure;
  return result;
}

LoadRecord peer_load_record(const PeerLoad& load) {
  LoadRecord record;
  if (load.peer_failure.empty()) {
    record.source = "peer";
    record.bytes_read = load.pull.bytes_from_peers;
    record.seconds = load.pull.seconds;
  } else {
    record = stream_load_record(load.source, load.storage);  // the fallback's
  }
  record.peers = load.peers.peers;
  record.digest_failures += load.peers.digest_failures;
  return record;
}

LoadRecord run_peer_load(const std::string& uri, const LayoutFlags& layout_flags, const std::string& device_name,
                         const PeerFlags& flags, const StreamFlags& stream_flags, bool json) {
  Options options = resolve_options(stream_flags);
  Device device = parse_device(device_name);
  PeerLoad load = load_from_peers(uri, layout_flags, device, flags, options);
  nlohmann::json result = peer_load_json(load);
  result["device"] = device.name();
  if (json) {
    print_json(result);
    return peer_load_record(load);
  }
  uint64_t parameter_bytes = 0;
  for (const Parameter& parameter : load.layout.parameters()) parameter_bytes += parameter.bytes();
  std::printf("loaded %zu parameters (%s) of %s into %s from %s: %s from peers (%s in place), %s from storage in %.3f s (%.2f GB/s)\n",
              load.layout.parameters().size(), format_size(parameter_bytes).c_str(), load.layout.description().c_str(),
              device.name().c_str(), load.source.c_str(), format_size(load.pull.bytes_from_peers).c_str(),
              format_size(load.pull.bytes_in_place).c_str(), format_size(load.storage.bytes_read).c_str(),
              result["seconds"].get<double>(), result["gbps"].get<double>());
  return peer_load_record(load);
}

}  // namespace weightstream::cli
