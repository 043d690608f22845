// Element conversions of the model layer: BF16, F16 and F32 on copy, FP8 E4M3 quantization
// codes and the host quantizer of FP8 blocks. Host code; a device path converts through host
// memory, except FP8 block quantization into GPU parameters (src/device/quantize_kernels.cu).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include "model/fp8_blocks.hpp"
#include "weightstream/error.hpp"
#include "weightstream/model.hpp"

namespace weightstream {
namespace {

float bf16_to_float(uint16_t bits) noexcept { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

uint16_t float_to_bf16(float value) noexcept {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x0040);  // keep it a quiet NaN
  // Round to nearest, ties to even, on the 16 bits dropped.
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

float f16_to_float(uint16_t bits) noexcept {
  uint32_t sign = static_cast<uint32_t>(bits & 0x8000) << 16;
  uint32_t exponent = (bits >> 10) & 0x1F;
  uint32_t mantissa = bits & 0x3FF;
  if (exponent == 0x1F) return std::bit_cast<float>(sign | 0x7F800000 | (mantissa << 13));
  if (exponent == 0) {
    // Subnormal: mantissa * 2^-24, exact in float.
    float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint16_t float_to_f16(float value) noexcept {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  float magnitude = std::fabs(value);
  if (std::isnan(value)) return static_cast<uint16_t>(sign | 0x7E00);
  if (magnitude >= 65520.0f) return static_cast<uint16_t>(sign | 0x7C00);  // rounds to infinity
  if (magnitude < 6.103515625e-05f) {
    // Subnormal range: units of 2^-24, rounded to nearest even by nearbyint's default mode.
    auto units = static_cast<uint16_t>(std::nearbyint(std::ldexp(magnitude, 24)));
    return static_cast<uint16_t>(sign | units);  // 1024 units carry into the smallest normal
  }
  int exponent = 0;
  std::frexp(magnitude, &exponent);  // magnitude = m * 2^exponent, m in [0.5, 1)
  auto units = static_cast<uint32_t>(std::nearbyint(std::ldexp(magnitude, 11 - exponent)));  // in [1024, 2048]
  if (units == 2048) {
    units = 1024;
    ++exponent;
  }
  uint32_t biased = static_cast<uint32_t>(exponent - 1 + 15);
  if (biased >= 0x1F) return static_cast<uint16_t>(sign | 0x7C00);
  return static_cast<uint16_t>(sign | (biased << 10) | (units - 1024));
}

float load_float(const std::byte* source, Dtype dtype, uint64_t index) noexcept {
  switch (dtype) {
    case Dtype::kF32: {
      float value;
      std::memcpy(&value, source + index * 4, 4);
      return value;
    }
    case Dtype::kBF16: {
      uint16_t bits;
      std::memcpy(&bits, source + index * 2, 2);
      return bf16_to_float(bits);
    }
    default: {
      uint16_t bits;
      std::memcpy(&bits, source + index * 2, 2);
      return f16_to_float(bits);
    }
  }
}

void store_float(std::byte* destination, Dtype dtype, uint64_t index, float value) noexcept {
  switch (dtype) {
    case Dtype::kF32: std::memcpy(destination + index * 4, &value, 4); break;
    case Dtype::kBF16: {
      uint16_t bits = float_to_bf16(value);
      std::memcpy(destination + index * 2, &bits, 2);
      break;
    }
    default: {
      uint16_t bits = float_to_f16(value);
      std::memcpy(destination + index * 2, &bits, 2);
      break;
    }
  }
}

bool is_convertible_float(Dtype dtype) noexcept {
  return dtype == Dtype::kBF16 || dtype == Dtype::kF16 || dtype == Dtype::kF32;
}

}  // namespace

std::string_view split_name(Split split) noexcept {
  switch (split) {
    case Split::kReplicated: return "replicated";
    case Split::kColumn: return "column";
    case Split::kRow: return "row";
    case Split::kVocab: return "vocab";
    case Split::kKvHeads: return "kv_heads";
    case Split::kColumnSections: return "column_sections";
  }
  return "unknown";
}

std::string_view load_mode_name(LoadMode mode) noexcept {
  switch (mode) {
    case LoadMode::kCold: return "cold";
    case LoadMode::kReload: return "reload";
    case LoadMode::kUpdate: return "update";
  }
  return "unknown";
}

uint8_t float_to_e4m3(float value) noexcept {
  if (std::isnan(value)) return 0x7F;
  uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  float magnitude = std::fabs(value);
  // Saturate: E4M3FN has no infinity; 448 = 1.75 * 2^8 is its largest finite value.
  if (magnitude >= 448.0f) return static_cast<uint8_t>(sign | 0x7E);
  if (magnitude < 0.015625f) {
    // Subnormals are multiples of 2^-9; 8 units carry into the smallest normal (code 0x08).
    auto units = static_cast<uint8_t>(std::nearbyint(std::ldexp(magnitude, 9)));
    return static_cast<uint8_t>(sign | units);
  }
  int exponent = 0;
  std::frexp(magnitude, &exponent);  // magnitude = m * 2^exponent, m in [0.5, 1)
  auto units = static_cast<uint32_t>(std::nearbyint(std::ldexp(magnitude, 4 - exponent)));  // in [8, 16]
  if (units == 16) {
    units = 8;
    ++exponent;
  }
  uint32_t biased = static_cast<uint32_t>(exponent - 1 + 7);
  uint32_t code = (biased << 3) | (units - 8);
  if (code > 0x7E) code = 0x7E;  // rounding above 448 saturates too
  return static_cast<uint8_t>(sign | code);
}

float e4m3_to_float(uint8_t code) noexcept {
  bool negative = (code & 0x80) != 0;
  uint32_t exponent = (code >> 3) & 0x0F;
  uint32_t mantissa = code & 0x07;
  float magnitude;
  if (exponent == 0x0F && mantissa == 0x07) return std::nanf("");
  if (exponent == 0) magnitude = std::ldexp(static_cast<float>(mantissa), -9);
  else magnitude = std::ldexp(static_cast<float>(8 + mantissa), static_cast<int>(exponent) - 7 - 3);
  return negative ? -magnitude : magnitude;
}

void convert_elements(std::byte* destination, Dtype destination_dtype, const std::byte* source, Dtype source_dtype,
                      uint64_t elements) {
  if (destination_dtype == source_dtype) {
    std::memcpy(destination, source, elements * (dtype_bits(source_dtype) / 8));
    return;
  }
  WS_EXPECT(is_convertible_float(destination_dtype) && is_convertible_float(source_dtype), ErrorCode::kModel,
            "cannot convert " + std::string(dtype_name(source_dtype)) + " to " +
                std::string(dtype_name(destination_dtype)) + ": only BF16, F16 and F32 convert on copy");
  for (uint64_t i = 0; i < elements; ++i) {
    store_float(destination, destination_dtype, i, load_float(source, source_dtype, i));
  }
}

void quantize_fp8_blocks(std::span<const std::byte> values, Dtype dtype, uint64_t rows, uint64_t columns,
                         std::array<int64_t, 2> block, std::span<std::byte> codes, std::span<float> scales) {
  WS_EXPECT(is_convertible_float(dtype), ErrorCode::kModel,
            "cannot quantize " + std::string(dtype_name(dtype)) + " into FP8 blocks: only BF16, F16 and F32");
  WS_EXPECT(block[0] > 0 && block[1] > 0, ErrorCode::kModel,
            "FP8 blocks of " + std::to_string(block[0]) + " x " + std::to_string(block[1]) + " elements");
  const uint64_t elements = rows * columns;
  const auto block_rows = static_cast<uint64_t>(block[0]), block_columns = static_cast<uint64_t>(block[1]);
  const uint64_t scale_count = (rows + block_rows - 1) / block_rows * ((columns + block_columns - 1) / block_columns);
  WS_EXPECT(values.size() == elements * (dtype_bits(dtype) / 8) && codes.size() == elements &&
                scales.size() == scale_count,
            ErrorCode::kModel,
            "FP8 quantization of " + std::to_string(rows) + " x " + std::to_string(columns) + " " +
                std::string(dtype_name(dtype)) + " values: given " + std::to_string(values.size()) + " bytes of values, " +
                std::to_string(codes.size()) + " codes and " + std::to_string(scales.size()) + " scales (" +
                std::to_string(scale_count) + " blocks)");
  std::vector<float> floats(elements);
  convert_elements(reinterpret_cast<std::byte*>(floats.data()), Dtype::kF32, values.data(), dtype, elements);
  model::quantize_e4m3_blocks(floats, rows, columns, block, codes, scales);
}

namespace model {

void quantize_e4m3_blocks(std::span<const float> values, uint64_t rows, uint64_t columns, std::array<int64_t, 2> block,
                          std::span<std::byte> codes, std::span<float> scales) {
  constexpr float kE4M3Max = 448.0f;
  const auto block_rows = static_cast<uint64_t>(block[0]), block_columns = static_cast<uint64_t>(block[1]);
  const uint64_t scale_columns = (columns + block_columns - 1) / block_columns;
  for (uint64_t row0 = 0; row0 < rows; row0 += block_rows) {
    const uint64_t row1 = std::min(rows, row0 + block_rows);
    for (uint64_t column0 = 0; column0 < columns; column0 += block_columns) {
      const uint64_t column1 = std::min(columns, column0 + block_columns);
      float amax = 0;
      for (uint64_t r = row0; r < row1; ++r) {
        for (uint64_t c = column0; c < column1; ++c) amax = std::max(amax, std::fabs(values[r * columns + c]));
      }
      const float scale = amax > 0 ? amax / kE4M3Max : 1.0f;
      scales[(row0 / block_rows) * scale_columns + column0 / block_columns] = scale;
      for (uint64_t r = row0; r < row1; ++r) {
        for (uint64_t c = column0; c < column1; ++c) {
          codes[r * columns + c] = std::byte{float_to_e4m3(values[r * columns + c] / scale)};
        }
      }
    }
  }
}

}  // namespace model
}  // namespace weightstream
