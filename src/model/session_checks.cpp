// Step 1 of LoadSession::load(): every tensor of a batch is checked, against the layout and
// what this load has received, before any byte of the batch is written or counted.
#include <algorithm>
#include <map>

#include "base/text.hpp"
#include "model/session_state.hpp"

namespace weightstream {

using namespace model;  // the session's internal pieces (piece_write.hpp)

LoadSession::State::CheckedBatch LoadSession::State::check(std::span<const TensorView> batch, const std::string& what) {
  CheckedBatch checked;
  checked.writes.reserve(batch.size());
  std::map<std::pair<size_t, size_t>, uint64_t> part_bytes;  // checkpoint format: this batch's, per part
  // Engine format, per parameter: a flat array reset after the batch (an update brings
  // thousands of tensors a batch; a tree of them cost more than the checks).
  batch_engine_bytes.resize(layout.parameters().size());
  struct ResetEngineBytes {
    State& state;
    ~ResetEngineBytes() {
      for (size_t index : state.batch_bytes_touched) state.batch_engine_bytes[index] = 0;
      state.batch_bytes_touched.clear();
    }
  } reset_engine_bytes{*this};
  for (const TensorView& view : batch) {
    auto size = tensor_byte_size(view.dtype, view.shape);
    WS_EXPECT(size.has_value(), ErrorCode::kModel,
              "tensor " + std::string(view.name) + ": shape " + shape_text(view.shape) + " of " +
                  std::string(dtype_name(view.dtype)) + " has no valid byte size");
    WS_EXPECT(view.offset <= *size && view.bytes <= *size - view.offset, ErrorCode::kModel,
              "tensor " + std::string(view.name) + ": piece " + std::to_string(view.offset) + "+" + std::to_string(view.bytes) +
                  " lies outside its " + std::to_string(*size) + " bytes");
    WS_EXPECT(view.data != nullptr || view.bytes == 0 || view.changes, ErrorCode::kModel,
              "tensor " + std::string(view.name) + ": no data");
    WS_EXPECT(view.packed_run == 0 || (format == TensorFormat::kCheckpoint && view.packed_stride >= view.packed_run &&
                                       view.bytes >= view.packed_run &&
                                       (view.bytes - view.packed_run) % view.packed_stride == 0),
              ErrorCode::kModel,
              "tensor " + std::string(view.name) + ": a packed piece of runs of " + std::to_string(view.packed_run) +
                  " bytes every " + std::to_string(view.packed_stride) + " bytes does not span " +
                  std::to_string(view.bytes) + " bytes in whole runs" +
                  (format == TensorFormat::kEngine ? " (and engine-format pieces are never packed)" : ""));
    WS_EXPECT(!view.changes || view.packed_run == 0, ErrorCode::kModel,
              "tensor " + std::string(view.name) + ": changed elements are never packed");
    if (view.changes) check_changes(view, *size);
    if (format == TensorFormat::kEngine) {
      check_engine(view, what, checked);
    } else {
      check_checkpoint(view, what, part_bytes, checked);
    }
  }
  return checked;
}

void LoadSession::State::add_write(CheckedBatch& checked, const TensorView& view, size_t parameter, size_t part, uint64_t begin,
                      uint64_t end, uint64_t needed) {
  const PieceWrite whole{.begin = view.offset, .source = view.data, .packed_run = view.packed_run,
                         .packed_stride = view.packed_stride};
  const std::byte* source = view.changes ? nullptr : source_at(whole, begin);
  checked.writes.push_back({parameter, part, begin, end, needed, source, view.packed_run, view.packed_stride,
                            view.device, view.dtype, view.lifetime, view.keepalive, view.name, view.changes});
  checked.waits = checked.waits || (view.lifetime == SourceLifetime::kCall && !view.keepalive && !view.changes);
}

void LoadSession::State::check_changes(const TensorView& view, uint64_t size) {
  const ChangedElements& changes = *view.changes;
  const std::string tensor = "tensor " + std::string(view.name);
  WS_EXPECT(view.offset == 0 && view.bytes == size, ErrorCode::kModel,
            tensor + ": changed elements stand for the whole tensor (offset 0, " + std::to_string(size) +
                " bytes), not the piece " + std::to_string(view.offset) + "+" + std::to_string(view.bytes));
  const uint64_t element = element_bytes(view.dtype);
  WS_EXPECT(element > 0, ErrorCode::kModel,
            tensor + ": changed elements are whole-byte elements, and " + std::string(dtype_name(view.dtype)) +
                " packs several in a byte; send it whole");
  WS_EXPECT(changes.values.size() == changes.indices.size() * element, ErrorCode::kModel,
            tensor + ": " + std::to_string(changes.indices.size()) + " changed elements of " +
                std::string(dtype_name(view.dtype)) + " come with " + std::to_string(changes.values.size()) +
                " bytes of values");
  const uint64_t elements = size / element;
  for (size_t i = 0; i < changes.indices.size(); ++i) {
    const uint64_t index = changes.indices[i];
    WS_EXPECT(index < elements && (i == 0 || index > changes.indices[i - 1]), ErrorCode::kModel,
              tensor + ": changed element " + std::to_string(i) + " is at index " + std::to_string(index) +
                  (index < elements ? ", not after the one before it" : ", outside its " + std::to_string(elements) +
                                                                            " elements"));
  }
}

template <typename TargetText>
void LoadSession::State::check_changes_target(const TensorView& view, const Parameter& parameter, const TargetText& target_text) const {
  std::string why;
  if (parameter.processing != Processing::kNone) {
    why = "is processed (quantized) after loading";
  } else if (view.dtype != parameter.dtype && !convertible(view.dtype, parameter.dtype)) {
    why = "holds " + std::string(dtype_name(parameter.dtype)) + ", not the tensor's " +
          std::string(dtype_name(view.dtype));
  } else if (parameter.device.is_cuda()) {
    why = "lives on a GPU, where changed elements are not written yet";
  }
  WS_EXPECT(why.empty(), ErrorCode::kModel,
            "tensor " + std::string(view.name) + " arrives as changed elements but " + target_text() + " " + why +
                "; send it whole");
}

void LoadSession::State::check_engine(const TensorView& view, const std::string& what, CheckedBatch& checked) {
  const std::string_view tensor = view.name;
  auto index = layout.find(tensor);
  WS_EXPECT(index.has_value(), ErrorCode::kModel,
            "engine-format tensor " + std::string(tensor) + " names no parameter of " + layout.description());
  const Parameter& parameter = layout.parameters()[*index];
  WS_EXPECT(!view.changes, ErrorCode::kModel,
            "engine-format tensor " + std::string(tensor) + " arrives as changed elements, which take checkpoint names");
  WS_EXPECT(view.dtype == parameter.dtype, ErrorCode::kModel,
            "engine-format tensor " + std::string(tensor) + " has dtype " + std::string(dtype_name(view.dtype)) + " but parameter " +
                parameter.name + " (" + layer_label(layout, parameter.layer) + ") holds " +
                std::string(dtype_name(parameter.dtype)));
  WS_EXPECT(std::ranges::equal(view.shape, parameter.shape), ErrorCode::kModel,
            "engine-format tensor " + std::string(tensor) + " has shape " + shape_text(view.shape) + " but parameter " +
                parameter.name + " (" + layer_label(layout, parameter.layer) + ") has shape " +
                shape_text(parameter.shape));
  uint64_t& pending = batch_engine_bytes[*index];
  WS_EXPECT(parameters[*index].engine_received + pending + view.bytes <= parameter.bytes(), ErrorCode::kModel,
            "tensor " + std::string(tensor) + " delivered twice in this " + what);
  if (pending == 0) batch_bytes_touched.push_back(*index);
  pending += view.bytes;
  add_write(checked, view, *index, 0, view.offset, view.offset + view.bytes, view.bytes);
}

void LoadSession::State::check_checkpoint(const TensorView& view, const std::string& what,
                      std::map<std::pair<size_t, size_t>, uint64_t>& part_bytes, CheckedBatch& checked) {
  const std::string_view tensor = view.name;
  TensorRoute route = layout.route(tensor);
  if (route.kind == TensorRoute::Kind::kIgnored || route.kind == TensorRoute::Kind::kSkipped) {
    if (view.offset == 0) ++checked.skipped;
    return;
  }
  WS_EXPECT(route.kind == TensorRoute::Kind::kParameter, ErrorCode::kModel,
            "tensor " + std::string(tensor) + " matches no parameter of " + layout.description() +
                " and no ignore rule; add an ignore rule if the engine does not use it");
  for (const auto& [index, part_index] : route.targets) {
    const Parameter& parameter = layout.parameters()[index];
    const ParameterPart& part = parameter.parts[part_index];
    // Built only for a message: this runs for every tensor of every load.
    auto target_text = [&] {
      return "parameter " + parameter.name + " (part '" + part.id + "', " + layer_label(layout, parameter.layer) +
             ", rule " + part.rule + ")";
    };
    WS_EXPECT(std::ranges::equal(view.shape, part.shape), ErrorCode::kModel,
              "tensor " + std::string(tensor) + " has shape " + shape_text(view.shape) + " but " + target_text() + " expects " +
                  shape_text(part.shape));
    if (view.changes) check_changes_target(view, parameter, target_text);
    const bool quantizes = quantizes_into(view.dtype, parameter);
    WS_EXPECT(convertible(view.dtype, parameter.load_dtype) || quantizes, ErrorCode::kModel,
              "tensor " + std::string(tensor) + " has dtype " + std::string(dtype_name(view.dtype)) + " but " + target_text() +
                  " is loaded as " + std::string(dtype_name(parameter.load_dtype)) +
                  " (only BF16, F16 and F32 convert on copy, and quantize into FP8 block-scaled weights)");
    const PartState& part_state = parameters[index].parts[part_index];
    WS_EXPECT(!part_state.dtype || *part_state.dtype == view.dtype, ErrorCode::kModel,
              "tensor " + std::string(tensor) + ": a piece arrived as " + std::string(dtype_name(view.dtype)) +
                  " after earlier pieces as " + std::string(dtype_name(*part_state.dtype)));
    uint64_t row_bytes = static_cast<uint64_t>(part.tensor_columns()) * element_bytes(view.dtype);
    uint64_t needed_begin = static_cast<uint64_t>(part.row_begin) * row_bytes;
    uint64_t needed_end = needed_begin + static_cast<uint64_t>(part.rows) * row_bytes;
    uint64_t begin = std::max(view.offset, needed_begin);
    uint64_t end = std::min(view.offset + view.bytes, needed_end);
    if (begin >= end) continue;  // a piece of rows another rank holds
    const uint64_t needed = slice_bytes_within(part, element_bytes(view.dtype), begin, end);
    if (needed == 0) continue;  // only columns another rank holds
    uint64_t& pending = part_bytes[{index, part_index}];
    WS_EXPECT(!part_state.complete &&
                  part_state.received + pending + needed <= slice_bytes(part, element_bytes(view.dtype)),
              ErrorCode::kModel, "tensor " + std::string(tensor) + " delivered twice in this " + what + " (" + target_text() + ")");
    check_quantization(view, parameter, part_index, quantizes, what, target_text);
    pending += needed;
    add_write(checked, view, index, part_index, begin, end, needed);
  }
}

template <typename TargetText>
void LoadSession::State::check_quantization(const TensorView& view, const Parameter& parameter, size_t part_index, bool quantizes,
                        const std::string& what, const TargetText& target_text) const {
  const std::string mixed = ": send an FP8 weight with its weight_scale_inv, or a BF16, F16 or F32 weight alone";
  if (quantizes) {
    const size_t scale_index = *layout.find(parameter.block_scale);
    const PartState& scale_state = parameters[scale_index].parts[part_index];
    WS_EXPECT(scale_state.received == 0 && !scale_state.complete, ErrorCode::kModel,
              "tensor " + std::string(view.name) + " arrives as " + std::string(dtype_name(view.dtype)) + " to be quantized into " +
                  target_text() + ", but its block scales " + parameter.parts[part_index].tensor +
                  "_scale_inv arrived in this " + what + " already" + mixed);
  } else if (auto weight = scaled_weight(layout, parameter)) {
    const PartState& weight_state = parameters[*weight].parts[part_index];
    WS_EXPECT(!weight_state.dtype || !quantizes_into(*weight_state.dtype, layout.parameters()[*weight]),
              ErrorCode::kModel,
              "tensor " + std::string(view.name) + " (block scales) arrives after its weight " +
                  layout.parameters()[*weight].parts[part_index].tensor + " arrived as " +
                  std::string(dtype_name(*weight_state.dtype)) + " to be quantized, in this " + what + mixed);
  }
}

}  // namespace weightstream
