// Source resolution and speculative drafts on the command line: `weightstream resolve`, and
// `weightstream load` and `weightstream audit` with --model / --model-weights / --speculative mtp.
#include "cli/draft_flags.hpp"

#include <cstdio>

#include "weightstream/error.hpp"

namespace weightstream::cli {
namespace {

ModelSource draft_source(const DraftFlags& flags) {
  return {flags.draft_model.value_or(flags.model), flags.draft_model_weights.value_or("")};
}

std::string speculative_method(const DraftFlags& flags) { return flags.speculative; }

nlohmann::json module_load_json(const ModuleSetup& module, const ModuleLoad& load) {
  nlohmann::json passed_over = nlohmann::json::array();
  for (const SourceCandidate& candidate : module.resolution.candidates) {
    if (!candidate.reason.empty()) passed_over.push_back(candidate.text());
  }
  uint64_t parameter_bytes = 0;
  for (const Parameter& parameter : module.layout.parameters()) parameter_bytes += parameter.bytes();
  return {{"source", load.source},
          {"field", load.field},
          {"passed_over", passed_over},
          {"strategy", load.strategy},
          {"layout", module.layout.description()},
          {"config", module.config.uri},
          {"tensors", load.tensors},
          {"bytes_read", load.bytes_read},
          {"shards_read", load.shards_read},
          {"shards_opened", load.shards_opened},
          {"parameters", module.layout.parameters().size()},
          {"parameter_bytes", parameter_bytes},
          {"tensors_applied", load.counters.tensors_applied},
          {"tensors_skipped", load.counters.tensors_skipped}};
}

/// Adds the stream of `load` to `record`: the first stream names the source.
void add_to_record(LoadRecord& record, const StrategyLoad& load) {
  LoadRecord stream = stream_load_record(load.modules.empty() ? std::string() : load.modules.front().source, load.stream);
  if (record.source.empty()) {
    record = std::move(stream);
    return;
  }
  record.bytes_read += stream.bytes_read;
  record.seconds += stream.seconds;
  for (size_t i = 0; i < record.phases.size() && i < stream.phases.size(); ++i) {
    record.phases[i].second += stream.phases[i].second;  // the same phases, in the same order
  }
  record.storage.requests += stream.storage.requests;
  record.storage.retries += stream.storage.retries;
  record.storage.checksum_failures += stream.storage.checksum_failures;
  record.digest_failures += stream.digest_failures;
}

}  // namespace

void add_model_source_flags(CLI::App& command, DraftFlags& flags) {
  command.add_option("--model", flags.model,
                     "The model: a URI or local directory (config and tokenizer files are enough)");
  command.add_option("--model-weights", flags.model_weights, "Where the target's weights are, when not in --model");
  command.add_option("--draft-model", flags.draft_model, "The draft's model (default: --model)");
  command.add_option("--draft-model-weights", flags.draft_model_weights,
                     "Where the draft's weights are (default: not set, as an engine's draft config)");
  command.add_option("--speculative", flags.speculative, "Speculative draft from the target's checkpoint: mtp")
      ->check(CLI::IsMember({"mtp"}));
}

void add_draft_load_flags(CLI::App& command, DraftFlags& flags) {
  add_model_source_flags(command, flags);
  command.add_flag("--draft-only", flags.draft_only,
                   "Load only the draft (with --speculative mtp): reads only the shards holding its tensors");
  command.add_flag("--share-embeddings", flags.share_embeddings,
                   "The draft's per-layer embedding and head refer to the target's (not read)");
}

std::vector<ModuleSetup> setup_modules(const DraftFlags& flags, const Options& options,
                                       const LayoutOptions& layout_options, bool include_target) {
  WS_EXPECT(!flags.draft_only || flags.speculative == "mtp", ErrorCode::kInvalidArgument,
            "--draft-only needs --speculative mtp");
  std::vector<ModuleSetup> modules;
  auto add = [&](ModuleRole role, ModelSource source) {
    ModuleSetup module;
    module.role = role;
    module.source = std::move(source);
    module.config = find_model_config(module.source, options);
    module.layout = build_module_layout(module.config.config, role, layout_options);
    // A source the target's resolution opened (no index) is not opened again for the draft.
    std::vector<SourceResolution> earlier;
    for (const ModuleSetup& other : modules) earlier.push_back(other.resolution);
    module.resolution = resolve_source(module.source, role, module.layout, options,
                                       role == ModuleRole::kDraft ? speculative_method(flags) : std::string(), earlier);
    modules.push_back(std::move(module));
  };
  if (include_target) add(ModuleRole::kTarget, {flags.model, flags.model_weights});
  if (flags.speculative == "mtp") add(ModuleRole::kDraft, draft_source(flags));
  return modules;
}

DraftFlags with_target_uri(const std::string& command, const std::string& uri, const DraftFlags& given) {
  DraftFlags flags = given;
  if (!uri.empty()) {
    WS_EXPECT(flags.model.empty() || flags.model == uri, ErrorCode::kInvalidArgument,
              command + ": the URI '" + uri + "' and --model '" + flags.model + "' disagree: give one of them");
    flags.model = uri;
  }
  WS_EXPECT(!flags.share_embeddings || (flags.speculative == "mtp" && !flags.draft_only), ErrorCode::kInvalidArgument,
            "--share-embeddings needs --speculative mtp and the target (not --draft-only)");
  return flags;
}

void allocate_modules(std::vector<ModuleSetup>& modules, const DraftFlags& flags, const Device& device) {
  for (ModuleSetup& module : modules) {
    if (module.role == ModuleRole::kDraft && flags.share_embeddings) share_target_embeddings(module.layout, modules[0].layout);
    module.layout.allocate(device);
    for (auto& hook : engine_hooks(module.layout, module.config.config)) module.layout.add_hook(std::move(hook));
  }
}

std::vector<ModuleSetup> ready_modules(const DraftFlags& flags, const Options& options,
                                       const LayoutOptions& layout_options, const Device& device) {
  std::vector<ModuleSetup> modules = setup_modules(flags, options, layout_options, !flags.draft_only);
  std::vector<SourceResolution> resolutions;
  for (const ModuleSetup& module : modules) resolutions.push_back(module.resolution);
  expect_resolved(resolutions);
  // Storage exists before the load, as an engine's modules do; the draft may refer to the
  // target's embedding and head instead of holding copies.
  allocate_modules(modules, flags, device);
  return modules;
}

std::vector<ModuleLoadRequest> load_requests(std::vector<ModuleSetup>& modules) {
  std::vector<ModuleLoadRequest> requests;
  for (ModuleSetup& module : modules) requests.push_back({module.role, &module.layout, module.resolution});
  return requests;
}

nlohmann::json resolution_json(const SourceResolution& resolution) {
  nlohmann::json candidates = nlohmann::json::array();
  nlohmann::json passed_over = nlohmann::json::array();
  for (const SourceCandidate& candidate : resolution.candidates) {
    candidates.push_back({{"field", candidate.field},
                          {"uri", candidate.uri.empty() ? nlohmann::json() : nlohmann::json(candidate.uri)},
                          {"chosen", candidate.reason.empty()},
                          {"reason", candidate.reason}});
    if (!candidate.reason.empty()) passed_over.push_back(candidate.text());
  }
  nlohmann::json result = {{"module", resolution.module_text()}, {"candidates", candidates}, {"passed_over", passed_over}};
  if (resolution.found()) {
    result["source"] = resolution.chosen().uri;
    result["field"] = resolution.chosen().field;
    result["shards"] = resolution.chosen().shards;
  } else {
    result["source"] = nullptr;
    result["error"] = resolution.error_text();
  }
  return result;
}

LoadRecord run_draft_load(const std::string& uri, const DraftFlags& given, const LayoutOptions& layout_options,
                          const std::string& device_name, const StreamFlags& stream_flags, bool json,
                          const ProgressCallback& observer) {
  DraftFlags flags = with_target_uri("load", uri, given);
  Options options = resolve_options(stream_flags);
  Device device = parse_device(device_name);
  std::vector<ModuleSetup> modules = ready_modules(flags, options, layout_options, device);
  std::vector<ModuleLoadRequest> requests = load_requests(modules);
  std::vector<StrategyLoad> loads;
  {
    ProgressLine progress(progress_enabled(stream_flags, options) && !json, observer);
    loads = load_modules(requests, LoadMode::kCold, options, StrategyChain::standard(),
                         [&progress](uint64_t done, uint64_t total) { progress.update(done, total); });
  }

  nlohmann::json report = {{"device", device.name()}, {"streams", loads.size()}};
  uint64_t bytes_read = 0, shards_read = 0;
  double seconds = 0;
  LoadRecord record;
  for (const StrategyLoad& load : loads) {
    bytes_read += load.stream.bytes_read;
    shards_read += load.stream.shards_read;
    seconds += load.stream.seconds;
    add_to_record(record, load);
    for (const ModuleLoad& module_load : load.modules) {
      for (const ModuleSetup& module : modules) {
        if (module.role == module_load.role) report[std::string(module_role_name(module.role))] = module_load_json(module, module_load);
      }
    }
  }
  report["bytes_read"] = bytes_read;
  report["shards_read"] = shards_read;
  report["seconds"] = seconds;
  if (json) {
    print_json(report);
    return record;
  }
  for (const ModuleSetup& module : modules) {
    const nlohmann::json& entry = report[std::string(module_role_name(module.role))];
    std::printf("%s: %s from %s (%s, %s), %s read from %s\n", module.resolution.module_text().c_str(),
                counted(entry["tensors"].get<uint64_t>(), "tensor").c_str(), entry["source"].get<std::string>().c_str(),
                entry["field"].get<std::string>().c_str(), entry["strategy"].get<std::string>().c_str(),
                format_size(entry["bytes_read"].get<uint64_t>()).c_str(),
                counted(entry["shards_read"].get<uint64_t>(), "shard").c_str());
  }
  std::printf("read %s in %.3f s in %s to %s\n", format_size(bytes_read).c_str(), seconds,
              counted(loads.size(), "stream").c_str(), device.name().c_str());
  return record;
}

}  // namespace weightstream::cli
