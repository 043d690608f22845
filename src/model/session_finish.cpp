// The steps of LoadSession::finish(): refuse after a failed batch, refuse tensors that
// arrived in part, write what is still held, check completeness, process the remaining
// layers. LoadSession::finish() (session.cpp) runs them and then the model hooks, once.
#include <map>

#include "base/text.hpp"
#include "model/session_state.hpp"

namespace weightstream {

using namespace model;  // the session's internal pieces (piece_write.hpp)
using detail::join;

namespace {

/// At most this many tensors are named in an error about tensors that arrived in part.
constexpr size_t kMostNamedPartialTensors = 10;

}  // namespace

void LoadSession::State::refuse_finish_after_failure(const std::string& what) {
  active = false;
  for (auto& [layer, layer_state] : layers) layer_state.held.clear();
  try {
    settle();
  } catch (const Error&) {
    // The batch's error is the one the caller sees.
  }
  release_held_bytes();
  std::string state_text = failure->wrote ? "" : "nothing of that batch was written; ";
  if (commit == LayerCommit::kWholeLayer) {
    state_text += "layers not completed before the failure keep their old values";
  } else if (failure->wrote) {
    state_text += "the layers it was writing may hold a mix of old and new values (commit per layer, "
                  "LayerCommit::kWholeLayer, keeps unfinished layers as they were)";
  } else {
    state_text += "tensors of earlier batches were written";
  }
  WS_FAIL(failure->code, "cannot finish the " + what + ": a batch failed (" + failure->message + "); " + state_text +
                             "; begin() a new load");
}

void LoadSession::State::expect_no_partial_tensors(const std::string& what) {
  std::vector<std::string> partial;
  for (size_t i = 0; i < layout.parameters().size(); ++i) {
    const Parameter& parameter = layout.parameters()[i];
    const ParameterState& parameter_state = parameters[i];
    if (format == TensorFormat::kEngine) {
      if (parameter_state.engine_received > 0 && parameter_state.engine_received < parameter.bytes()) {
        partial.push_back(parameter.name + " (" + std::to_string(parameter_state.engine_received) + " of " +
                          std::to_string(parameter.bytes()) + " bytes)");
      }
      continue;
    }
    for (size_t p = 0; p < parameter.parts.size(); ++p) {
      const PartState& part_state = parameter_state.parts[p];
      if (part_state.received == 0 || part_state.complete) continue;
      const ParameterPart& part = parameter.parts[p];
      uint64_t needed = slice_bytes(part, element_bytes(part_state.dtype.value_or(parameter.load_dtype)));
      partial.push_back(part.tensor + " (" + std::to_string(part_state.received) + " of the " +
                        std::to_string(needed) + " bytes " + parameter.name + " needs)");
    }
  }
  if (partial.empty()) return;
  active = false;
  for (auto& [layer, layer_state] : layers) layer_state.held.clear();
  release_held_bytes();
  size_t count = partial.size();
  if (partial.size() > kMostNamedPartialTensors) partial.resize(kMostNamedPartialTensors);
  WS_FAIL(ErrorCode::kModel, what + ": " + std::to_string(count) + " tensor" + (count == 1 ? "" : "s") +
                                 " arrived in part (a load may leave out a tensor, not part of one): " +
                                 join(partial, ", "));
}

void LoadSession::State::write_remaining_held() {
  std::vector<Held> rest;
  for (auto& [layer, layer_state] : layers) {
    for (Held& held : layer_state.held) rest.push_back(std::move(held));
    layer_state.held.clear();
  }
  try {
    std::vector<Write> writes;
    for (Held& held : rest) {
      if (held.copied.valid()) held.copied.get();  // made by a load() call that has returned
      writes.push_back(held.write);
    }
    if (format == TensorFormat::kCheckpoint) {
      for (const Write& write : writes) write_checkpoint(write);
    } else {
      write_engine(writes);
    }
    writes.clear();
    rest.clear();
    settle();
  } catch (const Error&) {
    active = false;
    throw;
  }
}

void LoadSession::State::expect_complete(LoadMode mode, const std::string& what) {
  std::map<int64_t, std::vector<std::string>> missing;
  for (size_t i = 0; i < layout.parameters().size(); ++i) {
    const Parameter& parameter = layout.parameters()[i];
    const ParameterState& parameter_state = parameters[i];
    bool filled = format == TensorFormat::kEngine || !parameter.parts.empty();
    if (!filled || parameter_state.complete) continue;
    bool required = mode == LoadMode::kCold ||
                    (parameter.processing != Processing::kNone && parameter_state.touched &&
                     format == TensorFormat::kCheckpoint);
    if (!required) continue;
    std::vector<std::string> parts;
    for (size_t p = 0; p < parameter.parts.size(); ++p) {
      if (!parameter_state.parts[p].complete && parameter_state.touched) parts.push_back(parameter.parts[p].tensor);
    }
    missing[parameter.layer].push_back(parameter.name + (parts.empty() ? "" : " (missing " + join(parts, ", ") + ")"));
  }
  if (missing.empty()) return;
  std::vector<std::string> groups;
  for (const auto& [layer, names] : missing) {
    groups.push_back(layer_label(layout, layer) + " weights missing: " + join(names, ", "));
  }
  active = false;
  WS_FAIL(ErrorCode::kModel,
          mode == LoadMode::kCold
              ? what + " is incomplete: " + join(groups, "; ")
              : what + ": FP8-processed parameters need every part in checkpoint format to be requantized: " +
                    join(groups, "; "));
}

void LoadSession::State::process_remaining_layers() {
  for (auto& [layer, layer_state] : layers) {
    if (format == TensorFormat::kCheckpoint && !layer_state.processed) process_layer(layer);
  }
  writer->wait();
  release_held_bytes();
}

}  // namespace weightstream
