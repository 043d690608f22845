// The dtype table of the safetensors format and tensor byte sizes.

#include <array>

#include "weightstream/format.hpp"

namespace weightstream {
namespace {

struct DtypeRow {
  Dtype dtype;
  std::string_view name;
  unsigned bits;
};

// Indexed by the enum value; the static_assert below keeps the two in step.
constexpr std::array<DtypeRow, 22> kDtypeTable = {{
    {Dtype::kBool, "BOOL", 8},
    {Dtype::kU8, "U8", 8},
    {Dtype::kI8, "I8", 8},
    {Dtype::kI16, "I16", 16},
    {Dtype::kU16, "U16", 16},
    {Dtype::kF16, "F16", 16},
    {Dtype::kBF16, "BF16", 16},
    {Dtype::kI32, "I32", 32},
    {Dtype::kU32, "U32", 32},
    {Dtype::kF32, "F32", 32},
    {Dtype::kF64, "F64", 64},
    {Dtype::kI64, "I64", 64},
    {Dtype::kU64, "U64", 64},
    {Dtype::kC64, "C64", 64},
    {Dtype::kF8E4M3, "F8_E4M3", 8},
    {Dtype::kF8E5M2, "F8_E5M2", 8},
    {Dtype::kF8E8M0, "F8_E8M0", 8},
    {Dtype::kF8E4M3Fnuz, "F8_E4M3FNUZ", 8},
    {Dtype::kF8E5M2Fnuz, "F8_E5M2FNUZ", 8},
    {Dtype::kF4, "F4", 4},
    {Dtype::kF6E2M3, "F6_E2M3", 6},
    {Dtype::kF6E3M2, "F6_E3M2", 6},
}};

constexpr bool table_matches_enum() {
  for (size_t i = 0; i < kDtypeTable.size(); ++i) {
    if (static_cast<size_t>(kDtypeTable[i].dtype) != i) return false;
  }
  return true;
}
static_assert(table_matches_enum(), "kDtypeTable must list the dtypes in enum order");

const DtypeRow* find_row(Dtype dtype) noexcept {
  auto index = static_cast<size_t>(dtype);
  return index < kDtypeTable.size() ? &kDtypeTable[index] : nullptr;
}

}  // namespace

std::string_view dtype_name(Dtype dtype) noexcept {
  const DtypeRow* row = find_row(dtype);
  return row ? row->name : std::string_view("?");
}

std::optional<Dtype> dtype_from_name(std::string_view name) noexcept {
  for (const DtypeRow& row : kDtypeTable) {
    if (row.name == name) return row.dtype;
  }
  return std::nullopt;
}

unsigned dtype_bits(Dtype dtype) noexcept {
  const DtypeRow* row = find_row(dtype);
  return row ? row->bits : 0;
}

std::optional<uint64_t> tensor_element_count(std::span<const int64_t> shape) noexcept {
  uint64_t count = 1;
  for (int64_t dimension : shape) {
    if (dimension < 0) return std::nullopt;
    if (__builtin_mul_overflow(count, static_cast<uint64_t>(dimension), &count)) return std::nullopt;
  }
  return count;
}

std::optional<uint64_t> tensor_byte_size(Dtype dtype, std::span<const int64_t> shape) noexcept {
  std::optional<uint64_t> count = tensor_element_count(shape);
  unsigned bits = dtype_bits(dtype);
  uint64_t total_bits = 0;
  if (!count || bits == 0 || __builtin_mul_overflow(*count, uint64_t{bits}, &total_bits)) return std::nullopt;
  // Sub-byte dtypes (F4, F6_*) pack elements; a tensor must still end on a byte boundary.
  if (total_bits % 8 != 0) return std::nullopt;
  return total_bits / 8;
}

std::string shape_text(std::span<const int64_t> shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(shape[i]);
  }
  text += "]";
  return text;
}

}  // namespace weightstream
