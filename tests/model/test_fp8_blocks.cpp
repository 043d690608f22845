// The FP8 block quantization rule (src/model/fp8_blocks.hpp, src/device/e4m3_rule.hpp): the
// host quantizer does what its comment says, the device rule equals it bit for bit on the
// CPU, and, on a GPU, the kernel's codes and scales equal the host quantizer's byte for byte.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "device/e4m3_rule.hpp"
#include "device/shared/quantize.hpp"
#include "model/fp8_blocks.hpp"
#include "weightstream/device.hpp"
#include "weightstream/model.hpp"
#include "support/skip_without_gpu.hpp"

namespace weightstream {
namespace {

const Device kCuda0{Device::Kind::kCuda, 0};

uint16_t bf16_bits(float value) { return static_cast<uint16_t>(std::bit_cast<uint32_t>(value) >> 16); }
float bf16_float(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

struct Quantized {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
};

/// The host quantizer on `values` [rows x columns] in blocks of 128 x 128 (or `block`).
Quantized host_quantized(const std::vector<float>& values, uint64_t rows, uint64_t columns,
                         std::array<int64_t, 2> block = {128, 128}) {
  const uint64_t scale_rows = (rows + block[0] - 1) / block[0], scale_columns = (columns + block[1] - 1) / block[1];
  std::vector<std::byte> codes(rows * columns);
  Quantized result;
  result.scales.resize(scale_rows * scale_columns);
  model::quantize_e4m3_blocks(values, rows, columns, block, codes, result.scales);
  for (std::byte code : codes) result.codes.push_back(static_cast<uint8_t>(code));
  return result;
}

/// The device rule run on the CPU as the kernel runs it: 256 strided per-thread maxima
/// combined as a tree, then one code per value.
Quantized rule_quantized(const std::vector<float>& values, uint64_t rows, uint64_t columns, uint64_t block = 128) {
  const uint64_t scale_rows = (rows + block - 1) / block, scale_columns = (columns + block - 1) / block;
  Quantized result{std::vector<uint8_t>(rows * columns), std::vector<float>(scale_rows * scale_columns)};
  for (uint64_t br = 0; br < scale_rows; ++br) {
    for (uint64_t bc = 0; bc < scale_columns; ++bc) {
      const uint64_t block_rows = std::min(block, rows - br * block), block_columns = std::min(block, columns - bc * block);
      std::vector<float> partial(256, 0.0f);
      for (uint64_t i = 0; i < block_rows * block_columns; ++i) {
        const uint64_t r = br * block + i / block_columns, c = bc * block + i % block_columns;
        partial[i % 256] = detail::amax_with(partial[i % 256], values[r * columns + c]);
      }
      for (size_t width = 128; width > 0; width /= 2) {
        for (size_t t = 0; t < width; ++t) partial[t] = detail::amax_with(partial[t], partial[t + width]);
      }
      const float scale = detail::e4m3_block_scale(partial[0]);
      result.scales[br * scale_columns + bc] = scale;
      for (uint64_t r = br * block; r < br * block + block_rows; ++r) {
        for (uint64_t c = bc * block; c < bc * block + block_columns; ++c) {
          result.codes[r * columns + c] = detail::e4m3_block_code(values[r * columns + c], scale);
        }
      }
    }
  }
  return result;
}

/// Indices where two byte arrays differ, the first few, for a message.
template <typename T>
std::string differences(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return "sizes " + std::to_string(a.size()) + " and " + std::to_string(b.size());
  std::string text;
  size_t count = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) == 0) continue;
    if (++count <= 5) text += " [" + std::to_string(i) + "]";
  }
  return count == 0 ? "" : std::to_string(count) + " differ:" + text;
}

/// A [300 x 200] matrix (blocks 3 x 2, the last row and column of blocks partial) with a block
/// of every kind the rule treats apart: random values, zeros (and -0), huge magnitudes, BF16
/// subnormals, a largest value that rounds to 448 from above, exact ties of E4M3, NaN,
/// infinity. Every value is a BF16 value, so BF16, F16 (where in range) and F32 sources agree.
std::vector<float> hard_matrix(uint64_t rows, uint64_t columns, uint32_t seed) {
  std::mt19937 random(seed);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<float> values(rows * columns);
  for (float& value : values) value = bf16_float(bf16_bits(normal(random)));
  auto block = [&](uint64_t br, uint64_t bc, auto&& fill) {
    for (uint64_t r = br * 128; r < std::min(rows, br * 128 + 128); ++r) {
      for (uint64_t c = bc * 128; c < std::min(columns, bc * 128 + 128); ++c) {
        values[r * columns + c] = bf16_float(bf16_bits(fill(r - br * 128, c - bc * 128)));
      }
    }
  };
  // (0, 1): all zero, half of them -0: scale 1, codes 0x00 and 0x80.
  block(0, 1, [](uint64_t r, uint64_t c) { return (r + c) % 2 ? -0.0f : 0.0f; });
  // (1, 0): huge magnitudes near BF16's largest, and a few ordinary ones that become 0.
  block(1, 0, [&](uint64_t r, uint64_t c) {
    if ((r * 7 + c) % 13 == 0) return 1.0f;
    return std::ldexp(1.0f + static_cast<float>((r + c) % 128) / 128.0f, 127) * ((r + c) % 3 ? 1.0f : -1.0f);
  });
  // (1, 1): BF16 subnormals only (2^-133 .. 2^-127): a scale that is itself subnormal.
  block(1, 1, [&](uint64_t r, uint64_t c) {
    return std::ldexp(static_cast<float>(1 + (r * 131 + c) % 127), -133) * (c % 2 ? -1.0f : 1.0f);
  });
  // (0, 0): amax 448 (scale exactly 1) and values on exact midpoints between E4M3 codes, normal
  // and subnormal: ties go to the even code.
  block(0, 0, [&](uint64_t r, uint64_t c) {
    if (r == 0 && c == 0) return 448.0f;
    const uint8_t code = static_cast<uint8_t>((r * 128 + c) % 0x7E);
    const float low = e4m3_to_float(code), high = e4m3_to_float(static_cast<uint8_t>(code + 1));
    const float tie = (low + high) / 2;
    return (r % 2) ? -tie : tie;
  });
  // (2, 0): an amax whose scale differs between amax / 448 and amax * (1 / 448), a NaN
  // (passed over by amax), values spread evenly below it.
  block(2, 0, [&](uint64_t r, uint64_t c) {
    if (r == 0 && c == 0) return 1.015625f;  // amax / 448 is not amax * (1 / 448) here
    if (r == 1 && c == 1) return std::numeric_limits<float>::quiet_NaN();
    return static_cast<float>(static_cast<int>((r * 128 + c) % 4001) - 2000) / 2000.0f;
  });
  // (2, 1): infinity in the block: scale inf, infinities become NaN codes, the rest 0.
  block(2, 1, [&](uint64_t r, uint64_t c) {
    if (r == 3 && c == 5) return std::numeric_limits<float>::infinity();
    if (r == 4 && c == 6) return -std::numeric_limits<float>::infinity();
    return normal(random);
  });
  return values;
}

// ---- The host quantizer's rule, as fp8_blocks.hpp documents it (CPU) ---------------------

TEST(Fp8Blocks, ScaleIsAmaxOver448AsOneDivisionNotAMultiplicationByItsReciprocal) {
  // 1.015625 (BF16 0x3f82) is an amax where the two differ in the last bit.
  const float amax = 1.015625f;
  const float divided = amax / 448.0f, multiplied = amax * (1.0f / 448.0f);
  ASSERT_NE(divided, multiplied);
  std::vector<float> values(128 * 128, 0.5f);
  values[77] = -amax;
  Quantized host = host_quantized(values, 128, 128);
  EXPECT_EQ(host.scales[0], divided);
  EXPECT_EQ(host.codes[77], 0xFE);  // -amax / scale rounds to -448
}

TEST(Fp8Blocks, CodesAreTheQuotientByTheScaleNotTheProductWithItsReciprocal) {
  // In a block of amax 1.03125 (BF16 0x3f84), x = 0x1.08p-16 (BF16 0x3784) gives x / scale =
  // 0x1.cp-8, exactly a tie between two E4M3 subnormals, but x * (1 / scale) = 0x1.bffffep-8,
  // just below it: the codes differ (140 such pairs among BF16 amax in [1, 2) and x below it).
  const float amax = bf16_float(0x3f84), x = bf16_float(0x3784);
  const float scale = amax / 448.0f, reciprocal = 1.0f / scale;
  ASSERT_NE(float_to_e4m3(x / scale), float_to_e4m3(x * reciprocal));
  std::vector<float> values(128 * 128, 0.0f);
  values[0] = amax;
  values[1] = x;
  Quantized host = host_quantized(values, 128, 128);
  EXPECT_EQ(host.scales[0], scale);
  EXPECT_EQ(host.codes[1], float_to_e4m3(x / scale));
  EXPECT_NE(host.codes[1], float_to_e4m3(x * reciprocal));
}

TEST(Fp8Blocks, ZeroNanInfinityAndPartialBlocksFollowTheDocumentedRule) {
  const uint64_t rows = 130, columns = 129;  // one full block and partial ones of 2 rows, 1 column
  std::vector<float> values(rows * columns, 0.0f);
  values[0] = -0.0f;                                            // block (0, 0): all zero
  values[128] = 3.0f;                                           // block (0, 1): a 128 x 1 column
  values[2 * columns + 128] = std::numeric_limits<float>::quiet_NaN();  // passed over by amax
  values[128 * columns + 0] = std::numeric_limits<float>::infinity();   // block (1, 0)
  values[128 * columns + 1] = 2.0f;
  values[129 * columns + 128] = -5.0f;                          // block (1, 1): one value
  Quantized host = host_quantized(values, rows, columns);
  ASSERT_EQ(host.scales.size(), 4u);
  EXPECT_EQ(host.scales[0], 1.0f);
  EXPECT_EQ(host.codes[0], 0x80);  // -0 keeps its sign
  EXPECT_EQ(host.scales[1], 3.0f / 448.0f);
  EXPECT_EQ(host.codes[128], 0x7E);
  EXPECT_EQ(host.codes[2 * columns + 128], 0x7F);
  EXPECT_TRUE(std::isinf(host.scales[2]));
  EXPECT_EQ(host.codes[128 * columns + 0], 0x7F);  // inf / inf
  EXPECT_EQ(host.codes[128 * columns + 1], 0x00);  // 2 / inf
  EXPECT_EQ(host.scales[3], 5.0f / 448.0f);
  EXPECT_EQ(host.codes[129 * columns + 128], 0xFE);
}

// ---- The device rule equals the host quantizer (CPU) -------------------------------------

TEST(Fp8Blocks, DeviceRuleCodeEqualsFloatToE4m3) {
  auto check = [](float value) {
    ASSERT_EQ(detail::e4m3_code(value), float_to_e4m3(value)) << "value " << value << " bits 0x" << std::hex
                                                                << std::bit_cast<uint32_t>(value);
  };
  // Every E4M3 value, the midpoints between neighbours and a few F32 steps either side of
  // each: where rounding decides.
  for (uint32_t code = 0; code < 0x7F; ++code) {
    for (float sign : {1.0f, -1.0f}) {
      const float low = e4m3_to_float(static_cast<uint8_t>(code)) * sign;
      const float high = e4m3_to_float(static_cast<uint8_t>(code + 1)) * sign;
      for (float point : {low, (low + high) / 2}) {
        uint32_t bits = std::bit_cast<uint32_t>(point);
        for (int step = -16; step <= 16; ++step) check(std::bit_cast<float>(bits + static_cast<uint32_t>(step)));
      }
    }
  }
  // Every BF16 and F16 value (every quotient of a block of 448 by its scale is one), and F32
  // at large strides, subnormals, infinities and NaNs included.
  for (uint32_t bits = 0; bits < 0x10000; ++bits) check(bf16_float(static_cast<uint16_t>(bits)));
  for (uint32_t bits = 0; bits < 0x10000; ++bits) check(detail::f16_value(static_cast<uint16_t>(bits)));
  for (uint64_t bits = 0; bits < (1ull << 32); bits += 1021) check(std::bit_cast<float>(static_cast<uint32_t>(bits)));
  for (uint32_t bits = 0; bits < 0x40000; ++bits) check(std::bit_cast<float>(bits));  // F32 subnormals
}

TEST(Fp8Blocks, DeviceRuleF16ValuesEqualTheHostConversion) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    uint16_t half = static_cast<uint16_t>(bits);
    float host;
    convert_elements(reinterpret_cast<std::byte*>(&host), Dtype::kF32, reinterpret_cast<const std::byte*>(&half),
                     Dtype::kF16, 1);
    const float rule = detail::f16_value(half);
    if (std::isnan(host)) {
      EXPECT_TRUE(std::isnan(rule)) << bits;
    } else {
      EXPECT_EQ(std::bit_cast<uint32_t>(rule), std::bit_cast<uint32_t>(host)) << bits;
    }
  }
}

TEST(Fp8Blocks, DeviceRuleBlocksEqualTheHostQuantizer) {
  for (uint32_t seed : {1u, 2u, 3u}) {
    const uint64_t rows = 300, columns = 200;
    std::vector<float> values = hard_matrix(rows, columns, seed);
    Quantized host = host_quantized(values, rows, columns);
    Quantized rule = rule_quantized(values, rows, columns);
    EXPECT_EQ(differences(host.scales, rule.scales), "") << "scales, seed " << seed;
    EXPECT_EQ(differences(host.codes, rule.codes), "") << "codes, seed " << seed;
  }
}

// ---- The kernel equals the host quantizer (GPU) -------------------------------------------

/// Source bytes of `values` in `dtype`, rows `pitch` elements apart (>= columns).
std::vector<std::byte> source_bytes(const std::vector<float>& values, uint64_t rows, uint64_t columns, Dtype dtype,
                                    uint64_t pitch) {
  const uint64_t element = dtype_bits(dtype) / 8;
  std::vector<std::byte> bytes(rows * pitch * element, std::byte{0x5A});
  for (uint64_t r = 0; r < rows; ++r) {
    convert_elements(bytes.data() + r * pitch * element, dtype, reinterpret_cast<const std::byte*>(&values[r * columns]),
                     Dtype::kF32, columns);
  }
  return bytes;
}

/// The values as the host quantizer sees them: `source` converted to F32.
std::vector<float> seen_values(const std::vector<std::byte>& source, uint64_t rows, uint64_t columns, Dtype dtype,
                               uint64_t pitch) {
  const uint64_t element = dtype_bits(dtype) / 8;
  std::vector<float> values(rows * columns);
  for (uint64_t r = 0; r < rows; ++r) {
    convert_elements(reinterpret_cast<std::byte*>(&values[r * columns]), Dtype::kF32, source.data() + r * pitch * element,
                     dtype, columns);
  }
  return values;
}

Quantized kernel_quantized(const std::vector<std::byte>& source, uint64_t rows, uint64_t columns, Dtype dtype,
                           uint64_t pitch, uint64_t block = 128) {
  const uint64_t element = dtype_bits(dtype) / 8;
  const uint64_t scale_count = ((rows + block - 1) / block) * ((columns + block - 1) / block);
  Buffer device_source(kCuda0, source.size()), codes(kCuda0, rows * columns), scales(kCuda0, scale_count * 4);
  copy_bytes(device_source.data(), kCuda0, source.data(), Device{}, source.size());
  fill_zero(codes.data(), kCuda0, codes.size());
  DeviceCopier copier(kCuda0);
  E4m3BlockJob job;
  job.source = device_source.data();
  job.source_pitch = pitch * element;
  job.dtype = dtype;
  job.rows = rows;
  job.columns = columns;
  job.block_rows = job.block_columns = block;
  job.codes = codes.data();
  job.scales = reinterpret_cast<float*>(scales.data());
  quantize_e4m3_blocks(copier, 1, job, nullptr, "test matrix");
  copier.synchronize();
  Quantized result{std::vector<uint8_t>(rows * columns), std::vector<float>(scale_count)};
  copy_bytes(result.codes.data(), Device{}, codes.data(), kCuda0, codes.size());
  copy_bytes(result.scales.data(), Device{}, scales.data(), kCuda0, scales.size());
  return result;
}

TEST(CudaFp8Blocks, KernelEqualsTheHostQuantizerByteForByte) {
  WS_SKIP_WITHOUT_GPU();
  ASSERT_TRUE(device_quantizes_e4m3()) << "a CUDA build without its kernels";
  struct Shape {
    uint64_t rows, columns, pitch;
  };
  for (Dtype dtype : {Dtype::kBF16, Dtype::kF16, Dtype::kF32}) {
    // 16-byte loads where rows and blocks allow (the first three), one value at a time elsewhere.
    for (Shape shape : {Shape{300, 200, 200}, Shape{300, 200, 456}, Shape{128, 128, 128}, Shape{300, 200, 201},
                        Shape{1, 1, 1}, Shape{1000, 3, 3}}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + std::to_string(shape.rows) + " x " +
                   std::to_string(shape.columns) + " pitch " + std::to_string(shape.pitch));
      std::vector<float> values = hard_matrix(shape.rows, shape.columns, 7);
      std::vector<std::byte> source = source_bytes(values, shape.rows, shape.columns, dtype, shape.pitch);
      Quantized host = host_quantized(seen_values(source, shape.rows, shape.columns, dtype, shape.pitch), shape.rows,
                                      shape.columns);
      Quantized kernel = kernel_quantized(source, shape.rows, shape.columns, dtype, shape.pitch);
      EXPECT_EQ(differences(host.scales, kernel.scales), "") << "scales";
      EXPECT_EQ(differences(host.codes, kernel.codes), "") << "codes";
    }
  }
}

TEST(CudaFp8Blocks, KernelTakesF32SubnormalsAndBlocksOtherThan128) {
  WS_SKIP_WITHOUT_GPU();
  // F32 subnormals (the scale itself subnormal, the quotients large), in blocks of 64 x 64.
  const uint64_t rows = 100, columns = 70;
  std::vector<float> values(rows * columns);
  for (uint64_t i = 0; i < values.size(); ++i) {
    values[i] = std::bit_cast<float>(static_cast<uint32_t>(i % 3 == 0 ? 1 + i % 7 : 0x7FFFFF - i)) * (i % 2 ? -1.0f : 1.0f);
  }
  std::vector<std::byte> source = source_bytes(values, rows, columns, Dtype::kF32, columns);
  Quantized host = host_quantized(values, rows, columns, {64, 64});
  Quantized kernel = kernel_quantized(source, rows, columns, Dtype::kF32, columns, 64);
  EXPECT_EQ(differences(host.scales, kernel.scales), "");
  EXPECT_EQ(differences(host.codes, kernel.codes), "");
}

}  // namespace
}  // namespace weightstream
