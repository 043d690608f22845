// Fuzzes the update protocol's message parser (src/update/wire.cpp): the first 16 bytes
// are a frame header, the rest its body, exactly as a receiver reads them from a socket.
// An accepted message must re-encode to the same body (the parser keeps every field), and
// an accepted BUCKET's entries must lie inside their tensor and their bucket (those in it),
// and an accepted START's declared tensors must have a valid byte size.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "update/wire.hpp"

using namespace weightstream;
using namespace weightstream::transfer;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const std::byte> input(reinterpret_cast<const std::byte*>(data), size);
  if (input.size() < kHeaderBytes) return 0;
  const std::string peer = "fuzz peer";
  try {
    FrameHeader header = parse_header(input.first(kHeaderBytes), peer);
    auto body = input.subspan(kHeaderBytes);
    if (body.size() != header.length) return 0;  // a socket would wait for the rest
    Message message = parse_body(header.type, body, peer);
    if (message.type == MessageType::kBucket) {
      for (const BucketEntry& entry : message.manifest.entries) {
        auto bytes = tensor_byte_size(entry.dtype, entry.shape);
        if (!bytes || entry.tensor_offset + entry.bytes > *bytes) std::abort();
        if (entry.source == 0 && entry.source_offset + entry.bytes > message.manifest.bytes) std::abort();
      }
    }
    for (const DeclaredTensor& tensor : message.declared) {
      if (tensor.name.empty() || !tensor_byte_size(tensor.dtype, tensor.shape)) std::abort();
    }
    std::vector<std::byte> again = encode_body(message);
    if (again.size() != body.size() || !std::equal(again.begin(), again.end(), body.begin())) std::abort();
  } catch (const Error& error) {
    // Hostile bytes are protocol errors, never another kind.
    if (error.code() != ErrorCode::kProtocol) std::abort();
  }
  return 0;
}
