// Fuzzes the decoder of a delta update's changed elements (src/update/delta.cpp): the first
// byte picks the element size (1, 2, 4 or 8 bytes), the next four the tensor's elements, the
// rest is the encoding, exactly as a receiver takes it from a bucket. An accepted encoding
// must decode to ascending positions inside the tensor, one value each, and encode back to the
// same bytes from a base of other values.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "update/delta.hpp"
#include "weightstream/error.hpp"

using namespace weightstream;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 5) return 0;
  const uint64_t element_bytes = uint64_t{1} << (data[0] % 4);
  uint32_t elements = 0;
  std::memcpy(&elements, data + 1, 4);
  elements %= 1u << 16;  // the tensor a base and a copy are made of stays small
  std::span<const std::byte> encoded(reinterpret_cast<const std::byte*>(data + 5), size - 5);
  ChangedElements changes;
  try {
    changes = transfer::decode_changed_elements(encoded, element_bytes, elements, "tensor t (bucket 0)");
  } catch (const Error& error) {
    // Hostile bytes are protocol errors, never another kind.
    if (error.code() != ErrorCode::kProtocol) std::abort();
    return 0;
  }
  if (changes.values.size() != changes.indices.size() * element_bytes) std::abort();
  for (size_t i = 0; i < changes.indices.size(); ++i) {
    if (changes.indices[i] >= elements || (i > 0 && changes.indices[i] <= changes.indices[i - 1])) std::abort();
  }
  // The tensor the changes make from a base that differs from every changed value: its
  // encoding against that base must be the input again.
  std::vector<std::byte> tensor(elements * element_bytes), base;
  for (size_t i = 0; i < changes.indices.size(); ++i) {
    std::memcpy(tensor.data() + changes.indices[i] * element_bytes, changes.values.data() + i * element_bytes,
                element_bytes);
  }
  base = tensor;
  for (uint64_t index : changes.indices) base[index * element_bytes] ^= std::byte{1};
  // No limit to speak of: the encoder's sample (a guess at the size) must not send it whole.
  auto again = transfer::encode_changed_elements(base, tensor, element_bytes, UINT64_MAX / 4);
  if (!again || again->size() != encoded.size() || std::memcmp(again->data(), encoded.data(), encoded.size()) != 0) {
    std::abort();
  }
  return 0;
}
