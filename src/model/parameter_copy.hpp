#pragma once
// Every byte the model layer writes into parameter storage goes through these functions,
// so that device memory works by backing them with CUDA (copy_bytes today; a 2-D copy or
// a kernel for the strided case later) without touching the session logic.

#include <cstddef>
#include <cstdint>

#include "weightstream/device.hpp"
#include "weightstream/format.hpp"

namespace weightstream::model {

/// Copies `elements` values from `source` (dtype `source_dtype`, on `source_device`) into
/// `destination` (dtype `destination_dtype`, on `destination_device`), converting between
/// BF16, F16 and F32 on the host when the dtypes differ.
void copy_elements(std::byte* destination, const Device& destination_device, Dtype destination_dtype,
                   const std::byte* source, const Device& source_device, Dtype source_dtype, uint64_t elements);

/// Copies a strided rectangle of `rows` rows of `columns` elements: source rows are
/// `source_pitch` elements apart, destination rows are packed. Converts like copy_elements.
void copy_rows(std::byte* destination, const Device& destination_device, Dtype destination_dtype,
               const std::byte* source, const Device& source_device, Dtype source_dtype, uint64_t rows,
               uint64_t columns, uint64_t source_pitch);

/// Writes `bytes` zero bytes at `destination`.
void zero_bytes(std::byte* destination, const Device& device, uint64_t bytes);

}  // namespace weightstream::model
