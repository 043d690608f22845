#pragma once
// Peers on the command line (issue 31): `weightstream serve`, and the flags of the peer://
// sources that `load`, `export` and `audit` take. The library's sources (source.hpp) build
// the layout from the config.json the peers publish, pull its parameters, and load the
// storage URI given with --fallback instead when the peers fail.

#include <CLI/CLI.hpp>
#include <optional>
#include <string>

#include "cli/command.hpp"
#include "cli/layout_flags.hpp"
#include "cli/metrics.hpp"
#include "weightstream/peer.hpp"
#include "weightstream/source.hpp"

namespace weightstream::cli {

/// --token-stdin, --fallback, --peer-timeout, --expect-digest of the commands that take peer:// URIs.
struct PeerFlags {
  bool token_stdin = false;
  std::string fallback;       ///< storage URI loaded when the peers fail
  double timeout_seconds = 30;
  std::string expect_digest;  ///< content digest every peer must serve (PeerPullOptions::expect_digest)
};

/// Adds them; `token_flag` false leaves --token-stdin to the command (audit has one for
/// --await-sender, and copies it into `flags.token_stdin`).
void add_peer_flags(CLI::App& command, PeerFlags& flags, bool token_flag = true);

/// Reads the token (--token-stdin) once per process.
std::string peer_token(const PeerFlags& flags);

/// The library's source of `uri` (open_source): peers with the flags' token, timeout,
/// expected digest and --fallback, the staging limit and UCX path of `options`.
std::unique_ptr<Source> open_flag_source(const std::string& uri, const PeerFlags& flags, const Options& options);

/// The layout of `uri`'s source for the flags' rank, storage on `device`, cold-loaded from it
/// (from --fallback when the peers fail).
SourceLayout load_from_source(const std::string& uri, const LayoutFlags& layout_flags, const Device& device,
                              const PeerFlags& flags, const Options& options, const ProgressCallback& progress = {});

/// JSON of a load from peers: source, bytes_from_peers, bytes_in_place, bytes_read, peers, ...
nlohmann::json peer_load_json(const SourceLayout& loaded);

/// What a load from a source did, for its metrics: the source "peer" and the bytes pulled, or
/// the checkpoint's (or the fallback's) stream and storage requests, with the peers' bytes
/// and digest failures.
LoadRecord source_load_record(const SourceLoad& load);

/// `load` from peers with layout flags (tp 1 rank 0 by default). Returns source_load_record.
LoadRecord run_peer_load(const std::string& uri, const LayoutFlags& layout_flags, const std::string& device,
                         const PeerFlags& flags, const StreamFlags& stream_flags, bool json);

/// Registers `serve`.
void add_serve_command(CLI::App& app);

}  // namespace weightstream::cli
