#pragma once
// One write of a LoadSession's checked batch (PieceWrite) and the arithmetic of where its
// bytes go: which bytes of a tensor a part's slice takes (its columns of its rows), where
// each lies in the piece's source (packed or not) and the rectangles that copy them into the
// part. Shared by the session's checks, held pieces and writes (session_*.cpp).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "model/parameter_writer.hpp"
#include "weightstream/error.hpp"
#include "weightstream/model.hpp"

namespace weightstream::model {

inline uint64_t element_bytes(Dtype dtype) { return dtype_bits(dtype) / 8; }

inline bool is_float(Dtype dtype) { return dtype == Dtype::kBF16 || dtype == Dtype::kF16 || dtype == Dtype::kF32; }

inline bool convertible(Dtype from, Dtype to) { return from == to || (is_float(from) && is_float(to)); }

/// Whether a piece of `dtype` written into `parameter` is quantized into its FP8 blocks (a
/// trainer pushing BF16 weights into an FP8 block-scaled model).
inline bool quantizes_into(Dtype dtype, const Parameter& parameter) {
  return !parameter.block_scale.empty() && parameter.load_dtype == Dtype::kF8E4M3 && is_float(dtype);
}

/// The index of the FP8 block-scaled weight whose scales `parameter` holds, if it does.
std::optional<size_t> scaled_weight(const ModelLayout& layout, const Parameter& parameter);

/// Bytes of `part`'s slice (its columns of its rows) in `element`-byte elements: what a
/// load must deliver of its tensor, whichever gaps between its rows come along.
inline uint64_t slice_bytes(const ParameterPart& part, uint64_t element) { return part.elements() * element; }

/// The bytes of `part`'s slice among bytes [begin, end) of its tensor (elements of `element`
/// bytes): whole rows count their columns of the slice, a partial row what it holds of them.
uint64_t slice_bytes_within(const ParameterPart& part, uint64_t element, uint64_t begin, uint64_t end);

/// Calls `copy(slice_offset, position, length)` for each row's run of `part`'s slice among
/// bytes [begin, end) of its tensor: `position` in the tensor, `slice_offset` in the slice
/// laid out compactly (row after row of its columns).
template <typename Copy>
void for_each_slice_run(const ParameterPart& part, uint64_t element, uint64_t begin, uint64_t end, Copy&& copy) {
  const uint64_t row_bytes = static_cast<uint64_t>(part.tensor_columns()) * element;
  const uint64_t needed_begin = static_cast<uint64_t>(part.row_begin) * row_bytes;
  const uint64_t column_begin = static_cast<uint64_t>(part.column_begin) * element;
  const uint64_t width = static_cast<uint64_t>(part.columns) * element;
  if (row_bytes == 0 || end <= begin) return;
  for (uint64_t row = (begin - needed_begin) / row_bytes; row < static_cast<uint64_t>(part.rows); ++row) {
    const uint64_t run = needed_begin + row * row_bytes + column_begin;
    if (run >= end) break;
    const uint64_t lo = std::max(begin, run), hi = std::min(end, run + width);
    if (lo < hi) copy(row * width + (lo - run), lo, hi - lo);
  }
}

/// One write of a checked batch: bytes [begin, end) of a tensor into one part of one
/// parameter (checkpoint format) or into a parameter (engine format).
struct PieceWrite {
  size_t parameter = 0;
  size_t part = 0;
  uint64_t begin = 0, end = 0;        ///< bytes of the tensor, within the needed range
  uint64_t needed = 0;                ///< bytes of [begin, end) the part takes (its columns of those rows)
  const std::byte* source = nullptr;  ///< the bytes of [begin, end) (packed: the runs among them, source_at())
  uint64_t packed_run = 0, packed_stride = 0;  ///< as TensorView's: the source holds only runs
  Device device;
  Dtype dtype = Dtype::kBF16;
  SourceLifetime lifetime = SourceLifetime::kCall;
  std::shared_ptr<const void> keepalive;
  std::string_view name;
  std::shared_ptr<const ChangedElements> changes;  ///< set: the part's changed elements, not bytes at `source`
};


/// Where the byte at tensor position `position` (in [write.begin, write.end); packed: in
/// one of its runs) lies in the write's source.
inline const std::byte* source_at(const PieceWrite& write, uint64_t position) {
  const uint64_t from = position - write.begin;
  if (write.packed_run == 0) return write.source + from;
  return write.source + from / write.packed_stride * write.packed_run + from % write.packed_stride;
}

/// The bytes at a write's source: [begin, end) as it lies, or packed, its runs alone.
uint64_t source_bytes(const PieceWrite& write);

/// Calls `rectangle(destination, destination_pitch, source, source_pitch, width, rows)` for
/// each copy that writes the bytes of `write` (in the parameter's load dtype) into one part
/// at `base`: a run of a row slice lands where it belongs; a column slice is written as the
/// partial rows at the piece's ends (one row each) and one rectangle of the whole rows
/// between them, which reads only the slice's columns (a piece of a strided read holds
/// nothing else).
template <typename Rectangle>
void for_each_part_copy(std::byte* base, const ParameterPart& part, uint64_t element, const PieceWrite& write,
                        Rectangle&& rectangle) {
  const uint64_t row_bytes = static_cast<uint64_t>(part.tensor_columns()) * element;
  const uint64_t needed_begin = static_cast<uint64_t>(part.row_begin) * row_bytes;
  const uint64_t length = write.end - write.begin;
  const uint64_t column_begin = static_cast<uint64_t>(part.column_begin) * element;
  const uint64_t width = static_cast<uint64_t>(part.columns) * element;  // destination row pitch too
  // A packed source holds exactly this part's window of each row (its read's runs).
  WS_EXPECT(write.packed_run == 0 || (!part.contiguous() && write.packed_stride == row_bytes && write.packed_run == width),
            ErrorCode::kInternal,
            "tensor " + std::string(write.name) + ": a packed piece of runs of " + std::to_string(write.packed_run) +
                " bytes every " + std::to_string(write.packed_stride) + " does not match its part's column window");
  if (part.contiguous()) {
    rectangle(base + (write.begin - needed_begin), length, write.source, length, length, 1);
    return;
  }
  // Positions count from the needed range's first byte, rows from the part's first row.
  const uint64_t first = write.begin - needed_begin;
  const uint64_t last = write.end - needed_begin;
  const uint64_t source_pitch = write.packed_run ? width : row_bytes;
  auto source_at = [&](uint64_t position) { return model::source_at(write, position + needed_begin); };
  auto write_partial_row = [&](uint64_t row, uint64_t from, uint64_t to) {
    // The part's columns of `row` that lie in [from, to).
    uint64_t columns_from = row * row_bytes + column_begin;
    uint64_t lo = std::max(from, columns_from);
    uint64_t hi = std::min(to, columns_from + width);
    if (lo >= hi) return;
    rectangle(base + row * width + (lo - columns_from), hi - lo, source_at(lo), hi - lo, hi - lo, 1);
  };
  uint64_t row = first / row_bytes;
  uint64_t position = first;
  if (position % row_bytes != 0 || last - position < row_bytes) {
    uint64_t row_end = std::min(last, (row + 1) * row_bytes);
    write_partial_row(row, position, row_end);
    position = row_end;
    ++row;
  }
  uint64_t whole_rows = (last - position) / row_bytes;
  if (whole_rows > 0) {
    rectangle(base + row * width, width, source_at(position + column_begin), source_pitch, width, whole_rows);
    position += whole_rows * row_bytes;
    row += whole_rows;
  }
  if (position < last) write_partial_row(row, position, last);
}

/// Writes the bytes of `write` (in the parameter's load dtype) into one part through
/// `writer` (for_each_part_copy()). On a GPU, every copy runs on lane `lane` when given.
void write_part_bytes(ParameterWriter& writer, std::byte* base, const ParameterPart& part, uint64_t element,
                      const PieceWrite& write, std::optional<unsigned> lane = std::nullopt);

}  // namespace weightstream::model
