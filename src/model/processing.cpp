#include "model/processing.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "model/parameter_writer.hpp"
#include "weightstream/error.hpp"

namespace weightstream::model {
namespace {

const Device kHost{};

/// Largest finite E4M3 magnitude (OCP 8-bit floating point specification, E4M3FN).
constexpr float kE4M3Max = 448.0f;

void quantize_fp8_per_tensor(const Parameter& parameter, const std::byte* staging, const Parameter& scale) {
  uint64_t count = parameter.elements();
  std::vector<float> values(count);
  copy_elements(reinterpret_cast<std::byte*>(values.data()), kHost, Dtype::kF32, staging, parameter.device,
                parameter.load_dtype, count);
  float amax = 0;
  for (float value : values) {
    WS_EXPECT(std::isfinite(value), ErrorCode::kModel,
              "FP8 quantization of parameter " + parameter.name + ": a weight is not finite");
    amax = std::max(amax, std::fabs(value));
  }
  // One scale for the whole tensor maps its largest magnitude to the largest E4M3 value;
  // an all-zero tensor keeps scale 1 so dequantization stays exact.
  float factor = amax > 0 ? amax / kE4M3Max : 1.0f;
  std::vector<std::byte> codes(count);
  for (uint64_t i = 0; i < count; ++i) codes[i] = std::byte{float_to_e4m3(values[i] / factor)};
  copy_bytes(parameter.data, parameter.device, codes.data(), kHost, codes.size());
  copy_bytes(scale.data, scale.device, &factor, kHost, sizeof(factor));
}

}  // namespace

void process_parameter(const Parameter& parameter, const std::byte* staging, const Parameter* scale) {
  switch (parameter.processing) {
    case Processing::kNone: return;
    case Processing::kFp8PerTensor:
      WS_EXPECT(parameter.dtype == Dtype::kF8E4M3, ErrorCode::kModel,
                "parameter " + parameter.name + " is FP8-processed but stored as " +
                    std::string(dtype_name(parameter.dtype)));
      WS_EXPECT(scale != nullptr && scale->dtype == Dtype::kF32 && scale->elements() == 1, ErrorCode::kModel,
                "parameter " + parameter.name + " is FP8-processed but its scale parameter '" + parameter.scale +
                    "' is missing or not one F32 value");
      quantize_fp8_per_tensor(parameter, staging, *scale);
      return;
  }
}

}  // namespace weightstream::model
