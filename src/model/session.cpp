// LoadSession: the one path every load takes. A batch is checked whole before any byte
// of it is written; parts are written as they arrive; a layer is processed when its last
// part arrives; model hooks run once, in finish().
#include <algorithm>
#include <mutex>
#include <set>

#include "model/parameter_copy.hpp"
#include "model/processing.hpp"
#include "weightstream/error.hpp"
#include "weightstream/model.hpp"

namespace weightstream {
namespace {

const Device kHost{};

uint64_t element_bytes(Dtype dtype) { return dtype_bits(dtype) / 8; }

bool convertible(Dtype from, Dtype to) {
  auto is_float = [](Dtype dtype) { return dtype == Dtype::kBF16 || dtype == Dtype::kF16 || dtype == Dtype::kF32; };
  return from == to || (is_float(from) && is_float(to));
}

std::string join(const std::vector<std::string>& items, std::string_view separator) {
  std::string text;
  for (const std::string& item : items) {
    if (!text.empty()) text += separator;
    text += item;
  }
  return text;
}

}  // namespace

struct LoadSession::State {
  struct PartState {
    uint64_t received = 0;  ///< bytes of the needed source range received in this load
    std::optional<Dtype> dtype;  ///< dtype its pieces arrive in (one per load)
    std::vector<std::byte> assembly;  ///< needed rows, gathered when pieces cannot be written directly
    bool complete = false;
  };
  struct ParameterState {
    std::vector<PartState> parts;
    size_t parts_complete = 0;
    uint64_t engine_received = 0;  ///< engine format: bytes received
    bool touched = false;
    bool complete = false;
    bool processed = false;
    Buffer staging;  ///< checkpoint-format bytes of a processed parameter
  };
  struct LayerState {
    size_t parameters = 0;  ///< parameters of the layer that parts fill
    size_t complete = 0;
    bool processed = false;
  };

  /// One write that a checked batch will perform.
  struct Write {
    const TensorView* view = nullptr;
    size_t parameter = 0;
    size_t part = 0;
    uint64_t begin = 0, end = 0;  ///< bytes of the tensor written, within the needed range
  };

  std::mutex mutex;
  std::optional<CopyQueue> queue;  ///< engine-format copies of SourceLifetime::kSession batches
  std::vector<size_t> batch_bytes_touched;  ///< parameters with engine bytes in the current batch
  std::vector<uint64_t> batch_engine_bytes;  ///< per parameter: engine bytes in the current batch
  bool active = false;
  TensorFormat format = TensorFormat::kCheckpoint;
  std::vector<ParameterState> parameters;
  std::map<int64_t, LayerState> layers;
  LoadCounters counters;
};

LoadSession::LoadSession(ModelLayout& layout) : layout_(layout), state_(std::make_unique<State>()) {}

LoadSession::~LoadSession() = default;

LoadCounters LoadSession::counters() const {
  std::lock_guard lock(state_->mutex);
  return state_->counters;
}

std::vector<int64_t> LoadSession::completed_layers() const {
  std::lock_guard lock(state_->mutex);
  std::vector<int64_t> result;
  for (const auto& [layer, state] : state_->layers) {
    if (state.parameters > 0 && state.complete == state.parameters) result.push_back(layer);
  }
  return result;
}

void LoadSession::begin(LoadMode mode, TensorFormat format) {
  std::lock_guard lock(state_->mutex);
  State& state = *state_;
  const std::string what = std::string(load_mode_name(mode)) + " load of " + layout_.description();
  WS_EXPECT(!state.active, ErrorCode::kModel, "cannot begin a " + what + ": the previous load has not finished");
  std::vector<std::string> unbound;
  for (const Parameter& parameter : layout_.parameters()) {
    if (parameter.data == nullptr) unbound.push_back(parameter.name);
  }
  WS_EXPECT(unbound.empty(), ErrorCode::kModel,
            "cannot begin a " + what + ": parameters without storage (allocate() or bind() them first): " +
                join(unbound, ", "));
  WS_EXPECT(mode == LoadMode::kCold || layout_.loads_finished() > 0, ErrorCode::kModel,
            "cannot begin a " + what + ": it has never been loaded; the first load must be cold");
  if (layout_.loads_finished() > 0) {
    for (const auto& hook : layout_.hooks()) {
      // Refuse here, before a byte is written: running the hook again would leave derived
      // state stale or wrong, and stopping after the weights changed would be worse.
      WS_EXPECT(hook->rerunnable(), ErrorCode::kModel,
                "cannot begin a " + what + ": model hook '" + hook->name() +
                    "' declares that it cannot run twice, and this layout has already been loaded; "
                    "rebuild the model instead of reloading it");
    }
  }
  state.format = format;
  state.counters = {};
  // Reset in place: a session reused for update after update (a receiver's) does this for
  // every parameter before the first byte of each update can land.
  state.parameters.resize(layout_.parameters().size());
  for (auto& [layer, layer_state] : state.layers) layer_state = {};
  auto layer_entry = state.layers.end();  // parameters come layer by layer: one lookup a layer
  for (size_t i = 0; i < layout_.parameters().size(); ++i) {
    const Parameter& parameter = layout_.parameters()[i];
    State::ParameterState& parameter_state = state.parameters[i];
    parameter_state.parts.assign(parameter.parts.size(), State::PartState{});
    parameter_state.parts_complete = 0;
    parameter_state.engine_received = 0;
    parameter_state.touched = parameter_state.complete = parameter_state.processed = false;
    parameter_state.staging = Buffer();
    bool filled = format == TensorFormat::kEngine || !parameter.parts.empty();
    if (!filled) continue;
    if (layer_entry == state.layers.end() || layer_entry->first != parameter.layer) {
      layer_entry = state.layers.try_emplace(parameter.layer).first;
    }
    ++layer_entry->second.parameters;
  }
  std::erase_if(state.layers, [](const auto& entry) { return entry.second.parameters == 0; });
  // Parts that hold no rows on this rank (a vocabulary slice wholly in padding) are complete
  // before any byte arrives.
  if (format == TensorFormat::kCheckpoint) {
    for (size_t i = 0; i < layout_.parameters().size(); ++i) {
      const Parameter& parameter = layout_.parameters()[i];
      State::ParameterState& parameter_state = state.parameters[i];
      for (size_t p = 0; p < parameter.parts.size(); ++p) {
        if (parameter.parts[p].elements() > 0) continue;
        parameter_state.parts[p].complete = true;
        ++parameter_state.parts_complete;
      }
      if (!parameter.parts.empty() && parameter_state.parts_complete == parameter.parts.size()) {
        parameter_state.complete = true;
        ++state.layers[parameter.layer].complete;
      }
    }
  }
  if (mode == LoadMode::kCold) {
    for (const Parameter& parameter : layout_.parameters()) {
      for (const auto& [begin, end] : parameter.padding) {
        model::zero_bytes(parameter.data + begin, parameter.device, end - begin);
      }
    }
  }
  mode_ = mode;
  state.active = true;
}

void LoadSession::load(std::span<const TensorView> batch, SourceLifetime sources) {
  std::lock_guard lock(state_->mutex);
  State& state = *state_;
  auto what = [&] { return std::string(load_mode_name(mode_)) + " load of " + layout_.description(); };
  WS_EXPECT(state.active, ErrorCode::kModel, "load() outside begin()/finish() on " + layout_.description());

  // Pass 1: check every tensor of the batch; nothing is written until all pass.
  std::vector<State::Write> writes;
  writes.reserve(batch.size());
  std::map<std::pair<size_t, size_t>, uint64_t> batch_bytes;  // checkpoint format, per (parameter, part)
  // Engine format, per parameter: a flat array reset after the batch (an update brings
  // thousands of tensors a batch; a tree of them cost more than the checks).
  state.batch_engine_bytes.resize(layout_.parameters().size());
  struct ResetEngineBytes {
    State& state;
    ~ResetEngineBytes() {
      for (size_t index : state.batch_bytes_touched) state.batch_engine_bytes[index] = 0;
      state.batch_bytes_touched.clear();
    }
  } reset_engine_bytes{state};
  for (const TensorView& view : batch) {
    const std::string_view tensor = view.name;
    auto size = tensor_byte_size(view.dtype, view.shape);
    WS_EXPECT(size.has_value(), ErrorCode::kModel,
              "tensor " + std::string(tensor) + ": shape " + shape_text(view.shape) + " of " + std::string(dtype_name(view.dtype)) +
                  " has no valid byte size");
    WS_EXPECT(view.offset <= *size && view.bytes <= *size - view.offset, ErrorCode::kModel,
              "tensor " + std::string(tensor) + ": piece " + std::to_string(view.offset) + "+" + std::to_string(view.bytes) +
                  " lies outside its " + std::to_string(*size) + " bytes");
    WS_EXPECT(view.data != nullptr || view.bytes == 0, ErrorCode::kModel, "tensor " + std::string(tensor) + ": no data");

    if (state.format == TensorFormat::kEngine) {
      auto index = layout_.find(tensor);
      WS_EXPECT(index.has_value(), ErrorCode::kModel,
                "engine-format tensor " + std::string(tensor) + " names no parameter of " + layout_.description());
      const Parameter& parameter = layout_.parameters()[*index];
      WS_EXPECT(view.dtype == parameter.dtype, ErrorCode::kModel,
                "engine-format tensor " + std::string(tensor) + " has dtype " + std::string(dtype_name(view.dtype)) +
                    " but parameter " + parameter.name + " (" + layer_label(layout_, parameter.layer) + ") holds " +
                    std::string(dtype_name(parameter.dtype)));
      WS_EXPECT(std::ranges::equal(view.shape, parameter.shape), ErrorCode::kModel,
                "engine-format tensor " + std::string(tensor) + " has shape " + shape_text(view.shape) + " but parameter " +
                    parameter.name + " (" + layer_label(layout_, parameter.layer) + ") has shape " +
                    shape_text(parameter.shape));
      uint64_t& pending = state.batch_engine_bytes[*index];
      WS_EXPECT(state.parameters[*index].engine_received + pending + view.bytes <= parameter.bytes(), ErrorCode::kModel,
                "tensor " + std::string(tensor) + " delivered twice in this " + what());
      if (pending == 0) state.batch_bytes_touched.push_back(*index);
      pending += view.bytes;
      writes.push_back({&view, *index, 0, view.offset, view.offset + view.bytes});
      continue;
    }

    TensorRoute route = layout_.route(tensor);
    if (route.kind == TensorRoute::Kind::kIgnored || route.kind == TensorRoute::Kind::kSkipped) {
      if (view.offset == 0) ++state.counters.tensors_skipped;
      continue;
    }
    WS_EXPECT(route.kind == TensorRoute::Kind::kParameter, ErrorCode::kModel,
              "tensor " + std::string(tensor) + " matches no parameter of " + layout_.description() +
                  " and no ignore rule; add an ignore rule if the engine does not use it");
    for (const auto& [index, part_index] : route.targets) {
      const Parameter& parameter = layout_.parameters()[index];
      const ParameterPart& part = parameter.parts[part_index];
      // Built only for a message: this runs for every tensor of every load.
      auto target_text = [&] {
        return "parameter " + parameter.name + " (part '" + part.id + "', " + layer_label(layout_, parameter.layer) +
               ", rule " + part.rule + ")";
      };
      WS_EXPECT(std::ranges::equal(view.shape, part.shape), ErrorCode::kModel,
                "tensor " + std::string(tensor) + " has shape " + shape_text(view.shape) + " but " + target_text() + " expects " +
                    shape_text(part.shape));
      WS_EXPECT(convertible(view.dtype, parameter.load_dtype), ErrorCode::kModel,
                "tensor " + std::string(tensor) + " has dtype " + std::string(dtype_name(view.dtype)) + " but " + target_text() +
                    " is loaded as " + std::string(dtype_name(parameter.load_dtype)) +
                    " (only BF16, F16 and F32 convert on copy)");
      const State::PartState& part_state = state.parameters[index].parts[part_index];
      WS_EXPECT(!part_state.dtype || *part_state.dtype == view.dtype, ErrorCode::kModel,
                "tensor " + std::string(tensor) + ": a piece arrived as " + std::string(dtype_name(view.dtype)) +
                    " after earlier pieces as " + std::string(dtype_name(*part_state.dtype)));
      uint64_t row_bytes = static_cast<uint64_t>(part.tensor_columns()) * element_bytes(view.dtype);
      uint64_t needed_begin = static_cast<uint64_t>(part.row_begin) * row_bytes;
      uint64_t needed_end = needed_begin + static_cast<uint64_t>(part.rows) * row_bytes;
      uint64_t begin = std::max(view.offset, needed_begin);
      uint64_t end = std::min(view.offset + view.bytes, needed_end);
      if (begin >= end) continue;  // a piece of rows another rank holds
      uint64_t& pending = batch_bytes[{index, part_index}];
      WS_EXPECT(!part_state.complete && part_state.received + pending + (end - begin) <= needed_end - needed_begin,
                ErrorCode::kModel, "tensor " + std::string(tensor) + " delivered twice in this " + what() + " (" + target_text() + ")");
      pending += end - begin;
      writes.push_back({&view, index, part_index, begin, end});
    }
  }

  // Pass 2: write. Engine-format bytes land as they are: one batch of copies for the call
  // (on a GPU one driver call, not one per tensor), issued after the loop.
  std::vector<size_t> completed;  // each parameter completes once
  std::vector<CopyRange> engine_copies;         // from host memory, or all on the host
  std::vector<CopyRange> engine_device_copies;  // from and to the layout's GPU
  for (const State::Write& write : writes) {
    const TensorView& view = *write.view;
    Parameter& parameter = layout_.mutable_parameter(write.parameter);
    State::ParameterState& parameter_state = state.parameters[write.parameter];
    parameter_state.touched = true;
    const std::byte* source = view.data + (write.begin - view.offset);
    uint64_t length = write.end - write.begin;
    state.counters.bytes_applied += length;

    if (state.format == TensorFormat::kEngine) {
      if (parameter.device == view.device && view.device.is_cuda()) {
        engine_device_copies.push_back({parameter.data + write.begin, source, length});
      } else if (parameter.device == view.device || !view.device.is_cuda()) {
        engine_copies.push_back({parameter.data + write.begin, source, length});
      } else {
        copy_bytes(parameter.data + write.begin, parameter.device, source, view.device, length);
      }
      parameter_state.engine_received += length;
      if (parameter_state.engine_received == parameter.bytes()) {
        ++state.counters.tensors_applied;
        completed.push_back(write.parameter);
      }
      continue;
    }

    const ParameterPart& part = parameter.parts[write.part];
    State::PartState& part_state = parameter_state.parts[write.part];
    part_state.dtype = view.dtype;
    // Processed parameters take their checkpoint-format bytes in staging; the kernel-format
    // storage is written only by processing, so a failed or partial load never leaves it half-new.
    std::byte* base = parameter.data;
    if (parameter.processing != Processing::kNone) {
      if (parameter_state.staging.size() == 0) {
        parameter_state.staging = Buffer(parameter.device, parameter.elements() * element_bytes(parameter.load_dtype));
        model::zero_bytes(parameter_state.staging.data(), parameter.device, parameter_state.staging.size());
      }
      base = parameter_state.staging.data();
    }
    base += part.element_offset * element_bytes(parameter.load_dtype);
    uint64_t source_element = element_bytes(view.dtype);
    uint64_t tensor_columns = static_cast<uint64_t>(part.tensor_columns());
    uint64_t needed_begin = static_cast<uint64_t>(part.row_begin) * tensor_columns * source_element;
    uint64_t needed_bytes = static_cast<uint64_t>(part.rows) * tensor_columns * source_element;
    const std::byte* needed_source = nullptr;  // the whole needed range, when available at once
    if (length == needed_bytes) {
      needed_source = source;
    } else if (part.contiguous() && view.dtype == parameter.load_dtype) {
      // A run of a contiguous slice in the parameter's dtype lands where it belongs.
      copy_bytes(base + (write.begin - needed_begin), parameter.device, source, view.device, length);
    } else {
      // Strided or converted slices need whole rows (and whole elements): gather first.
      if (part_state.assembly.empty()) part_state.assembly.resize(needed_bytes);
      copy_bytes(part_state.assembly.data() + (write.begin - needed_begin), kHost, source, view.device, length);
      if (part_state.received + length == needed_bytes) needed_source = part_state.assembly.data();
    }
    if (needed_source != nullptr) {
      const Device& from = needed_source == source ? view.device : kHost;
      model::copy_rows(base, parameter.device, parameter.load_dtype,
                       needed_source + static_cast<uint64_t>(part.column_begin) * source_element, from, view.dtype,
                       static_cast<uint64_t>(part.rows), static_cast<uint64_t>(part.columns), tensor_columns);
      std::vector<std::byte>().swap(part_state.assembly);
    }
    part_state.received += length;
    if (part_state.received == needed_bytes) {
      part_state.complete = true;
      ++state.counters.tensors_applied;
      if (++parameter_state.parts_complete == parameter.parts.size()) completed.push_back(write.parameter);
    }
  }
  copy_batch(layout_.device(), engine_copies);
  if (sources == SourceLifetime::kSession && !engine_device_copies.empty()) {
    if (!state.queue) state.queue.emplace(layout_.device());
    state.queue->gather(engine_device_copies);
  } else {
    copy_within_device(layout_.device(), engine_device_copies);
  }

  for (size_t index : completed) {
    State::ParameterState& parameter_state = state.parameters[index];
    parameter_state.complete = true;
    ++state.counters.parameters_completed;
    const Parameter& parameter = layout_.parameters()[index];
    State::LayerState& layer = state.layers[parameter.layer];
    ++layer.complete;
    // An update may bring a layer in several buckets; its processing waits for finish().
    if (mode_ != LoadMode::kUpdate && layer.complete == layer.parameters && state.format == TensorFormat::kCheckpoint) {
      process_layer(parameter.layer);
    }
  }
}

void LoadSession::process_layer(int64_t layer) {
  State& state = *state_;
  bool ran = false;
  for (size_t index : layout_.layer_parameters(layer)) {
    const Parameter& parameter = layout_.parameters()[index];
    State::ParameterState& parameter_state = state.parameters[index];
    if (parameter.processing == Processing::kNone || !parameter_state.complete || parameter_state.processed) continue;
    const Parameter* scale = nullptr;
    if (auto scale_index = layout_.find(parameter.scale)) scale = &layout_.parameters()[*scale_index];
    model::process_parameter(parameter, parameter_state.staging.data(), scale);
    parameter_state.processed = true;
    parameter_state.staging = Buffer();
    ran = true;
  }
  state.layers[layer].processed = true;
  if (ran) ++state.counters.layer_processing_runs;
}

void LoadSession::settle() {
  std::lock_guard lock(state_->mutex);
  if (state_->queue) state_->queue->wait();
}

void LoadSession::finish() {
  std::lock_guard lock(state_->mutex);
  State& state = *state_;
  if (state.queue) state.queue->wait();
  const std::string what = std::string(load_mode_name(mode_)) + " load of " + layout_.description();
  WS_EXPECT(state.active, ErrorCode::kModel, "finish() without begin() on " + layout_.description());

  // Completeness: a cold load names every parameter still missing, grouped by layer.
  std::map<int64_t, std::vector<std::string>> missing;
  for (size_t i = 0; i < layout_.parameters().size(); ++i) {
    const Parameter& parameter = layout_.parameters()[i];
    const State::ParameterState& parameter_state = state.parameters[i];
    bool filled = state.format == TensorFormat::kEngine || !parameter.parts.empty();
    if (!filled || parameter_state.complete) continue;
    bool required = mode_ == LoadMode::kCold ||
                    (parameter.processing != Processing::kNone && parameter_state.touched &&
                     state.format == TensorFormat::kCheckpoint);
    if (!required) continue;
    std::vector<std::string> parts;
    for (size_t p = 0; p < parameter.parts.size(); ++p) {
      if (!parameter_state.parts[p].complete && parameter_state.touched) parts.push_back(parameter.parts[p].tensor);
    }
    missing[parameter.layer].push_back(parameter.name + (parts.empty() ? "" : " (missing " + join(parts, ", ") + ")"));
  }
  if (!missing.empty()) {
    std::vector<std::string> groups;
    for (const auto& [layer, names] : missing) {
      groups.push_back(layer_label(layout_, layer) + " weights missing: " + join(names, ", "));
    }
    state.active = false;
    WS_FAIL(ErrorCode::kModel,
            mode_ == LoadMode::kCold
                ? what + " is incomplete: " + join(groups, "; ")
                : what + ": FP8-processed parameters need every part in checkpoint format to be requantized: " +
                      join(groups, "; "));
  }

  for (auto& [layer, layer_state] : state.layers) {
    if (state.format == TensorFormat::kCheckpoint) process_layer(layer);
  }
  for (const auto& hook : layout_.hooks()) {
    hook->run(layout_);
    ++state.counters.model_hook_runs;
    ++layout_.model_hook_runs_;
  }
  ++layout_.loads_finished_;
  state.active = false;
}

}  // namespace weightstream
