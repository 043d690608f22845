// weightstream._core: source resolution for engines' loaders in Python (the vLLM model
// loader resolves its draft's weights exactly as `weightstream resolve` does).
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bindings.hpp"
#include "weightstream/error.hpp"
#include "weightstream/resolve.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace weightstream::python {
namespace {

ModuleRole parse_role(const std::string& text) {
  if (text == "target") return ModuleRole::kTarget;
  if (text == "draft") return ModuleRole::kDraft;
  WS_FAIL(ErrorCode::kInvalidArgument, "module role '" + text + "' is not one of target, draft");
}

/// Resolves one module's source; raises weightstream.Error (not_found) naming every
/// candidate passed over when none holds a tensor the layout wants. With `open_checkpoint`
/// the chosen source's checkpoint is opened by resolution itself (its index and headers read
/// once) and returned as "checkpoint", for a loader that streams it. `opened` is (uri,
/// Checkpoint) of a source the caller opened already (ahead of resolution): when resolution
/// chooses that source it takes that checkpoint instead of opening it again.
nb::dict resolve_module_source(const std::string& model, const std::string& model_weights, const std::string& role,
                               nb::handle layout, const std::string& method, const std::string& model_uri,
                               nb::dict overrides, bool open_checkpoint, nb::handle opened) {
  Options options = resolve_options(environment_options(), overrides);
  if (!model_uri.empty()) {
    options.model_uri = model_uri;
    options.model_uri_origin = std::string(kModelUriOption);
  }
  ModuleRole parsed = parse_role(role);
  const ModelLayout& module_layout = python_layout(layout);
  // What the caller opened goes in as an earlier resolution's candidate: resolve_source then
  // reuses it for that URI, after checking that it holds a tensor the layout wants.
  std::vector<SourceResolution> earlier;
  if (!opened.is_none()) {
    nb::tuple pair = nb::cast<nb::tuple>(opened);
    WS_EXPECT(pair.size() == 2, ErrorCode::kInvalidArgument, "resolve_source: opened is (uri, Checkpoint)");
    SourceCandidate candidate;
    candidate.uri = nb::cast<std::string>(pair[0]);
    candidate.checkpoint = nb::cast<const CheckpointHandle&>(pair[1]).shared();
    earlier.emplace_back().candidates.push_back(std::move(candidate));
  }
  SourceResolution resolution;
  {
    nb::gil_scoped_release release;
    resolution = resolve_source({model, model_weights}, parsed, module_layout, options, method, earlier,
                                open_checkpoint ? SourceProbe::kHeaders : SourceProbe::kIndex);
  }
  const SourceCandidate& chosen = resolution.chosen();  // throws the error naming every source
  std::vector<std::string> passed_over;
  for (const SourceCandidate& candidate : resolution.candidates) {
    if (&candidate != &chosen) passed_over.push_back(candidate.text());
  }
  nb::dict result;
  result["module"] = resolution.module_text();
  result["field"] = chosen.field;
  result["uri"] = chosen.uri;
  result["shards"] = chosen.shards;
  result["passed_over"] = passed_over;
  if (open_checkpoint) {
    std::shared_ptr<const Checkpoint> checkpoint = chosen.checkpoint;
    if (!checkpoint) {
      nb::gil_scoped_release release;
      checkpoint = std::make_shared<const Checkpoint>(Checkpoint::open(chosen.uri, options));
    }
    result["checkpoint"] = CheckpointHandle(std::move(checkpoint), options);
  }
  return result;
}

/// The checkpoint URI and how messages name it: `model_uri` when given ("model_uri option"),
/// else WEIGHTSTREAM_MODEL_URI or MX_MODEL_URI; ("", "WEIGHTSTREAM_MODEL_URI") when unset.
nb::tuple checkpoint_uri(const std::string& model_uri) {
  Options options = environment_options();
  if (!model_uri.empty()) {
    options.model_uri = model_uri;
    options.model_uri_origin = std::string(kModelUriOption);
  }
  return nb::make_tuple(options.model_uri, checkpoint_uri_field(options));
}

}  // namespace

void bind_resolve(nb::module_& m) {
  m.def("resolve_source", &resolve_module_source, "model"_a, "model_weights"_a, "role"_a, "layout"_a,
        "method"_a = "", "model_uri"_a = "", "options"_a = nb::dict(), "open_checkpoint"_a = false,
        "opened"_a = nb::none(),
        "Where a module's weights come from: model_weights, then model, then the checkpoint URI "
        "(model_uri, else WEIGHTSTREAM_MODEL_URI or MX_MODEL_URI). With open_checkpoint, the chosen "
        "source's Checkpoint, opened once, under \"checkpoint\"; opened: (uri, Checkpoint) of a source "
        "opened ahead, taken when it is chosen.");
  m.def("checkpoint_uri", &checkpoint_uri, "model_uri"_a = "",
        "(uri, label): the checkpoint URI a module falls back to and how messages name it.");
}

}  // namespace weightstream::python
