#pragma once
// The one frame header of both protocols on a socket (the update protocol, update/wire.hpp;
// the peer control protocol, peer/peer_protocol.hpp) and of the handshake that opens each
// (handshake.hpp): 16 bytes, little-endian, then `length` bytes of body.
//
//   magic u32, version u16, type u16, length u64
//
// This codec only moves the fields in and out of bytes: which magic, versions, types and
// lengths are acceptable is each protocol's check, with its own words in the errors.
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace weightstream::transfer {

inline constexpr size_t kFrameHeaderBytes = 16;

/// The fields of a frame header, as they travel.
struct FrameFields {
  uint32_t magic = 0;
  uint16_t version = 0;
  uint16_t type = 0;
  uint64_t length = 0;  ///< bytes of the body that follows
};

/// The 16 bytes of `fields`.
std::array<std::byte, kFrameHeaderBytes> encode_frame_header(const FrameFields& fields) noexcept;
/// The fields of 16 header bytes (any values: the protocol checks them).
FrameFields decode_frame_header(std::span<const std::byte, kFrameHeaderBytes> bytes) noexcept;
/// A whole frame: the header of `magic`, `version`, `type` and the body's length, then `body`.
std::vector<std::byte> encode_frame(uint32_t magic, uint16_t version, uint16_t type, std::span<const std::byte> body);

}  // namespace weightstream::transfer
