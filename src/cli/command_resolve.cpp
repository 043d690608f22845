// weightstream resolve [--model M] [--model-weights W] [--draft-model M2] [--draft-model-weights W2]
//                      [--speculative mtp] [--json]
// Prints, for the target and the draft, the source chosen and why each earlier one was
// passed over; fails with the one error that names every source when a module has none.
#include <cstdio>

#include "cli/draft_flags.hpp"
#include "weightstream/error.hpp"

namespace weightstream::cli {

void add_resolve_command(CLI::App& app) {
  struct ResolveFlags {
    DraftFlags sources;
    bool json = false;
  };
  auto flags = std::make_shared<ResolveFlags>();
  auto* command = app.add_subcommand(
      "resolve", "Show where the target's (and the draft's) weights come from, and why earlier sources were passed over");
  add_model_source_flags(*command, flags->sources);
  command->add_flag("--json", flags->json, "Print JSON: per module, the source chosen and every candidate's reason");
  command->callback([flags] {
    Options options = environment_options();
    if (!flags->sources.requested() && options.model_uri.empty()) {
      WS_FAIL(ErrorCode::kInvalidArgument,
              "resolve: nothing to resolve: give --model or --model-weights, or set WEIGHTSTREAM_MODEL_URI");
    }
    std::vector<ModuleSetup> modules = setup_modules(flags->sources, options, {}, true);
    nlohmann::json report = nlohmann::json::object();
    std::vector<SourceResolution> resolutions;
    for (const ModuleSetup& module : modules) {
      nlohmann::json entry = resolution_json(module.resolution);
      entry["config"] = module.config.uri;
      report[std::string(module_role_name(module.role))] = entry;
      resolutions.push_back(module.resolution);
    }
    if (flags->json) {
      print_json(report);
    } else {
      for (const ModuleSetup& module : modules) {
        const SourceResolution& resolution = module.resolution;
        std::string passed_over;
        for (const SourceCandidate& candidate : resolution.candidates) {
          if (!candidate.reason.empty()) passed_over += (passed_over.empty() ? "" : "; ") + candidate.text();
        }
        if (resolution.found()) {
          std::printf("%s: %s (%s)%s%s\n", resolution.module_text().c_str(), resolution.chosen().uri.c_str(),
                      resolution.chosen().field.c_str(), passed_over.empty() ? "" : "; passed over: ",
                      passed_over.c_str());
        } else {
          std::printf("%s: none; %s\n", resolution.module_text().c_str(), passed_over.c_str());
        }
      }
    }
    std::fflush(stdout);
    expect_resolved(resolutions);
  });
}

}  // namespace weightstream::cli
