#pragma once
// Flags and helpers of source resolution and speculative drafts (resolve layer): the
// `resolve` command, and the `load` and `audit` paths taken with --model, --model-weights or
// --speculative. Kept apart from the plain and model-layout paths of those commands.

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli/command.hpp"
#include "cli/layout_flags.hpp"
#include "cli/metrics.hpp"
#include "weightstream/resolve.hpp"

namespace weightstream::cli {

/// --model, --model-weights, --draft-model, --draft-model-weights, --speculative (and, on
/// `load` and `audit`, --draft-only and --share-embeddings).
struct DraftFlags {
  std::string model;
  std::string model_weights;
  /// The draft's `model`; default: the target's. Its `model_weights` default to empty, as an
  /// engine builds a draft's config (it copies the model, not the weights' location).
  std::optional<std::string> draft_model;
  std::optional<std::string> draft_model_weights;
  std::string speculative;  ///< "" or "mtp"
  bool draft_only = false;
  bool share_embeddings = false;
  /// Whether `load` or `audit` was asked for this path.
  bool requested() const noexcept {
    return !model.empty() || !model_weights.empty() || !speculative.empty() || draft_only || share_embeddings ||
           draft_model || draft_model_weights;
  }
};

/// Adds the source flags shared by `resolve` and `load`.
void add_model_source_flags(CLI::App& command, DraftFlags& flags);
/// Adds the source flags plus --draft-only and --share-embeddings to `load` or `audit`.
void add_draft_load_flags(CLI::App& command, DraftFlags& flags);

/// `flags` with a command's URI argument as the target's --model (`command` names it in
/// errors): they must agree when both are given. Checks that --share-embeddings has the
/// target and the draft. Throws Error(kInvalidArgument).
DraftFlags with_target_uri(const std::string& command, const std::string& uri, const DraftFlags& flags);

/// One module set up for resolution or loading: config, layout (storage not yet allocated)
/// and where its weights resolved.
struct ModuleSetup {
  ModuleRole role = ModuleRole::kTarget;
  ModelSource source;
  ModelConfigSource config;
  ModelLayout layout;
  SourceResolution resolution;
};

/// The target (unless `include_target` is false) and, with --speculative mtp, the draft,
/// each with its config, layout and resolution. Resolution failures are left in the
/// resolutions for the caller to print or throw.
std::vector<ModuleSetup> setup_modules(const DraftFlags& flags, const Options& options,
                                       const LayoutOptions& layout_options, bool include_target);

/// Storage for each module, as an engine sets it up before the first load: with
/// --share-embeddings the draft refers to the target's embedding and head (modules[0]),
/// then each layout is allocated on `device` and gets the engine's hooks (engine_hooks).
void allocate_modules(std::vector<ModuleSetup>& modules, const DraftFlags& flags, const Device& device);

/// The modules of `flags` ready for their first load: set up (the target unless
/// --draft-only), every one resolved (else the one error naming every source), storage
/// allocated (allocate_modules).
std::vector<ModuleSetup> ready_modules(const DraftFlags& flags, const Options& options,
                                       const LayoutOptions& layout_options, const Device& device);

/// The load request of each module, pointing at its layout.
std::vector<ModuleLoadRequest> load_requests(std::vector<ModuleSetup>& modules);

/// JSON of a resolution: module, source, field, shards, candidates with reasons.
nlohmann::json resolution_json(const SourceResolution& resolution);

/// The `load` command's resolve path (flags given with it): resolves target and draft, loads
/// them into fresh layouts (combined when they share a source), prints per-module source,
/// tensors, bytes read and shards read. `uri`, when given, is the target's --model. Returns
/// what the streams did together, for the metrics, labelled with the first stream's source;
/// `observer` sees their progress.
LoadRecord run_draft_load(const std::string& uri, const DraftFlags& flags, const LayoutOptions& layout_options,
                          const std::string& device, const StreamFlags& stream_flags, bool json,
                          const ProgressCallback& observer = {});

/// Registers `weightstream resolve`.
void add_resolve_command(CLI::App& app);

}  // namespace weightstream::cli
