// XXH64 (seed 0) as the xxHash specification defines it, one thread a range: the digest a
// peer's manifest carries for every 512 KiB piece of a parameter, computed where a pull
// landed the bytes. Reads are 8 bytes at a time where the range is aligned to 8, byte by
// byte otherwise.
#include "device/digest_kernels.hpp"

namespace weightstream::detail {
namespace {

constexpr uint64_t kPrime1 = 0x9E3779B185EBCA87ull;
constexpr uint64_t kPrime2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kPrime3 = 0x165667B19E3779F9ull;
constexpr uint64_t kPrime4 = 0x85EBCA77C2B2AE63ull;
constexpr uint64_t kPrime5 = 0x27D4EB2F165667C5ull;
constexpr unsigned kThreads = 128;

__device__ __forceinline__ uint64_t rotate_left(uint64_t value, unsigned bits) {
  return (value << bits) | (value >> (64 - bits));
}

__device__ __forceinline__ uint64_t round_of(uint64_t accumulator, uint64_t input) {
  accumulator += input * kPrime2;
  return rotate_left(accumulator, 31) * kPrime1;
}

__device__ __forceinline__ uint64_t merge_round(uint64_t accumulator, uint64_t value) {
  accumulator ^= round_of(0, value);
  return accumulator * kPrime1 + kPrime4;
}

/// Little-endian words; `Aligned` reads them whole.
template <bool Aligned>
__device__ __forceinline__ uint64_t read64(const uint8_t* at) {
  if constexpr (Aligned) return *reinterpret_cast<const uint64_t*>(at);
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | at[i];
  return value;
}

template <bool Aligned>
__device__ __forceinline__ uint32_t read32(const uint8_t* at) {
  if constexpr (Aligned) return *reinterpret_cast<const uint32_t*>(at);
  uint32_t value = 0;
  for (int i = 3; i >= 0; --i) value = (value << 8) | at[i];
  return value;
}

template <bool Aligned>
__device__ uint64_t xxh64(const uint8_t* data, uint64_t length) {
  const uint8_t* at = data;
  const uint8_t* const end = data + length;
  uint64_t hash;
  if (length >= 32) {
    uint64_t v1 = kPrime1 + kPrime2, v2 = kPrime2, v3 = 0, v4 = 0 - kPrime1;
    const uint8_t* const limit = end - 32;
    do {
      const uint64_t a = read64<Aligned>(at), b = read64<Aligned>(at + 8), c = read64<Aligned>(at + 16),
                     d = read64<Aligned>(at + 24);
      v1 = round_of(v1, a);
      v2 = round_of(v2, b);
      v3 = round_of(v3, c);
      v4 = round_of(v4, d);
      at += 32;
    } while (at <= limit);
    hash = rotate_left(v1, 1) + rotate_left(v2, 7) + rotate_left(v3, 12) + rotate_left(v4, 18);
    hash = merge_round(hash, v1);
    hash = merge_round(hash, v2);
    hash = merge_round(hash, v3);
    hash = merge_round(hash, v4);
  } else {
    hash = kPrime5;
  }
  hash += length;
  for (; at + 8 <= end; at += 8) hash = rotate_left(hash ^ round_of(0, read64<Aligned>(at)), 27) * kPrime1 + kPrime4;
  if (at + 4 <= end) {
    hash = rotate_left(hash ^ (static_cast<uint64_t>(read32<Aligned>(at)) * kPrime1), 23) * kPrime2 + kPrime3;
    at += 4;
  }
  for (; at < end; ++at) hash = rotate_left(hash ^ (*at * kPrime5), 11) * kPrime1;
  hash ^= hash >> 33;
  hash *= kPrime2;
  hash ^= hash >> 29;
  hash *= kPrime3;
  hash ^= hash >> 32;
  return hash;
}

__global__ void xxh64_ranges(const DigestWork* ranges, uint64_t* digests, size_t count) {
  const size_t index = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= count) return;
  const DigestWork range = ranges[index];
  const auto* data = reinterpret_cast<const uint8_t*>(range.data);
  digests[index] = reinterpret_cast<uintptr_t>(data) % 8 == 0 ? xxh64<true>(data, range.bytes)
                                                                : xxh64<false>(data, range.bytes);
}

}  // namespace

cudaError_t launch_xxh64(const DigestWork* ranges, uint64_t* digests, size_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>((count + kThreads - 1) / kThreads);
  xxh64_ranges<<<blocks, kThreads, 0, stream>>>(ranges, digests, count);
  return cudaGetLastError();
}

}  // namespace weightstream::detail
