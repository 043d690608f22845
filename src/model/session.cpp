// LoadSession: the one path every load takes, and its one set of checks. This file holds its
// public methods: begin() readies the state for a load, load() takes a batch in the five
// steps of session_state.hpp, finish() runs the steps of session_finish.cpp and the model
// hooks, once. Every write, in either tensor format, goes through the session's
// ParameterWriter (parameter_writer.hpp says which writes of the model layer do not, and why).
#include <algorithm>
#include <set>

#include "base/text.hpp"
#include "model/session_state.hpp"

namespace weightstream {

using namespace model;  // the session's internal pieces (piece_write.hpp)
using detail::join;

LoadSession::LoadSession(ModelLayout& layout) : layout_(layout), state_(std::make_unique<State>(layout)) {}

LoadSession::~LoadSession() = default;  // the writer waits for its copies

LoadCounters LoadSession::counters() const {
  std::lock_guard lock(state_->mutex);
  return state_->counters;
}

std::vector<int64_t> LoadSession::completed_layers() const {
  std::lock_guard lock(state_->mutex);
  std::vector<int64_t> result;
  for (const auto& [layer, state] : state_->layers) {
    if (state.complete_now()) result.push_back(layer);
  }
  return result;
}

std::vector<int64_t> LoadSession::touched_layers() const {
  std::lock_guard lock(state_->mutex);
  std::set<int64_t> layers;
  for (size_t i = 0; i < state_->parameters.size(); ++i) {
    if (state_->parameters[i].touched) layers.insert(layout_.parameters()[i].layer);
  }
  return {layers.begin(), layers.end()};
}

LayerCommit default_layer_commit(LoadMode mode) noexcept {
  return mode == LoadMode::kCold ? LayerCommit::kAsArrived : LayerCommit::kWholeLayer;
}

void LoadSession::begin(LoadMode mode, TensorFormat format, std::optional<LayerCommit> commit) {
  std::lock_guard lock(state_->mutex);
  State& state = *state_;
  const std::string what = std::string(load_mode_name(mode)) + " load of " + layout_.description();
  // A load whose batch failed may be abandoned: begin() starts afresh (finish() would refuse).
  WS_EXPECT(!state.active || state.failure, ErrorCode::kModel,
            "cannot begin a " + what + ": the previous load has not finished");
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
  model::ParameterWriter& writer = state.writer_for(layout_.device());
  state.format = format;
  state.commit = commit.value_or(default_layer_commit(mode));
  state.counters = {};
  state.failure.reset();
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
    writer.wait();  // nothing of an earlier load may land on the zeroed padding
    for (const Parameter& parameter : layout_.parameters()) {
      for (const auto& [begin, end] : parameter.padding) fill_zero(parameter.data + begin, parameter.device, end - begin);
    }
  }
  mode_ = mode;
  commit_ = state.commit;
  state.active = true;
}

std::byte* LoadSession::direct_destination(std::string_view tensor, Dtype dtype, std::span<const int64_t> shape,
                                           uint64_t offset, uint64_t bytes, bool gpu_source) const {
  std::lock_guard lock(state_->mutex);
  const State& state = *state_;
  if (!state.active || state.format != TensorFormat::kCheckpoint || state.commit != LayerCommit::kAsArrived) return nullptr;
  TensorRoute route = layout_.route(tensor);
  if (route.kind != TensorRoute::Kind::kParameter || route.targets.size() != 1) return nullptr;
  const Parameter& parameter = layout_.parameters()[route.targets[0].first];
  const ParameterPart& part = parameter.parts[route.targets[0].second];
  if ((parameter.device.is_cuda() && !gpu_source) || parameter.processing != Processing::kNone ||
      dtype != parameter.dtype || !part.contiguous() || !std::ranges::equal(shape, part.shape)) {
    return nullptr;
  }
  uint64_t row_bytes = static_cast<uint64_t>(part.tensor_columns()) * element_bytes(dtype);
  uint64_t needed_begin = static_cast<uint64_t>(part.row_begin) * row_bytes;
  uint64_t needed_end = needed_begin + static_cast<uint64_t>(part.rows) * row_bytes;
  if (offset < needed_begin || offset + bytes > needed_end) return nullptr;
  return parameter.data + part.element_offset * element_bytes(dtype) + (offset - needed_begin);
}

void LoadSession::check(std::span<const TensorView> batch) const {
  std::lock_guard lock(state_->mutex);
  State& state = *state_;
  const std::string what = std::string(load_mode_name(mode_)) + " load of " + layout_.description();
  WS_EXPECT(state.active, ErrorCode::kModel, "check() outside begin()/finish() on " + layout_.description());
  (void)state.check(batch, what);
}

void LoadSession::load(std::span<const TensorView> batch) {
  std::unique_lock lock(state_->mutex);
  State& state = *state_;
  const std::string what = std::string(load_mode_name(mode_)) + " load of " + layout_.description();
  WS_EXPECT(state.active, ErrorCode::kModel, "load() outside begin()/finish() on " + layout_.description());
  if (state.failure) {
    WS_FAIL(state.failure->code, "cannot go on with the " + what + ": an earlier batch failed (" +
                                     state.failure->message + "); begin() a new load");
  }
  bool wrote = false;
  try {
    State::CheckedBatch checked = state.check(batch, what);
    bool unlocked = state.account(checked);
    State::Ready ready = state.hold(std::move(checked.writes));
    unlocked = unlocked && state.may_write_unlocked(ready.writes);
    std::vector<int64_t> layers = state.begin_writing(ready.writes, unlocked);
    wrote = true;
    if (unlocked) lock.unlock();  // the reader threads of a stream copy in parallel
    ready.copy_held();
    state.write(ready.writes);
    if (checked.waits && state.writer->asynchronous()) state.writer->wait();
    if (!lock.owns_lock()) lock.lock();
    state.end_writing(std::move(layers), unlocked, mode_);
  } catch (const Error& error) {
    if (!lock.owns_lock()) lock.lock();
    if (!state.failure) state.failure = State::Failure{error.code(), error.what(), wrote};
    throw;
  }
}

void LoadSession::settle() {
  std::lock_guard lock(state_->mutex);
  state_->settle();
}

void LoadSession::finish() {
  std::unique_lock lock(state_->mutex);
  State& state = *state_;
  const std::string what = std::string(load_mode_name(mode_)) + " load of " + layout_.description();
  WS_EXPECT(state.active, ErrorCode::kModel, "finish() without begin() on " + layout_.description());
  if (state.failure) state.refuse_finish_after_failure(what);
  if (mode_ != LoadMode::kCold) state.expect_no_partial_tensors(what);
  state.write_remaining_held();
  state.expect_complete(mode_, what);
  state.process_remaining_layers();
  for (const auto& hook : layout_.hooks()) {
    hook->run(layout_);
    ++state.counters.model_hook_runs;
    ++layout_.model_hook_runs_;
  }
  ++layout_.loads_finished_;
  state.active = false;
}

}  // namespace weightstream
