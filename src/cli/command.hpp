#pragma once
// Shared pieces of the `weightstream` subcommands. Each subcommand lives in its own
// command_<name>.cpp and registers itself from main.cpp through add_<name>_command().

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "weightstream/options.hpp"
#include "weightstream/stream.hpp"

namespace weightstream::cli {

/// Options read once from the environment; flags then override them.
const Options& environment_options();

/// Flags shared by every command that streams (load, digest, audit, ...).
struct StreamFlags {
  std::optional<unsigned> concurrency;
  std::string memory_limit;
  std::string chunk_size;
  std::string io;
  std::string gpu_path;
  std::string mapped_share;
  std::optional<unsigned> prefetchers;
  bool progress = false;
  bool no_progress = false;
};

/// Adds --concurrency, --memory-limit, --chunk-size, --io, --progress to `command`.
void add_stream_flags(CLI::App& command, StreamFlags& flags);

/// The environment's options with `flags` applied. Throws Error(kInvalidArgument).
Options resolve_options(const StreamFlags& flags);

/// The token of --token-stdin: the first line of stdin, read once per process (every later
/// call returns it again). Throws Error(kInvalidArgument) when the line is empty or stdin
/// ends before one: no command takes an empty token for "no token".
const std::string& token_from_stdin();

/// Whether progress goes to stderr: --progress, WEIGHTSTREAM_PROGRESS=1, or a terminal.
bool progress_enabled(const StreamFlags& flags, const Options& options);

/// A progress printer for stderr (bytes, GB/s, ETA). On a terminal one line is redrawn in
/// place at most 10 times a second; elsewhere (a pipe, a log) a plain line is written every
/// 3 seconds and once at the end. The first frame, before any rate is measured, shows "ETA --".
/// `observer`, when given, sees every update, printed or not (a load's metrics).
class ProgressLine {
 public:
  explicit ProgressLine(bool enabled, ProgressCallback observer = {});
  ~ProgressLine();
  void update(uint64_t done, uint64_t total);

 private:
  ProgressCallback observer_;
  bool enabled_;
  bool terminal_;
  bool drawn_ = false;
  bool finished_drawn_ = false;
  double start_ = -1;
  double last_draw_ = -1;
};

/// "1 layer", "3 layers": `count` and `noun`, which takes an "s" unless `count` is 1.
std::string counted(uint64_t count, std::string_view noun);

/// Columns `text` takes on a terminal: UTF-8 decoded, East Asian wide characters and emoji
/// two columns, combining marks none, every other character one.
size_t display_width(std::string_view text);

/// `text` followed by spaces up to `width` display columns.
std::string pad_to(std::string_view text, size_t width);

/// Prints `value` as indented JSON on stdout.
void print_json(const nlohmann::json& value);

/// A JSON object of named counters (stat_fields of a StreamStats or LoadCounters).
nlohmann::json stats_json(const std::vector<StatField>& fields);
/// One human line: "loaded N tensors, X GiB in S s (R GB/s) to DEVICE; peak staging P".
void print_stream_summary(const char* verb, const StreamStats& stats, const std::string& device);

/// Registration of each subcommand.
void add_inspect_command(CLI::App& app);
void add_load_command(CLI::App& app);
void add_digest_command(CLI::App& app);
void add_synth_command(CLI::App& app);
void add_plan_command(CLI::App& app);
void add_export_command(CLI::App& app);
void add_audit_command(CLI::App& app);
void add_s3_command(CLI::App& app);

}  // namespace weightstream::cli
