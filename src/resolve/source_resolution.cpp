// Source resolution: which of model_weights, model and the checkpoint URI holds a module's
// weights. Each candidate is probed cheaply (a listing, and the index when there is one) and
// every candidate passed over keeps its reason, so that the error, when nothing serves,
// names all of them instead of the last cause only.
#include <algorithm>
#include <set>

#include "resolve/source_probe.hpp"
#include "weightstream/error.hpp"
#include "weightstream/resolve.hpp"

namespace weightstream {
namespace {

using resolve::join;

constexpr std::string_view kConfigFileName = "config.json";
constexpr uint64_t kMaxConfigBytes = 16 * kMiB;
constexpr uint64_t kMaxIndexBytes = 256 * kMiB;

/// The candidates of a module in the order they are tried.
std::vector<SourceCandidate> ordered_candidates(const ModelSource& source, const Options& options) {
  return {{"model_weights", source.model_weights, {}, {}, {}},
          {"model", source.model, {}, {}, {}},
          {checkpoint_uri_field(options), options.model_uri, {}, {}, {}}};
}

/// The checkpoint of `uri` that one of `resolutions` opened while probing, or null.
std::shared_ptr<const Checkpoint> opened_by(const std::vector<SourceResolution>& resolutions, const std::string& uri) {
  for (const SourceResolution& resolution : resolutions) {
    for (const SourceCandidate& candidate : resolution.candidates) {
      if (candidate.uri == uri && candidate.checkpoint) return candidate.checkpoint;
    }
  }
  return nullptr;
}

}  // namespace

namespace resolve {

SourceListing list_source(const std::string& uri, const Options& options, bool read_index) {
  SourceListing listing;
  listing.storage = std::shared_ptr<Storage>(open_storage(parse_uri(uri), options, &listing.object));
  if (!listing.object.empty()) {
    // A URI naming one object: a single-file checkpoint when it is a safetensors file.
    if (listing.object.ends_with(".safetensors")) listing.safetensors.push_back(listing.object);
    return listing;
  }
  for (const ObjectInfo& object : listing.storage->list()) {
    if (object.name == kIndexFileName) listing.has_index = true;
    else if (object.name == kConfigFileName) listing.has_config = true;
    else if (object.name.ends_with(".safetensors")) listing.safetensors.push_back(object.name);
  }
  std::sort(listing.safetensors.begin(), listing.safetensors.end(),
            [](const std::string& a, const std::string& b) { return natural_less(a, b); });
  if (listing.has_index && read_index) {
    std::string text = read_object(*listing.storage, kIndexFileName, kMaxIndexBytes);
    listing.index = parse_checkpoint_index(listing.storage->object_uri(kIndexFileName), text);
  }
  return listing;
}

namespace {

std::vector<std::string> in_natural_order(const std::set<std::string>& shards) {
  std::vector<std::string> result(shards.begin(), shards.end());
  std::sort(result.begin(), result.end(), [](const std::string& a, const std::string& b) { return natural_less(a, b); });
  return result;
}

}  // namespace

std::vector<std::string> shards_holding(const Checkpoint& checkpoint, const ModelLayout& layout) {
  std::set<std::string> shards;
  for (const std::string& tensor : layout.wanted_tensors()) {
    if (auto index = checkpoint.find(tensor)) shards.insert(checkpoint.shards()[checkpoint.tensors()[*index].shard].name);
  }
  return in_natural_order(shards);
}

std::vector<std::string> wanted_shards(const SourceListing& listing, const ModelLayout& layout,
                                       const Options& options, std::optional<Checkpoint>* opened) {
  if (!listing.index) {
    // Without an index, only the shards' headers tell which tensors they hold.
    Checkpoint checkpoint = Checkpoint::open(listing.storage, listing.object);
    std::vector<std::string> shards = shards_holding(checkpoint, layout);
    if (opened) *opened = std::move(checkpoint);
    return shards;
  }
  std::set<std::string> shards;
  for (const std::string& tensor : layout.wanted_tensors()) {
    auto it = listing.index->weight_map.find(tensor);
    if (it != listing.index->weight_map.end()) shards.insert(it->second);
  }
  return in_natural_order(shards);
}

}  // namespace resolve

std::string checkpoint_uri_field(const Options& options) {
  if (options.model_uri.empty()) return "WEIGHTSTREAM_MODEL_URI";
  return options.model_uri_origin.empty() ? std::string(kModelUriOption) : options.model_uri_origin;
}

std::string_view module_role_name(ModuleRole role) noexcept {
  return role == ModuleRole::kDraft ? "draft" : "target";
}

std::string SourceCandidate::text() const {
  std::string head = uri.empty() ? field : field + " " + uri;
  return head + ": " + (reason.empty() ? "chosen" : reason);
}

const SourceCandidate& SourceResolution::chosen() const {
  WS_EXPECT(found(), ErrorCode::kNotFound, error_text());
  return candidates.back();
}

std::string SourceResolution::module_text() const {
  if (role == ModuleRole::kTarget) return "the target";
  return "the draft" + (method.empty() ? std::string() : " (" + method + ")");
}

std::string SourceResolution::error_text() const {
  std::vector<std::string> reasons;
  for (const SourceCandidate& candidate : candidates) reasons.push_back(candidate.text());
  return "Cannot find any safetensors model weights for " + module_text() + ": " + join(reasons, "; ");
}

SourceResolution resolve_source(const ModelSource& source, ModuleRole role, const ModelLayout& layout,
                                const Options& options, std::string method, const std::vector<SourceResolution>& earlier,
                                SourceProbe probe) {
  SourceResolution resolution;
  resolution.role = role;
  resolution.method = std::move(method);
  const std::string wants = "no tensor the " + std::string(module_role_name(role)) + " wants";
  for (SourceCandidate& candidate : ordered_candidates(source, options)) {
    if (candidate.uri.empty()) {
      candidate.reason = "not set";
    } else if (std::shared_ptr<const Checkpoint> opened = opened_by(earlier, candidate.uri)) {
      candidate.shards = resolve::shards_holding(*opened, layout);
      if (candidate.shards.empty()) candidate.reason = wants;
      else candidate.checkpoint = std::move(opened);
    } else {
      try {
        // Without the index, wanted_shards opens the checkpoint: its headers say it all.
        resolve::SourceListing listing = resolve::list_source(candidate.uri, options, probe == SourceProbe::kIndex);
        if (listing.safetensors.empty() && !listing.has_index) {
          candidate.reason = "no *.safetensors files";
        } else {
          std::optional<Checkpoint> opened;
          candidate.shards = resolve::wanted_shards(listing, layout, options, &opened);
          if (candidate.shards.empty()) candidate.reason = wants + (listing.index ? " (per its index)" : "");
          else if (opened) candidate.checkpoint = std::make_shared<const Checkpoint>(std::move(*opened));
        }
      } catch (const Error& error) {
        candidate.reason = "cannot open: " + std::string(error.what());
      }
    }
    resolution.candidates.push_back(std::move(candidate));
    if (resolution.found()) break;
  }
  return resolution;
}

void expect_resolved(const std::vector<SourceResolution>& resolutions) {
  std::vector<std::string> errors;
  for (const SourceResolution& resolution : resolutions) {
    if (!resolution.found()) errors.push_back(resolution.error_text());
  }
  WS_EXPECT(errors.empty(), ErrorCode::kNotFound, join(errors, ". "));
}

ModelConfigSource find_model_config(const ModelSource& source, const Options& options) {
  // The config describes the model, so `model` is asked first, then the weights.
  std::vector<SourceCandidate> candidates = ordered_candidates(source, options);
  std::swap(candidates[0], candidates[1]);
  std::vector<std::string> reasons;
  for (SourceCandidate& candidate : candidates) {
    if (candidate.uri.empty()) {
      candidate.reason = "not set";
    } else {
      try {
        resolve::SourceListing listing = resolve::list_source(candidate.uri, options);
        if (listing.has_config) {
          std::string uri = listing.storage->object_uri(kConfigFileName);
          std::string text = read_object(*listing.storage, kConfigFileName, kMaxConfigBytes);
          return {parse_model_config(uri, text), candidate.uri, candidate.field};
        }
        candidate.reason = "no config.json";
      } catch (const Error& error) {
        if (error.code() == ErrorCode::kFormat) throw;  // a config that is there but broken is its own error
        candidate.reason = "cannot open: " + std::string(error.what());
      }
    }
    reasons.push_back(candidate.text());
  }
  WS_FAIL(ErrorCode::kNotFound, "Cannot find the model's config.json: " + join(reasons, "; "));
}

ModelLayout build_module_layout(const ModelConfig& config, ModuleRole role, LayoutOptions options) {
  options.modules = role == ModuleRole::kDraft ? LayoutModules::kDraft : LayoutModules::kTarget;
  if (role == ModuleRole::kDraft) {
    const Architecture* architecture = find_architecture(config.model_type);
    bool mtp_architecture = architecture != nullptr && architecture->mtp != MtpPlacement::kNone;
    std::string mtp_families;
    for (const Architecture& family : architectures()) {
      if (family.mtp != MtpPlacement::kNone) mtp_families += (mtp_families.empty() ? "" : ", ") + std::string(family.model_type);
    }
    WS_EXPECT(mtp_layer_count(config) > 0, ErrorCode::kModel,
              "speculative method mtp: the " + config.model_type + " config declares no MTP layers (" +
                  (mtp_architecture ? std::string("num_nextn_predict_layers is 0") +
                                          (architecture->mtp == MtpPlacement::kMtpModule
                                               ? " or absent, mtp_num_hidden_layers too"
                                               : "")
                                    : "MTP layers are supported for " + mtp_families) +
                  ")");
  }
  return build_model_layout(config, options);
}

std::vector<std::string> share_target_embeddings(ModelLayout& draft, const ModelLayout& target) {
  std::vector<std::string> shared;
  for (size_t index = 0; index < draft.parameters().size(); ++index) {
    const Parameter& parameter = draft.parameters()[index];
    if (draft.layer_kind(parameter.layer) != LayerKind::kMtp) continue;
    std::string prefix = "model.layers." + std::to_string(parameter.layer) + ".";
    std::string owner;
    if (parameter.name == prefix + "embed_tokens.weight") owner = "model.embed_tokens.weight";
    else if (parameter.name == prefix + "shared_head.head.weight") owner = "lm_head.weight";
    else continue;
    const Parameter& owned = target.parameter(owner);
    std::string name = parameter.name;
    draft.share_storage(name, owned, "shared with the target's " + owner + " by reference");
    shared.push_back(std::move(name));
  }
  return shared;
}

}  // namespace weightstream
