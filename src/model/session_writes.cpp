// Step 4 of LoadSession::load(): the writes of a batch, every one through the session's
// ParameterWriter, in either tensor format. On a GPU, asynchronous copies that nothing waits
// for per piece, issued outside the session's lock so that reader threads copy in parallel,
// and one wait (settle(), or before processing and hooks). A piece in another dtype gathers
// until its part is whole and lands converted (or quantized into FP8 blocks).
#include <cstring>

#include "model/fp8_blocks.hpp"
#include "base/text.hpp"
#include "model/session_state.hpp"

namespace weightstream {

using namespace model;  // the session's internal pieces (piece_write.hpp)

namespace {

const Device kHost{};

}  // namespace

void LoadSession::State::write(std::span<const Write> writes) {
  if (format == TensorFormat::kEngine) return write_engine(writes);
  if (writes.size() > 1 && writer->asynchronous()) return write_checkpoint_batch(writes);
  for (const Write& write : writes) write_checkpoint(write);
}

void LoadSession::State::write_checkpoint(const Write& write) {
  Parameter& parameter = layout.mutable_parameter(write.parameter);
  const ParameterPart& part = parameter.parts[write.part];
  ParameterState& parameter_state = parameters[write.parameter];
  std::byte* base = part_base(write);
  if (write.changes) return write_changes(part, write, base);
  if (write.dtype == parameter.load_dtype) return write_part_bytes(*writer, base, part, element_bytes(write.dtype), write);
  if (quantizes_into(write.dtype, parameter) && writer->quantizes_on_device() && parameter.device == writer->device() &&
      (!write.device.is_cuda() || write.device == writer->device())) {
    return write_quantized_on_device(parameter, write, base);
  }
  // The part's slice gathers compactly (its columns of each row) until it is whole.
  PartState& part_state = parameter_state.parts[write.part];
  const uint64_t source_element = element_bytes(write.dtype);
  const uint64_t needed_bytes = slice_bytes(part, source_element);
  if (part_state.assembly.empty()) part_state.assembly.resize(needed_bytes);
  // A piece on a GPU comes to the host in one copy, not one a row.
  const std::byte* source = write.source;
  std::vector<std::byte> host_piece;
  if (write.device.is_cuda()) {
    host_piece.resize(write.end - write.begin);
    copy_bytes(host_piece.data(), kHost, write.source, write.device, host_piece.size());
    source = host_piece.data();
  }
  for_each_slice_run(part, source_element, write.begin, write.end,
                     [&](uint64_t slice_offset, uint64_t position, uint64_t length) {
                       const std::byte* from =
                           source == write.source ? source_at(write, position) : source + (position - write.begin);
                       std::memcpy(part_state.assembly.data() + slice_offset, from, length);
                     });
  part_state.assembled += write.needed;
  if (part_state.assembled < needed_bytes) return;
  if (quantizes_into(write.dtype, parameter)) return write_quantized(parameter, write, base);
  auto converted = std::make_shared<std::vector<std::byte>>(part.elements() * element_bytes(parameter.load_dtype));
  convert_elements(converted->data(), parameter.load_dtype, part_state.assembly.data(), write.dtype, part.elements());
  std::vector<std::byte>().swap(part_state.assembly);
  writer->copy(base, converted->data(), kHost, converted->size(), converted, write.name);
}

void LoadSession::State::write_checkpoint_batch(std::span<const Write> writes) {
  std::vector<model::ParameterWriter::HostCopy> copies;
  std::vector<std::shared_ptr<const void>> keepalives;
  const Write* first = nullptr;
  const Write* last = nullptr;
  std::vector<E4m3BlockJob> quantized;  // pieces on this GPU quantized where they lie
  for (const Write& write : writes) {
    Parameter& parameter = layout.mutable_parameter(write.parameter);
    if (write.device == writer->device() && parameter.device == writer->device() &&
        quantizes_into(write.dtype, parameter) && writer->quantizes_on_device()) {
      write_quantized_on_device(parameter, write, part_base(write), &quantized);
    } else if (write.changes || write.device.is_cuda() || write.dtype != parameter.load_dtype ||
               parameter.device != writer->device()) {
      write_checkpoint(write);
      continue;
    }
    if (write.keepalive && (keepalives.empty() || keepalives.back() != write.keepalive)) {
      keepalives.push_back(write.keepalive);
    }
    if (!first) first = &write;
    last = &write;
    if (write.device.is_cuda()) continue;
    const uint64_t element = element_bytes(write.dtype);
    for_each_part_copy(part_base(write), parameter.parts[write.part], element, write,
                       [&](std::byte* destination, uint64_t destination_pitch, const std::byte* source,
                           uint64_t source_pitch, uint64_t width, uint64_t rows) {
                         copies.push_back(
                             {destination, destination_pitch, source, source_pitch, width, rows, write.keepalive.get()});
                       });
  }
  if (copies.empty() && quantized.empty()) return;
  std::shared_ptr<const void> keepalive;
  if (keepalives.size() == 1) {
    keepalive = std::move(keepalives.front());
  } else if (!keepalives.empty()) {
    keepalive = std::make_shared<std::vector<std::shared_ptr<const void>>>(std::move(keepalives));
  }
  const std::string what = first == last ? "tensor '" + std::string(first->name) + "'"
                                         : "tensors '" + std::string(first->name) + "' to '" +
                                               std::string(last->name) + "' of one batch";
  if (!copies.empty()) writer->copy_from_host(copies, keepalive, what);
  if (!quantized.empty()) writer->quantize_e4m3(quantized, std::move(keepalive), writer->take_lane(), what);
}

void LoadSession::State::write_changes(const ParameterPart& part, const Write& write, std::byte* base) {
  const Dtype held = layout.parameters()[write.parameter].dtype;
  const ChangedElements* changes = write.changes.get();
  ChangedElements converted;
  if (held != write.dtype) {
    converted.indices = changes->indices;
    converted.values.resize(changes->indices.size() * element_bytes(held));
    convert_elements(converted.values.data(), held, changes->values.data(), write.dtype, changes->indices.size());
    changes = &converted;
  }
  switch (element_bytes(held)) {
    case 1: return scatter_changes<1>(*changes, part, base);
    case 2: return scatter_changes<2>(*changes, part, base);
    case 4: return scatter_changes<4>(*changes, part, base);
    case 8: return scatter_changes<8>(*changes, part, base);
  }
  WS_FAIL(ErrorCode::kInternal, "tensor " + std::string(write.name) + ": changed elements of " +
                                    std::string(dtype_name(write.dtype)) + " cannot be written");
}

template <uint64_t kElement>
void LoadSession::State::scatter_changes(const ChangedElements& changes, const ParameterPart& part, std::byte* base) {
  const auto tensor_columns = static_cast<uint64_t>(part.tensor_columns());
  const auto column_begin = static_cast<uint64_t>(part.column_begin);
  const auto columns = static_cast<uint64_t>(part.columns);
  const uint64_t first = static_cast<uint64_t>(part.row_begin) * tensor_columns;
  const uint64_t end = first + static_cast<uint64_t>(part.rows) * tensor_columns;
  const auto begin = std::lower_bound(changes.indices.begin(), changes.indices.end(), first);
  const std::byte* values = changes.values.data();
  for (auto at = begin; at != changes.indices.end() && *at < end; ++at) {
    const auto k = static_cast<uint64_t>(at - changes.indices.begin());
    uint64_t element = *at - first;  // in the part, when it holds whole rows
    if (!part.contiguous()) {
      const uint64_t column = *at % tensor_columns;
      if (column < column_begin || column >= column_begin + columns) continue;  // another rank's columns
      element = (element / tensor_columns) * columns + column - column_begin;
    }
    std::memcpy(base + element * kElement, values + k * kElement, kElement);
  }
}

void LoadSession::State::write_quantized(const Parameter& parameter, const Write& write, std::byte* base) {
  const ParameterPart& part = parameter.parts[write.part];
  PartState& part_state = parameters[write.parameter].parts[write.part];
  const auto rows = static_cast<uint64_t>(part.rows), columns = static_cast<uint64_t>(part.columns);
  std::vector<float> values(rows * columns);
  convert_elements(reinterpret_cast<std::byte*>(values.data()), Dtype::kF32, part_state.assembly.data(), write.dtype,
                   rows * columns);
  std::vector<std::byte>().swap(part_state.assembly);
  const Parameter& scale = layout.parameter(parameter.block_scale);
  const ParameterPart& scale_part = scale.parts[write.part];
  auto codes = std::make_shared<std::vector<std::byte>>(rows * columns);
  auto scales = std::make_shared<std::vector<float>>(scale_part.elements());
  model::quantize_e4m3_blocks(values, rows, columns, parameter.scale_block, *codes, *scales);
  writer->copy(base, codes->data(), kHost, codes->size(), codes, write.name);
  writer->copy(scale.data + scale_part.element_offset * sizeof(float), reinterpret_cast<const std::byte*>(scales->data()),
               kHost, scales->size() * sizeof(float), scales, write.name);
}

void LoadSession::State::write_quantized_on_device(const Parameter& parameter, const Write& write, std::byte* base,
                               std::vector<E4m3BlockJob>* batch) {
  const ParameterPart& part = parameter.parts[write.part];
  PartState& part_state = parameters[write.parameter].parts[write.part];
  const uint64_t element = element_bytes(write.dtype);
  const uint64_t needed_bytes = slice_bytes(part, element);
  const Parameter& scale = layout.parameter(parameter.block_scale);
  const ParameterPart& scale_part = scale.parts[write.part];
  E4m3BlockJob job;
  job.dtype = write.dtype;
  job.rows = static_cast<uint64_t>(part.rows);
  job.columns = static_cast<uint64_t>(part.columns);
  job.block_rows = static_cast<uint64_t>(parameter.scale_block[0]);
  job.block_columns = static_cast<uint64_t>(parameter.scale_block[1]);
  job.codes = base;
  job.scales = reinterpret_cast<float*>(scale.data + scale_part.element_offset * sizeof(float));
  if (write.device.is_cuda() && part_state.assembled == 0 && write.needed == needed_bytes) {
    const uint64_t row_bytes = static_cast<uint64_t>(part.tensor_columns()) * element;
    const uint64_t first = static_cast<uint64_t>(part.row_begin) * row_bytes +
                           static_cast<uint64_t>(part.column_begin) * element;  // the slice's first byte
    job.source = write.source + (first - write.begin);
    job.source_pitch = row_bytes;
    if (reinterpret_cast<uintptr_t>(job.source) % element == 0) {
      part_state.assembled = needed_bytes;
      if (batch) return batch->push_back(job);
      return writer->quantize_e4m3(std::span(&job, 1), write.keepalive, writer->take_lane(),
                                   "tensor '" + std::string(write.name) + "'");
    }
  }
  if (!part_state.device_assembly) {
    part_state.lane = writer->take_lane();
    part_state.device_assembly = writer->scratch(needed_bytes, part_state.lane);
  }
  write_part_bytes(*writer, part_state.device_assembly->data(), part, element, write, part_state.lane);
  part_state.assembled += write.needed;
  if (part_state.assembled < needed_bytes) return;
  job.source = part_state.device_assembly->data();
  job.source_pitch = job.columns * element;
  writer->quantize_e4m3(std::span(&job, 1), nullptr, part_state.lane, "tensor '" + std::string(write.name) + "'");
  part_state.device_assembly.reset();  // back to the pool after the kernel, in the lane's order
}

void LoadSession::State::write_engine(std::span<const Write> writes) {
  std::vector<CopyRange> host_copies;    // from host memory, or all on the host
  std::vector<CopyRange> device_copies;  // from and to the layout's GPU
  std::vector<std::shared_ptr<const void>> device_keepalives;
  for (const Write& write : writes) {
    const Parameter& parameter = layout.parameters()[write.parameter];
    const uint64_t length = write.end - write.begin;
    if (parameter.device == write.device && write.device.is_cuda()) {
      device_copies.push_back({parameter.data + write.begin, write.source, length});
      device_keepalives.push_back(write.keepalive);
    } else if (parameter.device == write.device || !write.device.is_cuda()) {
      host_copies.push_back({parameter.data + write.begin, write.source, length});
    } else {
      writer->copy(parameter.data + write.begin, write.source, write.device, length, write.keepalive, write.name);
    }
  }
  writer->copy_ranges(host_copies, kHost, {});
  writer->copy_ranges(device_copies, layout.device(), std::move(device_keepalives));
}

std::byte* LoadSession::State::part_base(const Write& write) {
  Parameter& parameter = layout.mutable_parameter(write.parameter);
  std::byte* base = parameter.processing != Processing::kNone ? parameters[write.parameter].staging.data()
                                                               : parameter.data;
  return base + parameter.parts[write.part].element_offset * element_bytes(parameter.load_dtype);
}

}  // namespace weightstream
