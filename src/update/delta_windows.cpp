// The windows of a delta update: what a receiver holds of each tensor and the digests both
// sides take of them (the runs of elements inside them: tensor_windows.cpp) (delta.hpp,
// docs/DELTA.md "Each rank's own elements" and "The check after a delta").
#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <memory>

#include "base/parallel.hpp"
#include "update/delta.hpp"
#include "weightstream/error.hpp"

namespace weightstream::transfer {
namespace {

/// XXH3 streaming state, freed on every path.
struct DigestState {
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state{XXH3_createState(), &XXH3_freeState};
  DigestState() {
    WS_EXPECT(state != nullptr, ErrorCode::kInternal, "cannot allocate a digest state");
    XXH3_64bits_reset(state.get());
  }
  void add(const std::byte* bytes, uint64_t size) { XXH3_64bits_update(state.get(), bytes, size); }
  uint64_t digest() const { return XXH3_64bits_digest(state.get()); }
};

/// Elements converted at a time where a parameter holds another dtype than its tensor.
constexpr uint64_t kConvertedElements = 1 << 16;

/// Tensors named in a failed check's message: the first ones, then how many more.
constexpr size_t kMismatchesListed = 20;

std::string hex_digest(uint64_t digest) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(digest));
  return text;
}

/// "model.layers.0.mlp.gate_up_proj.weight[up]" for each part `tensor` fills.
std::string held_in(const ModelLayout& layout, const std::string& tensor) {
  std::string text;
  for (const auto& [index, part] : layout.route(tensor).targets) {
    const Parameter& parameter = layout.parameters()[index];
    const std::string& id = parameter.parts[part].id;
    text += (text.empty() ? "" : ", ") + parameter.name + (id.empty() ? "" : "[" + id + "]");
  }
  return text.empty() ? "no parameter" : text;
}

}  // namespace

std::vector<std::vector<HeldWindow>> held_windows(const ModelLayout& layout, std::span<const DeclaredTensor> manifest) {
  std::vector<std::vector<HeldWindow>> held(manifest.size());
  for (size_t i = 0; i < manifest.size(); ++i) {
    const TensorRoute route = layout.route(manifest[i].name);
    if (route.kind != TensorRoute::Kind::kParameter) continue;
    for (const auto& [parameter, part_index] : route.targets) {
      const ParameterPart& part = layout.parameters()[parameter].parts[part_index];
      held[i].push_back({static_cast<uint64_t>(part.row_begin), static_cast<uint64_t>(part.rows),
                         static_cast<uint64_t>(part.column_begin), static_cast<uint64_t>(part.columns)});
    }
  }
  return held;
}

uint64_t windows_digest(std::span<const std::byte> tensor, uint64_t element_bytes, uint64_t columns,
                        std::span<const HeldWindow> windows) {
  DigestState digest;
  const uint64_t row_bytes = columns * element_bytes;
  for (const HeldWindow& window : windows) {
    const uint64_t first = window.row_begin * row_bytes + window.column_begin * element_bytes;
    const uint64_t last = (window.row_begin + window.rows) * row_bytes;
    WS_EXPECT(window.column_begin + window.columns <= columns && last <= tensor.size(), ErrorCode::kInvalidArgument,
              "a held window of rows " + std::to_string(window.row_begin) + "+" + std::to_string(window.rows) +
                  ", columns " + std::to_string(window.column_begin) + "+" + std::to_string(window.columns) +
                  " lies outside a tensor of " + std::to_string(tensor.size() / std::max<uint64_t>(row_bytes, 1)) +
                  " x " + std::to_string(columns));
    if (window.columns == columns) {
      digest.add(tensor.data() + first, window.rows * row_bytes);
      continue;
    }
    for (uint64_t row = 0; row < window.rows; ++row) {
      digest.add(tensor.data() + first + row * row_bytes, window.columns * element_bytes);
    }
  }
  return digest.digest();
}

uint64_t held_digest(const ModelLayout& layout, const DeclaredTensor& tensor) {
  DigestState digest;
  const TensorRoute route = layout.route(tensor.name);
  if (route.kind != TensorRoute::Kind::kParameter) return digest.digest();
  const uint64_t element = dtype_bits(tensor.dtype) / 8;
  std::vector<std::byte> converted;
  for (const auto& [index, part_index] : route.targets) {
    const Parameter& parameter = layout.parameters()[index];
    const ParameterPart& part = parameter.parts[part_index];
    WS_EXPECT(!parameter.device.is_cuda() && parameter.data != nullptr, ErrorCode::kUnsupported,
              "cannot check what parameter " + parameter.name + " holds of tensor " + tensor.name + ": it is on " +
                  parameter.device.name() + ", and a delta's check reads host parameters");
    const uint64_t held_element = dtype_bits(parameter.dtype) / 8;
    const std::byte* data = parameter.data + part.element_offset * held_element;
    if (parameter.dtype == tensor.dtype) {
      digest.add(data, part.elements() * element);
      continue;
    }
    // Held in another float dtype (F32 for a BF16 tensor): back to the tensor's, exactly.
    converted.resize(kConvertedElements * element);
    for (uint64_t done = 0; done < part.elements(); done += kConvertedElements) {
      const uint64_t count = std::min(kConvertedElements, part.elements() - done);
      convert_elements(converted.data(), tensor.dtype, data + done * held_element, parameter.dtype, count);
      digest.add(converted.data(), count * element);
    }
  }
  return digest.digest();
}

uint64_t check_held_digests(const ModelLayout& layout, std::span<const DeclaredTensor> manifest,
                            std::span<const std::pair<uint32_t, uint64_t>> digests,
                            const std::vector<bool>& sent_as_changes, const std::string& target, unsigned threads) {
  std::vector<bool> digested(manifest.size(), false);
  for (const auto& [index, digest] : digests) {
    WS_EXPECT(index < manifest.size(), ErrorCode::kProtocol,
              "FINISH carries a digest of tensor " + std::to_string(index) + ", past the manifest's " +
                  std::to_string(manifest.size()) + " tensors");
    digested[index] = true;
  }
  for (size_t i = 0; i < manifest.size() && i < sent_as_changes.size(); ++i) {
    WS_EXPECT(!sent_as_changes[i] || digested[i], ErrorCode::kProtocol,
              "FINISH carries no digest of tensor " + manifest[i].name +
                  ", which arrived as changed elements: what this receiver holds of it cannot be checked");
  }
  std::vector<uint64_t> held(digests.size());
  detail::run_parallel(digests.size(), std::max(1u, threads), [&](size_t, size_t item) {
    held[item] = held_digest(layout, manifest[digests[item].first]);
  });
  std::vector<std::string> mismatches;
  for (size_t item = 0; item < digests.size(); ++item) {
    if (held[item] == digests[item].second) continue;
    const std::string& name = manifest[digests[item].first].name;
    mismatches.push_back("tensor " + name + " in " + held_in(layout, name) + " (its elements here hash to " +
                         hex_digest(held[item]) + ", the target's to " + hex_digest(digests[item].second) + ")");
  }
  if (mismatches.empty()) return digests.size();
  std::string listed;
  for (size_t i = 0; i < mismatches.size() && i < kMismatchesListed; ++i) listed += (i ? "; " : "") + mismatches[i];
  if (mismatches.size() > kMismatchesListed) {
    listed += "; and " + std::to_string(mismatches.size() - kMismatchesListed) + " more";
  }
  WS_FAIL(ErrorCode::kModel,
          "the delta landed, but what " + layout.description() + " now holds differs from the version the sender named (" +
              (target.empty() ? std::string("unnamed") : target) + ") in " + std::to_string(mismatches.size()) + " of " +
              std::to_string(digests.size()) + " tensors checked: " + listed +
              ". Every byte of the delta was written and the model hooks ran: those parameters hold the delta applied "
              "over what they held before, which was not the delta's base; this receiver's version is now unknown: "
              "send a full update");
}

}  // namespace weightstream::transfer
