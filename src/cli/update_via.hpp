#pragma once
// Pushed updates from the command line (issue 8): the hidden `weightstream send` command,
// a sender process that streams a checkpoint into an update receiver, and the `--via`
// flags of `audit`, which run the reload through a transport from such a process.

#include <CLI/CLI.hpp>
#include <functional>
#include <string>

#include "cli/command.hpp"
#include "cli/metrics.hpp"
#include "weightstream/model.hpp"
#include "weightstream/transfer.hpp"

namespace weightstream::cli {

/// `audit --via TRANSPORT [--bucket-size SIZE]`.
struct ViaFlags {
  std::string via;                   ///< empty: the plain in-process reload
  std::string bucket_size = "256MiB";
  /// --listen: where the receiver listens (default: loopback, a free port).
  std::string listen;
  /// --await-sender: no sender is spawned; the receiver's address goes to stderr and a
  /// sender elsewhere (another host) connects with the token read by --token-stdin.
  bool await_sender = false;
  bool token_stdin = false;
  /// --open-without-token: --await-sender accepts any sender, with no token (warned about).
  bool open_without_token = false;
  /// --metrics-listen: the receiver's Prometheus endpoint (docs/METRICS.md).
  MetricsFlags metrics;
  /// --delta: the reload goes as a delta update from the audited checkpoint (send --delta-from).
  bool delta = false;
  bool requested() const noexcept { return !via.empty(); }
};

/// Adds --via and --bucket-size to `audit`.
void add_via_flags(CLI::App& command, ViaFlags& flags);

/// One update received through a transport.
struct ViaUpdate {
  UpdateReport report;
  /// The first update: from spawning the sender (or from listening, with --await-sender) to
  /// the receiver's end of finish(); each later one: from the end of the one before.
  double seconds = 0;
};

/// Receives `count` updates of `layout`, one after another over one connection, from one
/// `weightstream send --repeat COUNT` process spawned for `reload_uri` (or, with
/// --await-sender, from a sender elsewhere), through the transport of `flags`, with a fresh
/// random token; calls `on_update` after each. With `metrics`, each update applied shows in
/// its weightstream_update_* series while the receiver lives. With `delta_base_uri` (the
/// checkpoint the layout holds), the receiver holds that checkpoint's content digest as its
/// version and the sender sends `send --delta-from delta_base_uri` (one update). Throws the
/// receiver's error, with the sender's exit status when it failed first.
void receive_updates_via(ModelLayout& layout, const std::string& reload_uri, const ViaFlags& flags, const Device& device,
                         const StreamFlags& stream, int64_t count, const std::function<void(const ViaUpdate&)>& on_update,
                         MetricsEndpoint* metrics = nullptr, const std::string& delta_base_uri = {});

/// Registers the hidden `send` subcommand.
void add_send_command(CLI::App& app);

}  // namespace weightstream::cli
