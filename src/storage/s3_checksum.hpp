#pragma once
// Checksums S3 stores with an object (x-amz-checksum-crc32c, x-amz-checksum-sha256), for
// verifying whole-object reads. https://docs.aws.amazon.com/AmazonS3/latest/userguide/checking-object-integrity.html

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace weightstream::s3 {

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of `bytes`, continuing from `crc`
/// (0 to start). Uses the SSE4.2 crc32 instruction where the CPU has it.
uint32_t crc32c(std::span<const std::byte> bytes, uint32_t crc = 0);

/// Standard base64 (RFC 4648, with padding).
std::string base64_encode(std::string_view bytes);
/// Decodes standard base64; nullopt on a malformed input.
std::optional<std::string> base64_decode(std::string_view text);

/// The value S3 sends in x-amz-checksum-crc32c for `bytes`: base64 of the big-endian CRC.
std::string crc32c_header_value(std::span<const std::byte> bytes);
/// The value S3 sends in x-amz-checksum-sha256 for `bytes`: base64 of the raw digest.
std::string sha256_header_value(std::span<const std::byte> bytes);

}  // namespace weightstream::s3
