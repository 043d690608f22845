#pragma once
// Peers on the command line (issue 31): `weightstream serve`, and the peer:// source that
// `load`, `export` and `audit` take: the layout is built from the config.json the peers
// publish, its parameters are pulled from them (PeerSource), and a storage URI given with
// --fallback is loaded instead when the peers fail.

#include <CLI/CLI.hpp>
#include <optional>
#include <string>

#include "cli/command.hpp"
#include "cli/layout_flags.hpp"
#include "cli/metrics.hpp"
#include "weightstream/peer.hpp"

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

/// A layout loaded from peers (or from the fallback).
struct PeerLoad {
  ModelLayout layout;
  std::string source;              ///< the URI it came from (peer:// or the fallback)
  PeerPullReport pull;             ///< zero when the fallback loaded it
  StreamStats storage;             ///< the fallback's stream (bytes_read); zero otherwise
  std::string peer_failure;        ///< why the peers failed, when the fallback loaded it
  std::vector<PeerManifest> manifests;
  PeerPullStats peers;             ///< bytes from each peer and digest failures, a failed pull's too
};

/// Reads the token (--token-stdin) once per process.
std::string peer_token(const PeerFlags& flags);

/// Connects to the peers of `uri` (token, timeout and staging limit from the flags).
PeerSource connect_peers(const std::string& uri, const PeerFlags& flags, const Options& options);

/// The layout of the peers' config.json for the flags' rank, storage on `device`, with the
/// hooks an engine registers.
ModelLayout peer_layout(const PeerSource& source, const LayoutFlags& layout_flags, const Device& device);

/// Pulls `flags`' rank from the peers of `uri` onto `device` (cold), or loads the fallback.
PeerLoad load_from_peers(const std::string& uri, const LayoutFlags& layout_flags, const Device& device,
                         const PeerFlags& flags, const Options& options);

/// Pulls again into a loaded layout (reload, in place). Throws what the pull throws.
PeerPullReport reload_from_peers(ModelLayout& layout, const std::string& uri, const PeerFlags& flags);

/// JSON of a peer load: source, bytes_from_peers, bytes_in_place, bytes_read, peers, ...
nlohmann::json peer_load_json(const PeerLoad& load);

/// What a load from peers (or their fallback) did, for its metrics: the source "peer" and
/// the bytes pulled, or the fallback's stream, with the peers' bytes and digest failures.
LoadRecord peer_load_record(const PeerLoad& load);

/// `load peer://...` with layout flags (tp 1 rank 0 by default). Returns peer_load_record.
LoadRecord run_peer_load(const std::string& uri, const LayoutFlags& layout_flags, const std::string& device,
                         const PeerFlags& flags, const StreamFlags& stream_flags, bool json);

/// Registers `serve`.
void add_serve_command(CLI::App& app);

}  // namespace weightstream::cli
