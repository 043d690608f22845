// Steps 2 and 5 of LoadSession::load(): counting a checked batch (the parts, parameters and
// layers it completes), and the layers' progress to their per-layer processing.
#include <algorithm>

#include "model/processing.hpp"
#include "base/text.hpp"
#include "model/session_state.hpp"

namespace weightstream {

using namespace model;  // the session's internal pieces (piece_write.hpp)

namespace {

/// The most GPU memory a load holds pieces of incomplete layers in (whole-layer commits), on
/// top of the engine's own: a reload in file order holds a few layers at a time, well below
/// it; past it (a shuffled reload of a large model), pieces are held in host memory.
constexpr uint64_t kMostHeldDeviceBytes = 2ull << 30;

}  // namespace

bool LoadSession::State::tensor_complete(const std::string& tensor) const {
  for (const auto& [parameter, part] : layout.route(tensor).targets) {
    if (!parameters[parameter].parts[part].complete) return false;
  }
  return true;
}

bool LoadSession::State::account(const CheckedBatch& checked) {
  counters.tensors_skipped += checked.skipped;
  std::vector<size_t> completed;  // parameters this batch completes
  bool unlocked = format == TensorFormat::kCheckpoint;
  for (const Write& write : checked.writes) {
    const Parameter& parameter = layout.parameters()[write.parameter];
    ParameterState& parameter_state = parameters[write.parameter];
    parameter_state.touched = true;
    counters.bytes_applied += write.needed;
    if (format == TensorFormat::kEngine) {
      parameter_state.engine_received += write.needed;
      if (parameter_state.engine_received == parameter.bytes()) {
        ++counters.tensors_applied;
        completed.push_back(write.parameter);
      }
      continue;
    }
    if (write.dtype != parameter.load_dtype || write.changes) unlocked = false;
    account_part(write, completed);
  }
  for (size_t index : completed) {
    parameters[index].complete = true;
    ++counters.parameters_completed;
    ++layers[layout.parameters()[index].layer].complete;
  }
  return unlocked;
}

void LoadSession::State::account_part(const Write& write, std::vector<size_t>& completed) {
  const Parameter& parameter = layout.parameters()[write.parameter];
  ParameterState& parameter_state = parameters[write.parameter];
  PartState& part_state = parameter_state.parts[write.part];
  part_state.dtype = write.dtype;
  if (parameter.processing != Processing::kNone && parameter_state.staging.size() == 0) {
    // Processed parameters take their checkpoint-format bytes in staging; the kernel-format
    // storage is written only by processing, so a failed or partial load never leaves it half-new.
    parameter_state.staging = Buffer(parameter.device, parameter.elements() * element_bytes(parameter.load_dtype));
    fill_zero(parameter_state.staging.data(), parameter.device, parameter_state.staging.size());
  }
  const ParameterPart& part = parameter.parts[write.part];
  part_state.received += write.needed;
  if (part_state.received != slice_bytes(part, element_bytes(write.dtype))) return;
  part_state.complete = true;
  // A tensor may fill several parts (a sectioned split): it counts once, with its last.
  if (tensor_complete(part.tensor)) ++counters.tensors_applied;
  if (++parameter_state.parts_complete == parameter.parts.size()) completed.push_back(write.parameter);
  if (!quantizes_into(write.dtype, parameter)) return;
  const size_t scale_index = *layout.find(parameter.block_scale);
  const Parameter& scale = layout.parameters()[scale_index];
  ParameterState& scale_state = parameters[scale_index];
  PartState& scale_part = scale_state.parts[write.part];
  scale_part.dtype = scale.load_dtype;
  scale_part.received = slice_bytes(scale.parts[write.part], element_bytes(scale.load_dtype));
  scale_part.complete = true;
  scale_state.touched = true;
  if (++scale_state.parts_complete == scale.parts.size()) completed.push_back(scale_index);
}

std::vector<int64_t> LoadSession::State::begin_writing(std::span<const Write> writes, bool unlocked) {
  std::vector<int64_t> written;
  if (format != TensorFormat::kCheckpoint) return written;
  written.reserve(writes.size());
  for (const Write& write : writes) {
    written.push_back(layout.parameters()[write.parameter].layer);
    if (unlocked) ++layers[written.back()].writing;
  }
  return written;
}

void LoadSession::State::end_writing(std::vector<int64_t> written, bool unlocked, LoadMode mode) {
  if (unlocked) {
    for (int64_t layer : written) --layers[layer].writing;
  }
  if (mode == LoadMode::kUpdate) return;
  std::sort(written.begin(), written.end());
  written.erase(std::unique(written.begin(), written.end()), written.end());
  for (int64_t layer : written) {
    LayerState& layer_state = layers[layer];
    if (layer_state.complete_now() && layer_state.writing == 0 && !layer_state.processed) process_layer(layer);
  }
}

void LoadSession::State::process_layer(int64_t layer) {
  bool ran = false;
  bool waited = false;
  for (size_t index : layout.layer_parameters(layer)) {
    const Parameter& parameter = layout.parameters()[index];
    ParameterState& parameter_state = parameters[index];
    if (parameter.processing == Processing::kNone || !parameter_state.complete || parameter_state.processed) continue;
    if (!waited) {
      writer->wait();
      waited = true;
    }
    const Parameter* scale = nullptr;
    if (auto scale_index = layout.find(parameter.scale)) scale = &layout.parameters()[*scale_index];
    model::process_parameter(parameter, parameter_state.staging.data(), scale);
    parameter_state.processed = true;
    parameter_state.staging = Buffer();
    ran = true;
  }
  layers[layer].processed = true;
  if (ran) ++counters.layer_processing_runs;
}

void LoadSession::State::settle() {
  if (writer) writer->wait();
}

model::ParameterWriter& LoadSession::State::writer_for(const Device& device) {
  if (!writer || writer->device() != device) {
    if (writer) writer->wait();
    writer.emplace(device);
    held_device_bytes = device.is_cuda() ? std::make_shared<HeldBytesPool>(device, kMostHeldDeviceBytes) : nullptr;
  }
  return *writer;
}

}  // namespace weightstream
