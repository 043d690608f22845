#include "model/parameter_copy.hpp"

#include <cstring>
#include <vector>

#include "weightstream/model.hpp"

namespace weightstream::model {
namespace {

const Device kHost{};

uint64_t element_bytes(Dtype dtype) { return dtype_bits(dtype) / 8; }

}  // namespace

void copy_elements(std::byte* destination, const Device& destination_device, Dtype destination_dtype,
                   const std::byte* source, const Device& source_device, Dtype source_dtype, uint64_t elements) {
  if (elements == 0) return;
  if (destination_dtype == source_dtype) {
    copy_bytes(destination, destination_device, source, source_device, elements * element_bytes(source_dtype));
    return;
  }
  // Conversion is host code: bring device bytes to the host first, land the result after.
  std::vector<std::byte> host_source;
  const std::byte* from = source;
  if (source_device.is_cuda()) {
    host_source.resize(elements * element_bytes(source_dtype));
    copy_bytes(host_source.data(), kHost, source, source_device, host_source.size());
    from = host_source.data();
  }
  if (!destination_device.is_cuda()) {
    convert_elements(destination, destination_dtype, from, source_dtype, elements);
    return;
  }
  std::vector<std::byte> host_destination(elements * element_bytes(destination_dtype));
  convert_elements(host_destination.data(), destination_dtype, from, source_dtype, elements);
  copy_bytes(destination, destination_device, host_destination.data(), kHost, host_destination.size());
}

void copy_rows(std::byte* destination, const Device& destination_device, Dtype destination_dtype,
               const std::byte* source, const Device& source_device, Dtype source_dtype, uint64_t rows,
               uint64_t columns, uint64_t source_pitch) {
  if (rows == 0 || columns == 0) return;
  uint64_t source_row_bytes = source_pitch * element_bytes(source_dtype);
  uint64_t destination_row_bytes = columns * element_bytes(destination_dtype);
  if (!destination_device.is_cuda() && !source_device.is_cuda()) {
    for (uint64_t row = 0; row < rows; ++row) {
      copy_elements(destination + row * destination_row_bytes, destination_device, destination_dtype,
                    source + row * source_row_bytes, source_device, source_dtype, columns);
    }
    return;
  }
  // Device memory: pack on the host, then one copy (a cudaMemcpy2D can replace this).
  std::vector<std::byte> packed(rows * destination_row_bytes);
  std::vector<std::byte> host_source;
  const std::byte* from = source;
  if (source_device.is_cuda()) {
    host_source.resize((rows - 1) * source_row_bytes + columns * element_bytes(source_dtype));
    copy_bytes(host_source.data(), kHost, source, source_device, host_source.size());
    from = host_source.data();
  }
  for (uint64_t row = 0; row < rows; ++row) {
    convert_elements(packed.data() + row * destination_row_bytes, destination_dtype, from + row * source_row_bytes,
                     source_dtype, columns);
  }
  copy_bytes(destination, destination_device, packed.data(), kHost, packed.size());
}

void zero_bytes(std::byte* destination, const Device& device, uint64_t bytes) {
  if (bytes == 0) return;
  if (!device.is_cuda()) {
    std::memset(destination, 0, bytes);
    return;
  }
  std::vector<std::byte> zeros(bytes);
  copy_bytes(destination, device, zeros.data(), kHost, bytes);
}

}  // namespace weightstream::model
