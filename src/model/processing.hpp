#pragma once
// Per-layer processing: turns a parameter's checkpoint-format bytes (staged while its
// parts arrive) into its kernel format, in place in the parameter's storage.

#include "weightstream/model.hpp"

namespace weightstream::model {

/// Processes `parameter` from `staging` (parameter.load_dtype, parameter.elements()
/// values on parameter.device) into its storage, and writes its scale into `scale`.
/// Throws Error(kModel) naming the parameter.
void process_parameter(const Parameter& parameter, const std::byte* staging, const Parameter* scale);

}  // namespace weightstream::model
