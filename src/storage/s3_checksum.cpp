// CRC-32C and base64 for S3's object checksums. No Debian package ships a CRC-32C library
// for this release, so the table (and the SSE4.2 path) are here; both are tested against
// the check value of the CRC catalogue (crc32c("123456789") = 0xE3069283) and RFC 3720's
// test patterns.
#include "storage/s3_checksum.hpp"

#include <openssl/evp.h>

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

#include "weightstream/error.hpp"

namespace weightstream::s3 {
namespace {

constexpr uint32_t kCastagnoliReflected = 0x82F63B78u;

constexpr std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t crc = i;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1) ? kCastagnoliReflected : 0);
    table[i] = crc;
  }
  return table;
}

constexpr auto kTable = make_table();

uint32_t crc32c_table(const unsigned char* data, size_t size, uint32_t crc) {
  for (size_t i = 0; i < size; ++i) crc = kTable[(crc ^ data[i]) & 0xFF] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(const unsigned char* data, size_t size, uint32_t crc) {
  uint64_t wide = crc;
  while (size >= 8) {
    uint64_t word;
    std::memcpy(&word, data, 8);
    wide = _mm_crc32_u64(wide, word);
    data += 8;
    size -= 8;
  }
  crc = static_cast<uint32_t>(wide);
  while (size > 0) {
    crc = _mm_crc32_u8(crc, *data++);
    --size;
  }
  return crc;
}

bool have_sse42() {
  static const bool have = __builtin_cpu_supports("sse4.2");
  return have;
}
#endif

}  // namespace

uint32_t crc32c(std::span<const std::byte> bytes, uint32_t crc) {
  const auto* data = reinterpret_cast<const unsigned char*>(bytes.data());
  crc = ~crc;
#if defined(__x86_64__)
  if (have_sse42()) return ~crc32c_sse42(data, bytes.size(), crc);
#endif
  return ~crc32c_table(data, bytes.size(), crc);
}

std::string base64_encode(std::string_view bytes) {
  static constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 3 <= bytes.size(); i += 3) {
    uint32_t group = (uint32_t(uint8_t(bytes[i])) << 16) | (uint32_t(uint8_t(bytes[i + 1])) << 8) | uint8_t(bytes[i + 2]);
    out += kAlphabet[(group >> 18) & 63];
    out += kAlphabet[(group >> 12) & 63];
    out += kAlphabet[(group >> 6) & 63];
    out += kAlphabet[group & 63];
  }
  if (size_t rest = bytes.size() - i; rest > 0) {
    uint32_t group = uint32_t(uint8_t(bytes[i])) << 16;
    if (rest == 2) group |= uint32_t(uint8_t(bytes[i + 1])) << 8;
    out += kAlphabet[(group >> 18) & 63];
    out += kAlphabet[(group >> 12) & 63];
    out += rest == 2 ? kAlphabet[(group >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

std::optional<std::string> base64_decode(std::string_view text) {
  if (text.size() % 4 != 0) return std::nullopt;
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  std::string out;
  for (size_t i = 0; i < text.size(); i += 4) {
    int padding = 0;
    uint32_t group = 0;
    for (size_t j = 0; j < 4; ++j) {
      char c = text[i + j];
      if (c == '=' && i + 4 == text.size() && j >= 2) {
        ++padding;
        group <<= 6;
        continue;
      }
      int v = value(c);
      if (v < 0 || padding > 0) return std::nullopt;
      group = (group << 6) | static_cast<uint32_t>(v);
    }
    out += static_cast<char>((group >> 16) & 0xFF);
    if (padding < 2) out += static_cast<char>((group >> 8) & 0xFF);
    if (padding < 1) out += static_cast<char>(group & 0xFF);
  }
  return out;
}

std::string crc32c_header_value(std::span<const std::byte> bytes) {
  uint32_t crc = crc32c(bytes);
  const char big_endian[4] = {static_cast<char>(crc >> 24), static_cast<char>(crc >> 16), static_cast<char>(crc >> 8),
                              static_cast<char>(crc)};
  return base64_encode(std::string_view(big_endian, 4));
}

std::string sha256_header_value(std::span<const std::byte> bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  WS_EXPECT(EVP_Digest(bytes.data(), bytes.size(), digest, &length, EVP_sha256(), nullptr) == 1, ErrorCode::kInternal,
            "OpenSSL EVP_Digest(SHA-256) failed");
  return base64_encode(std::string_view(reinterpret_cast<const char*>(digest), length));
}

}  // namespace weightstream::s3
