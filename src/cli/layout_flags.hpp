#pragma once
// Flags and helpers shared by the commands that build a model layout from a checkpoint's
// config.json (plan, export, audit, and load with --tp-size/--tp-rank).

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "cli/command.hpp"
#include "cli/metrics.hpp"
#include "weightstream/load.hpp"
#include "weightstream/model.hpp"

namespace weightstream::cli {

/// --tp-size, --tp-rank, --ep-size, --ep-rank, --quantize.
struct LayoutFlags {
  std::optional<int64_t> tp_size;
  std::optional<int64_t> tp_rank;
  int64_t ep_size = 1;
  int64_t ep_rank = 0;
  std::string quantize = "none";
};

/// Adds the layout flags to `command`.
void add_layout_flags(CLI::App& command, LayoutFlags& flags);

/// The tensor- and expert-parallel rank of the flags. Throws Error(kInvalidArgument) for a
/// rank that is not below its size, naming the flags.
Parallelism parallelism_from_flags(const LayoutFlags& flags);

/// The layout options of --tp-size, --tp-rank, --ep-size, --ep-rank and --quantize.
/// Throws Error(kInvalidArgument) for a rank outside its size.
LayoutOptions layout_options_from_flags(const LayoutFlags& flags);

/// The library's engine_layout of `checkpoint` for the flags' rank, with storage on `device`
/// and the engine's hooks. `held_as`, when given, is the config of the model that holds these
/// weights (EngineLayoutOptions::held_as).
ModelLayout checkpoint_layout(const Checkpoint& checkpoint, const LayoutFlags& flags, const Device& device,
                              const ModelConfig* held_as = nullptr);

/// The `load` command's model-layout path: builds the layout from config.json, loads the
/// checkpoint into it through a LoadSession and prints the summary (JSON when `json`).
/// Returns what the load did, for its metrics; `observer` sees its progress.
LoadRecord run_layout_load(const std::string& uri, const LayoutFlags& flags, const std::string& device,
                           const StreamFlags& stream_flags, bool json, const ProgressCallback& observer = {});

/// Flags of `load` for the layout path, kept apart from the plain load's own flags.
struct LayoutLoadFlags {
  LayoutFlags layout;
  bool raw = false;
  /// Whether the layout path was asked for (a layout flag given, --raw not).
  bool requested() const noexcept {
    return !raw && (layout.tp_size || layout.tp_rank || layout.ep_size > 1 || layout.ep_rank > 0 ||
                    layout.quantize != "none");
  }
};

/// Adds --tp-size, --tp-rank, --ep-size, --ep-rank, --quantize and --raw to `load`; --raw
/// refuses the others (a plain load has no layout for them to shape).
void add_layout_load_flags(CLI::App& command, LayoutLoadFlags& flags);

}  // namespace weightstream::cli
