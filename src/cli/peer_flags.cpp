#include "cli/peer_flags.hpp"

#include <signal.h>

#include <cstdio>
#include <iostream>

#include "cli/draft_flags.hpp"
#include "weightstream/error.hpp"

namespace weightstream::cli {
namespace {

PeerPullOptions pull_options(const PeerFlags& flags, const Options& options) {
  PeerPullOptions pull = source_options(options).peer;
  if (flags.token_stdin) pull.token = peer_token(flags);
  pull.timeout = std::chrono::milliseconds(static_cast<int64_t>(flags.timeout_seconds * 1000));
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

std::unique_ptr<Source> open_flag_source(const std::string& uri, const PeerFlags& flags, const Options& options) {
  SourceOptions source = source_options(options);
  source.peer = pull_options(flags, options);
  source.fallback = flags.fallback;
  return open_source(uri, source);
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

SourceLayout load_from_source(const std::string& uri, const LayoutFlags& layout_flags, const Device& device,
                              const PeerFlags& flags, const Options& options, const ProgressCallback& progress) {
  std::unique_ptr<Source> source = open_flag_source(uri, flags, options);
  EngineLayoutOptions layout;
  layout.layout = layout_options_from_flags(layout_flags);
  layout.device = device;
  try {
    return source->load_new(layout, progress);
  } catch (const Error& error) {
    if (source->kind() != SourceKind::kPeer) throw;  // a fallback names both sources itself
    WS_FAIL(error.code(), "cannot load from " + uri + ": " + error.what() + "; no storage fallback given (--fallback URI)");
  }
}

nlohmann::json peer_load_json(const SourceLayout& loaded) {
  const SourceLoad& load = loaded.load;
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
  nlohmann::json result = {{"source", load.uri},
                           {"layout", loaded.layout.description()},
                           {"parameters", loaded.layout.parameters().size()},
                           {"bytes_from_peers", load.pull.bytes_from_peers},
                           {"bytes_in_place", load.pull.bytes_in_place},
                           {"parameters_read", load.pull.parameters_read},
                           {"staging_bytes", load.pull.staging_bytes},
                           {"bytes_read", load.stream.bytes_read},
                           {"seconds", load.failure.empty() ? load.pull.seconds : load.stream.seconds},
                           {"gbps", load.failure.empty() ? load.pull.gbps() : load.stream.gbps()},
                           {"peers", peers}};
  if (!load.failure.empty()) result["peer_failure"] = load.failure;
  return result;
}

LoadRecord source_load_record(const SourceLoad& load) {
  LoadRecord record;
  if (source_is_checkpoint(load.kind)) {  // a checkpoint, or the fallback's
    record = stream_load_record(load.uri, load.stream);
    record.storage = load.storage;
    record.digest_failures = load.storage.checksum_failures;
  } else {
    record.source = "peer";
    record.bytes_read = load.pull.bytes_from_peers;
    record.seconds = load.pull.seconds;
  }
  record.peers = load.peers.peers;
  record.digest_failures += load.peers.digest_failures;
  return record;
}

LoadRecord run_peer_load(const std::string& uri, const LayoutFlags& layout_flags, const std::string& device_name,
                         const PeerFlags& flags, const StreamFlags& stream_flags, bool json) {
  Options options = resolve_options(stream_flags);
  Device device = parse_device(device_name);
  SourceLayout loaded = load_from_source(uri, layout_flags, device, flags, options);
  const SourceLoad& load = loaded.load;
  nlohmann::json result = peer_load_json(loaded);
  result["device"] = device.name();
  if (json) {
    print_json(result);
    return source_load_record(load);
  }
  uint64_t parameter_bytes = 0;
  for (const Parameter& parameter : loaded.layout.parameters()) parameter_bytes += parameter.bytes();
  std::printf("loaded %zu parameters (%s) of %s into %s from %s: %s from peers (%s in place), %s from storage in %.3f s (%.2f GB/s)\n",
              loaded.layout.parameters().size(), format_size(parameter_bytes).c_str(), loaded.layout.description().c_str(),
              device.name().c_str(), load.uri.c_str(), format_size(load.pull.bytes_from_peers).c_str(),
              format_size(load.pull.bytes_in_place).c_str(), format_size(load.stream.bytes_read).c_str(),
              result["seconds"].get<double>(), result["gbps"].get<double>());
  return source_load_record(load);
}

}  // namespace weightstream::cli
