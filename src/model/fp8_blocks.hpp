#pragma once
// The host quantizer of FP8 block-scaled weights: a BF16 (F16, F32) update pushed into an FP8
// model is quantized with it where the parameters live on the host, and it is the reference
// the device kernel (src/device/quantize_kernels.cu) must equal bit for bit.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

namespace weightstream::model {

/// Quantizes a part's slice, `values` [rows x columns] starting on a block boundary, block by
/// block of `block` [rows, columns] as FP8 block-scaled checkpoints are made. Codes are [rows x
/// columns], scales [ceil(rows / block rows) x ceil(columns / block columns)], both compact.
/// The rule, exactly (src/device/e4m3_rule.hpp says why each step is what it is):
///   amax  = max |x| over the block, NaN values passed over, infinity counted;
///   scale = amax / 448 as one correctly rounded F32 division (1 when amax is 0);
///   code  = float_to_e4m3(x / scale): correctly rounded F32 division (not x * (1 / scale)),
///           then E4M3FN round to nearest even, saturating at +-448, NaN 0x7f.
void quantize_e4m3_blocks(std::span<const float> values, uint64_t rows, uint64_t columns, std::array<int64_t, 2> block,
                          std::span<std::byte> codes, std::span<float> scales);

}  // namespace weightstream::model
