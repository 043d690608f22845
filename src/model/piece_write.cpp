#include "model/piece_write.hpp"

namespace weightstream::model {

std::optional<size_t> scaled_weight(const ModelLayout& layout, const Parameter& parameter) {
  constexpr std::string_view kSuffix = "_scale_inv";
  if (!parameter.name.ends_with(kSuffix)) return std::nullopt;
  auto weight = layout.find(std::string_view(parameter.name).substr(0, parameter.name.size() - kSuffix.size()));
  if (!weight || layout.parameters()[*weight].block_scale != parameter.name) return std::nullopt;
  return weight;
}
uint64_t slice_bytes_within(const ParameterPart& part, uint64_t element, uint64_t begin, uint64_t end) {
  const uint64_t row_bytes = static_cast<uint64_t>(part.tensor_columns()) * element;
  const uint64_t needed_begin = static_cast<uint64_t>(part.row_begin) * row_bytes;
  const uint64_t needed_length = static_cast<uint64_t>(part.rows) * row_bytes;
  const uint64_t column_begin = static_cast<uint64_t>(part.column_begin) * element;
  const uint64_t width = static_cast<uint64_t>(part.columns) * element;
  if (row_bytes == 0) return 0;
  // Slice bytes before position x of the needed rows.
  auto before = [&](uint64_t position) {
    uint64_t x = std::clamp(position, needed_begin, needed_begin + needed_length) - needed_begin;
    uint64_t in_row = x % row_bytes;
    return (x / row_bytes) * width + std::min(width, in_row > column_begin ? in_row - column_begin : 0);
  };
  return before(end) - before(begin);
}
uint64_t source_bytes(const PieceWrite& write) {
  const uint64_t span = write.end - write.begin;
  if (write.packed_run == 0) return span;
  return (span - std::min(span, write.packed_run)) / write.packed_stride * write.packed_run + write.packed_run;
}
void write_part_bytes(ParameterWriter& writer, std::byte* base, const ParameterPart& part, uint64_t element,
                      const PieceWrite& write, std::optional<unsigned> lane) {
  for_each_part_copy(base, part, element, write,
                     [&](std::byte* destination, uint64_t destination_pitch, const std::byte* source,
                         uint64_t source_pitch, uint64_t width, uint64_t rows) {
                       writer.copy_rows(destination, destination_pitch, source, write.device, source_pitch, width, rows,
                                        write.keepalive, write.name, lane);
                     });
}
}  // namespace weightstream::model
