// The frame header both protocols share (frame.hpp).
#include "net/frame.hpp"

#include <algorithm>

namespace weightstream::transfer {
namespace {

void put_le(std::byte* at, uint64_t value, int bytes) noexcept {
  for (int i = 0; i < bytes; ++i) at[i] = static_cast<std::byte>(value >> (8 * i));
}

uint64_t get_le(const std::byte* at, int bytes) noexcept {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= static_cast<uint64_t>(at[i]) << (8 * i);
  return value;
}

}  // namespace

std::array<std::byte, kFrameHeaderBytes> encode_frame_header(const FrameFields& fields) noexcept {
  std::array<std::byte, kFrameHeaderBytes> header{};
  put_le(header.data(), fields.magic, 4);
  put_le(header.data() + 4, fields.version, 2);
  put_le(header.data() + 6, fields.type, 2);
  put_le(header.data() + 8, fields.length, 8);
  return header;
}

FrameFields decode_frame_header(std::span<const std::byte, kFrameHeaderBytes> bytes) noexcept {
  return {static_cast<uint32_t>(get_le(bytes.data(), 4)), static_cast<uint16_t>(get_le(bytes.data() + 4, 2)),
          static_cast<uint16_t>(get_le(bytes.data() + 6, 2)), get_le(bytes.data() + 8, 8)};
}

std::vector<std::byte> encode_frame(uint32_t magic, uint16_t version, uint16_t type, std::span<const std::byte> body) {
  std::vector<std::byte> frame(kFrameHeaderBytes + body.size());
  const auto header = encode_frame_header({magic, version, type, body.size()});
  std::copy(header.begin(), header.end(), frame.begin());
  std::copy(body.begin(), body.end(), frame.begin() + kFrameHeaderBytes);
  return frame;
}

}  // namespace weightstream::transfer
