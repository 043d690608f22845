// Fuzzes the safetensors header parser two ways: the input as a whole file (length prefix
// included), and the input as the JSON header alone, so that mutations reach the JSON
// rules rather than stopping at the length prefix.
// A parse either throws weightstream::Error or returns a header whose ranges tile the data
// section; anything else (another exception, a sanitizer report) is a bug.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string_view>

#include "weightstream/error.hpp"
#include "weightstream/format.hpp"

namespace {

void check(const weightstream::SafetensorsHeader& header, uint64_t file_size) {
  uint64_t expected = 0;
  for (const auto& tensor : header.tensors) {
    if (tensor.data_begin != expected || tensor.data_end < tensor.data_begin) std::abort();
    if (weightstream::tensor_byte_size(tensor.dtype, tensor.shape) != tensor.bytes()) std::abort();
    expected = tensor.data_end;
  }
  if (header.data_offset() + expected != file_size) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto bytes = std::span(reinterpret_cast<const std::byte*>(data), size);
  try {
    check(weightstream::parse_safetensors_bytes("fuzz.safetensors", bytes), size);
  } catch (const weightstream::Error&) {
  }

  std::string_view json(reinterpret_cast<const char*>(data), size);
  // No header's data ends at 2^64 - 1, so every rule but the last (the end of the data
  // at the end of the file, which the whole-file mode reaches) runs on the input.
  try {
    weightstream::parse_safetensors_header("fuzz.json", json, UINT64_MAX);
  } catch (const weightstream::Error&) {
  }
  return 0;
}
