// What an update receiver checks before anything of an update lands (update_checks.hpp).
#include "update/update_checks.hpp"

#include <string>
#include <unordered_set>
#include <utility>

#include "base/text.hpp"
#include "update/delta.hpp"
#include "weightstream/error.hpp"

namespace weightstream::transfer {
namespace {

/// Stands for a delta entry's changed elements in checks made before they are decoded.
const std::shared_ptr<const ChangedElements> kUndecoded = std::make_shared<const ChangedElements>();

bool is_float(Dtype dtype) { return dtype == Dtype::kBF16 || dtype == Dtype::kF16 || dtype == Dtype::kF32; }

}  // namespace

std::vector<TensorView> bucket_views(const BucketManifest& manifest, const std::byte* slot,
                                     const ReceiverTransport& transport) {
  std::vector<TensorView> views;
  views.reserve(manifest.entries.size());
  for (const BucketEntry& entry : manifest.entries) {
    TensorView view{.name = entry.name,
                    .dtype = entry.dtype,
                    .shape = entry.shape,
                    .device = transport.device(),
                    .offset = entry.tensor_offset,
                    .bytes = entry.bytes};
    if (entry.encoding == EntryEncoding::kChangedElements) {
      // The whole tensor, as changed elements decoded once the bucket's bytes are here.
      view.bytes = tensor_byte_size(entry.dtype, entry.shape).value_or(0);  // the parser checked it
      view.changes = kUndecoded;
    } else if (entry.source == 0) {
      view.data = slot + entry.source_offset;
      view.lifetime = SourceLifetime::kSettle;
    } else {
      auto at_text = [&] {
        return "tensor " + entry.name + " (entry of bucket " + std::to_string(manifest.index) + ")";
      };
      std::span<const std::byte> region = transport.region(entry.source - 1);
      WS_EXPECT(!region.empty(), ErrorCode::kProtocol,
                at_text() + " is in shared region " + std::to_string(entry.source - 1) + ", which was never shared");
      WS_EXPECT(entry.source_offset <= region.size() && entry.bytes <= region.size() - entry.source_offset,
                ErrorCode::kProtocol,
                at_text() + ": bytes " + std::to_string(entry.source_offset) + "+" + std::to_string(entry.bytes) +
                    " lie outside shared region " + std::to_string(entry.source - 1) + " of " +
                    std::to_string(region.size()) + " bytes");
      view.data = region.data() + entry.source_offset;
      view.lifetime = SourceLifetime::kLoad;
    }
    views.push_back(view);
  }
  return views;
}

void decode_changes(const BucketManifest& manifest, const std::byte* slot, std::vector<TensorView>& views) {
  for (size_t i = 0; i < manifest.entries.size(); ++i) {
    const BucketEntry& entry = manifest.entries[i];
    if (entry.encoding != EntryEncoding::kChangedElements) continue;
    const uint64_t element = dtype_bits(entry.dtype) / 8;
    WS_EXPECT(element > 0, ErrorCode::kProtocol,
              "tensor " + entry.name + " (bucket " + std::to_string(manifest.index) + ") arrives as changed elements of " +
                  std::string(dtype_name(entry.dtype)) + ", which has no whole-byte element");
    views[i].changes = std::make_shared<const ChangedElements>(decode_changed_elements(
        std::span(slot + entry.source_offset, entry.bytes), element, views[i].bytes / element,
        "tensor " + entry.name + " (bucket " + std::to_string(manifest.index) + ")"));
  }
}

uint64_t ManifestLedger::account(const BucketManifest& manifest, std::span<const DeclaredTensor> declared, bool delta) {
  uint64_t changed = 0;
  const std::string bucket = "bucket " + std::to_string(manifest.index);
  for (const BucketEntry& entry : manifest.entries) {
    auto found = index.find(entry.name);
    WS_EXPECT(found != index.end(), ErrorCode::kProtocol,
              bucket + " carries tensor " + entry.name + ", which the update's manifest does not declare");
    const DeclaredTensor& tensor = declared[found->second];
    WS_EXPECT(entry.dtype == tensor.dtype && entry.shape == tensor.shape, ErrorCode::kProtocol,
              bucket + " carries tensor " + entry.name + " as " + std::string(dtype_name(entry.dtype)) + " " +
                  shape_text(entry.shape) + ", but the update's manifest declares it " +
                  std::string(dtype_name(tensor.dtype)) + " " + shape_text(tensor.shape));
    uint64_t& arrived = received[found->second];
    if (entry.encoding == EntryEncoding::kBytes) {
      arrived += entry.bytes;
      continue;
    }
    WS_EXPECT(delta, ErrorCode::kProtocol,
              bucket + " carries changed elements of tensor " + entry.name + " in a full update");
    WS_EXPECT(arrived == 0, ErrorCode::kProtocol,
              bucket + " carries changed elements of tensor " + entry.name + " after " + std::to_string(arrived) +
                  " bytes of it");
    arrived = bytes[found->second];
    sent_as_changes[found->second] = true;
    ++changed;
  }
  return changed;
}

namespace {

/// The problems found in a manifest, each once, in the order found.
struct Problems {
  std::vector<std::string> list;
  std::unordered_set<std::string> seen;
  void add(std::string text) {
    if (seen.insert(text).second) list.push_back(std::move(text));
  }
};

/// FP8 block-scaled weights sent as codes are declared with their block scales, and scales
/// with their codes; a BF16, F16 or F32 weight quantized here comes alone. `fits`: the
/// declared tensors the session took.
void check_block_scales(const ModelLayout& layout, TensorFormat format, std::span<const DeclaredTensor> manifest,
                        const ManifestLedger& ledger, const std::vector<bool>& fits, Problems& found) {
  auto problem = [&](std::string text) { found.add(std::move(text)); };
  // FP8 block-scaled weights: the scale parameter of each, and the weight of each scale.
  std::unordered_map<size_t, size_t> weight_of_scale;
  for (size_t p = 0; p < layout.parameters().size(); ++p) {
    const Parameter& parameter = layout.parameters()[p];
    if (parameter.block_scale.empty()) continue;
    if (auto scale = layout.find(parameter.block_scale)) weight_of_scale.emplace(*scale, p);
  }
  // What names a parameter's part in this format: its checkpoint tensor, or the parameter.
  auto name_of = [&](size_t p, size_t part) -> const std::string& {
    const Parameter& parameter = layout.parameters()[p];
    return format == TensorFormat::kEngine || part >= parameter.parts.size() ? parameter.name
                                                                              : parameter.parts[part].tensor;
  };
  const std::string how = ": send an FP8 weight with its weight_scale_inv, or a BF16, F16 or F32 weight alone "
                          "(quantized here)";
  for (size_t i = 0; i < manifest.size() && !weight_of_scale.empty(); ++i) {
    const DeclaredTensor& tensor = manifest[i];
    if (!fits[i] || ledger.index.at(tensor.name) != i) continue;
    std::vector<std::pair<size_t, size_t>> targets;
    if (format == TensorFormat::kEngine) {
      if (auto p = layout.find(tensor.name)) targets.push_back({*p, 0});
    } else {
      TensorRoute route = layout.route(tensor.name);
      if (route.kind == TensorRoute::Kind::kParameter) targets = std::move(route.targets);
    }
    for (const auto& [p, part] : targets) {
      const Parameter& parameter = layout.parameters()[p];
      if (!parameter.block_scale.empty()) {
        auto scale = layout.find(parameter.block_scale);
        if (!scale) continue;
        const std::string& scale_name = name_of(*scale, part);
        const bool declared = ledger.index.contains(scale_name);
        if (!is_float(tensor.dtype) && !declared) {
          problem("FP8 weight " + tensor.name + " is declared as " + std::string(dtype_name(tensor.dtype)) +
                  " codes without its block scales " + scale_name + how);
        } else if (is_float(tensor.dtype) && declared) {
          problem("weight " + tensor.name + " is declared as " + std::string(dtype_name(tensor.dtype)) +
                  " to be quantized here, beside its block scales " + scale_name + how);
        }
      } else if (auto weight = weight_of_scale.find(p); weight != weight_of_scale.end()) {
        const std::string& weight_name = name_of(weight->second, part);
        if (!ledger.index.contains(weight_name)) {
          problem("block scales " + tensor.name + " are declared without their FP8 weight " + weight_name + how);
        }
      }
    }
  }
}

}  // namespace

ManifestLedger check_manifest(const ModelLayout& layout, const LoadSession& session, TensorFormat format,
                              std::span<const DeclaredTensor> manifest, bool delta) {
  ManifestLedger ledger;
  ledger.index.reserve(manifest.size());
  ledger.bytes.reserve(manifest.size());
  ledger.received.assign(manifest.size(), 0);
  ledger.sent_as_changes.assign(manifest.size(), false);
  Problems found;
  auto problem = [&](std::string text) { found.add(std::move(text)); };
  const std::vector<std::string>& problems = found.list;
  std::vector<TensorView> views;
  views.reserve(manifest.size());
  for (size_t i = 0; i < manifest.size(); ++i) {
    const DeclaredTensor& tensor = manifest[i];
    ledger.bytes.push_back(tensor_byte_size(tensor.dtype, tensor.shape).value_or(0));  // the parser checked it
    if (!ledger.index.try_emplace(tensor.name, i).second) {
      problem("tensor " + tensor.name + " is declared twice");
      continue;
    }
    views.push_back({.name = tensor.name, .dtype = tensor.dtype, .shape = tensor.shape});
    if (delta) {
      // Any tensor of a delta may come as changed elements: each is checked as one.
      views.back().bytes = ledger.bytes.back();
      views.back().changes = kUndecoded;
    }
  }
  // One call for the whole manifest; only a refused one is checked again tensor by tensor,
  // to name every problem.
  std::vector<bool> fits(manifest.size(), true);
  try {
    session.check(views);
  } catch (const Error& whole) {
    const size_t before = problems.size();
    for (const TensorView& view : views) {
      try {
        session.check(std::span<const TensorView>(&view, 1));
      } catch (const Error& error) {
        problem(error.what());
        fits[ledger.index.at(view.name)] = false;
      }
    }
    if (problems.size() == before) problem(whole.what());
  }
  check_block_scales(layout, format, manifest, ledger, fits, found);
  if (problems.empty()) return ledger;
  std::string text = "the update's manifest of " + std::to_string(manifest.size()) + " tensor" +
                     (manifest.size() == 1 ? "" : "s") + " does not fit " + layout.description() + " (" +
                     std::to_string(problems.size()) + " problem" + (problems.size() == 1 ? "" : "s") +
                     "; nothing of it was applied): ";
  for (size_t i = 0; i < problems.size() && i < kProblemsListed; ++i) text += (i ? "; " : "") + problems[i];
  if (problems.size() > kProblemsListed) text += "; and " + std::to_string(problems.size() - kProblemsListed) + " more";
  WS_FAIL(ErrorCode::kModel, text);
}

}  // namespace weightstream::transfer
