#pragma once
// The FP8 block quantization rule, element by element, as code that compiles both for the
// host and for a CUDA device: quantize_kernels.cu quantizes with it, and the CPU tests check
// it against the host quantizer (model::quantize_e4m3_blocks, float_to_e4m3), so a kernel
// that cannot run on a machine without a GPU is still checked there bit for bit.
//
// The rule, for one block of values x (F32, converted exactly from BF16 or F16):
//   amax  = the largest |x| of the block; NaN values are passed over (as std::max(amax, |x|)
//           and fmaxf do); +-infinity counts (amax = inf);
//   scale = amax / 448 in F32, correctly rounded (IEEE division); 1 when amax is 0;
//   code  = E4M3(x / scale): the F32 quotient correctly rounded, then rounded to nearest,
//           ties to even, to E4M3FN; |quotient| >= 448 (infinity too) saturates to +-448 (0x7e,
//           0xfe); NaN gives 0x7f; a negative value rounding to zero keeps its sign (0x80).
// So a block holding infinity has scale inf, its infinities become NaN codes (inf / inf) and
// its finite values +-0. Division, not multiplication by 1 / scale: x * (1 / scale) differs in
// the last bit for some x, and so can the code (torch on CUDA divides a tensor by a CPU scalar
// as a multiplication by its reciprocal, which is why torch on the GPU disagreed with this rule
// where torch on the CPU agrees).

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define WS_HOST_DEVICE __host__ __device__
#else
#define WS_HOST_DEVICE
#endif

namespace weightstream::detail {

constexpr float kE4M3Largest = 448.0f;  // 1.75 * 2^8, E4M3FN's largest finite value

WS_HOST_DEVICE inline uint32_t bits_of(float value) {
  uint32_t bits;
  memcpy(&bits, &value, 4);
  return bits;
}

WS_HOST_DEVICE inline float float_of(uint32_t bits) {
  float value;
  memcpy(&value, &bits, 4);
  return value;
}

WS_HOST_DEVICE inline float bf16_value(uint16_t bits) { return float_of(static_cast<uint32_t>(bits) << 16); }

WS_HOST_DEVICE inline float f16_value(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1F;
  const uint32_t mantissa = bits & 0x3FF;
  if (exponent == 0x1F) return float_of(sign | 0x7F800000u | (mantissa << 13));
  if (exponent == 0) {
    // Subnormal: mantissa * 2^-24, exact in F32.
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  return float_of(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

/// max(amax, |value|) as std::max(amax, std::fabs(value)) computes it: a NaN value leaves
/// amax as it was. Used for the per-thread maxima and for combining them, so the order of
/// a reduction cannot change the result (no partial is ever NaN).
WS_HOST_DEVICE inline float amax_with(float amax, float value) {
  const float magnitude = float_of(bits_of(value) & 0x7FFFFFFFu);
  return amax < magnitude ? magnitude : amax;
}

/// `numerator / denominator` in F32, correctly rounded, also where a build asks the compiler
/// for approximate division (nvcc --use_fast_math turns `/` into a multiplication by the
/// reciprocal; __fdiv_rn never is).
WS_HOST_DEVICE inline float divide_rn(float numerator, float denominator) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(numerator, denominator);
#else
  return numerator / denominator;
#endif
}

/// The scale of a block whose largest magnitude is `amax`.
WS_HOST_DEVICE inline float e4m3_block_scale(float amax) { return amax > 0.0f ? divide_rn(amax, kE4M3Largest) : 1.0f; }

/// `count` >> `shift` rounded to nearest, ties to even (shift in [1, 31]).
WS_HOST_DEVICE inline uint32_t shift_round_even(uint32_t count, uint32_t shift) {
  const uint32_t kept = count >> shift;
  const uint32_t rest = count & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  return kept + ((rest > half || (rest == half && (kept & 1))) ? 1u : 0u);
}

/// E4M3FN code of `value`: round to nearest even, saturating at +-448, NaN 0x7f. Equal to
/// float_to_e4m3() for every F32 value, in integer operations only.
WS_HOST_DEVICE inline uint8_t e4m3_code(float value) {
  const uint32_t bits = bits_of(value);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return 0x7F;                               // NaN of either sign
  if (magnitude >= 0x43E00000u) return static_cast<uint8_t>(sign | 0x7E);  // >= 448, infinity
  if (magnitude < 0x3C800000u) {
    // Below 2^-6, E4M3's subnormals: units of 2^-9. The value is m * 2^(e - 150) (e the F32
    // exponent field, 1 for F32 subnormals), so its units are m * 2^(e - 141).
    const uint32_t exponent = magnitude >> 23;
    const uint32_t significand = (magnitude & 0x7FFFFFu) | (exponent ? 0x800000u : 0u);
    const uint32_t shift = 141 - (exponent ? exponent : 1);  // >= 21
    if (shift > 24) return sign;  // below half a unit: significand < 2^24 <= 2^(shift - 1)
    // 8 units carry into the smallest normal code (0x08), as they should.
    return static_cast<uint8_t>(sign | shift_round_even(significand, shift));
  }
  // Normal: E4M3 exponent field = F32 exponent - 127 + 7; the top 3 mantissa bits stay,
  // rounded on the 20 below; a carry out of the mantissa moves into the exponent.
  uint32_t code = (((magnitude >> 23) - 120) << 3) | ((magnitude >> 20) & 7);
  const uint32_t rest = magnitude & 0xFFFFFu;
  if (rest > 0x80000u || (rest == 0x80000u && (code & 1))) ++code;
  if (code > 0x7E) code = 0x7E;
  return static_cast<uint8_t>(sign | code);
}

/// The code of `value` in a block of scale `scale`.
WS_HOST_DEVICE inline uint8_t e4m3_block_code(float value, float scale) { return e4m3_code(divide_rn(value, scale)); }

}  // namespace weightstream::detail
