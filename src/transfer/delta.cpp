// The changed-elements encoding of delta updates (see delta.hpp and docs/DELTA.md).
#include "transfer/delta.hpp"

#include <xxhash.h>

#include <bit>
#include <cstring>

#include "weightstream/error.hpp"

namespace weightstream::transfer {
namespace {

static_assert(std::endian::native == std::endian::little, "the encoding is little-endian; add byte swaps here");

/// LEB128 takes at most 10 bytes for a 64-bit value.
constexpr unsigned kMaxVarintBytes = 10;

/// Elements compared, evenly spaced, before a tensor is encoded: one whose sample says its
/// encoding would take more than kSampleMargin times the limit goes whole without paying for a
/// partial encoding (otherwise a tensor that changed everywhere is scanned and encoded up to
/// the limit first). Tensors of fewer than kSampledElements * 8 elements are not sampled.
constexpr uint64_t kSampledElements = 1024;
constexpr double kSampleMargin = 2.0;

/// Whether the sample of `elements` says that the encoding would pass `limit` by far.
bool sample_says_dense(const std::byte* base, const std::byte* tensor, uint64_t elements, uint64_t element_bytes,
                       uint64_t limit) {
  if (elements < kSampledElements * 8) return false;
  const uint64_t stride = elements / kSampledElements;
  uint64_t changed = 0;
  for (uint64_t i = 0; i < kSampledElements; ++i) {
    const uint64_t at = i * stride * element_bytes;
    changed += std::memcmp(base + at, tensor + at, element_bytes) != 0 ? 1 : 0;
  }
  // At least one byte of position and the value for each changed element.
  const double estimate = static_cast<double>(changed) / kSampledElements * static_cast<double>(elements) *
                          static_cast<double>(element_bytes + 1);
  return estimate > kSampleMargin * static_cast<double>(limit);
}

void put_varint(std::vector<std::byte>& out, uint64_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<std::byte>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<std::byte>(value));
}

void put_u64(std::byte* at, uint64_t value) { std::memcpy(at, &value, sizeof(value)); }

uint64_t get_u64(const std::byte* at) {
  uint64_t value;
  std::memcpy(&value, at, sizeof(value));
  return value;
}

/// Bytes compared at once where nothing changed: eight words whose XORs are ORed together, a
/// loop the compiler vectorizes; only a block that differs is compared element by element.
constexpr uint64_t kBlockBytes = 64;

/// Whether the `kBlockBytes` at `base` and `tensor` differ anywhere.
bool block_differs(const std::byte* base, const std::byte* tensor) {
  uint64_t differs = 0;
  for (uint64_t word = 0; word < kBlockBytes; word += 8) differs |= get_u64(base + word) ^ get_u64(tensor + word);
  return differs != 0;
}

/// Calls `changed(index)` for each element of type `Element` that differs, in order, until it
/// returns false.
template <typename Element, typename Changed>
void for_each_changed_of(const std::byte* base, const std::byte* tensor, uint64_t bytes, Changed&& changed) {
  auto element_at = [](const std::byte* bytes_at) {
    Element value;
    std::memcpy(&value, bytes_at, sizeof(Element));
    return value;
  };
  uint64_t position = 0;
  while (position < bytes) {
    const uint64_t stop = std::min(bytes, position + kBlockBytes);
    if (stop - position == kBlockBytes && !block_differs(base + position, tensor + position)) {
      position = stop;
      continue;
    }
    for (; position < stop; position += sizeof(Element)) {
      if (element_at(base + position) != element_at(tensor + position) && !changed(position / sizeof(Element))) return;
    }
  }
}

/// for_each_changed_of() for elements of `element_bytes` bytes: 1, 2, 4 or 8.
template <typename Changed>
void for_each_changed(const std::byte* base, const std::byte* tensor, uint64_t bytes, uint64_t element_bytes,
                      Changed&& changed) {
  switch (element_bytes) {
    case 1: return for_each_changed_of<uint8_t>(base, tensor, bytes, changed);
    case 2: return for_each_changed_of<uint16_t>(base, tensor, bytes, changed);
    case 4: return for_each_changed_of<uint32_t>(base, tensor, bytes, changed);
    default: return for_each_changed_of<uint64_t>(base, tensor, bytes, changed);
  }
}

}  // namespace

std::optional<std::vector<std::byte>> encode_changed_elements(std::span<const std::byte> base,
                                                              std::span<const std::byte> tensor, uint64_t element_bytes,
                                                              uint64_t limit) {
  WS_EXPECT(base.size() == tensor.size(), ErrorCode::kInvalidArgument,
            "cannot encode changed elements: the base has " + std::to_string(base.size()) + " bytes, the tensor " +
                std::to_string(tensor.size()));
  if (!std::has_single_bit(element_bytes) || element_bytes > 8 || tensor.size() % element_bytes != 0) return std::nullopt;
  if (sample_says_dense(base.data(), tensor.data(), tensor.size() / element_bytes, element_bytes, limit)) {
    return std::nullopt;
  }
  // Kept between calls on each thread: fresh memory for every tensor costs more in page faults
  // than the encoding itself.
  thread_local std::vector<std::byte> positions;
  thread_local std::vector<std::byte> values;
  positions.clear();
  values.clear();
  uint64_t changed = 0;
  uint64_t next = 0;  // the smallest index the next change may have
  bool over = kChangedElementsOverhead > limit;
  for_each_changed(base.data(), tensor.data(), tensor.size(), element_bytes, [&](uint64_t index) {
    put_varint(positions, index - next);
    next = index + 1;
    values.insert(values.end(), tensor.data() + index * element_bytes, tensor.data() + next * element_bytes);
    ++changed;
    over = kChangedElementsOverhead + positions.size() + values.size() > limit;
    return !over;
  });
  if (over) return std::nullopt;
  std::vector<std::byte> encoded(kChangedElementsOverhead + positions.size() + values.size());
  put_u64(encoded.data(), changed);
  put_u64(encoded.data() + 8, positions.size());
  std::byte* at = encoded.data() + 16;
  if (!positions.empty()) std::memcpy(at, positions.data(), positions.size());
  if (!values.empty()) std::memcpy(at + positions.size(), values.data(), values.size());
  const uint64_t checksum_at = encoded.size() - 8;
  put_u64(encoded.data() + checksum_at, XXH64(encoded.data(), checksum_at, 0));
  return encoded;
}

ChangedElements decode_changed_elements(std::span<const std::byte> encoded, uint64_t element_bytes, uint64_t elements,
                                        const std::string& what) {
  const uint64_t size = encoded.size();
  WS_EXPECT(size >= kChangedElementsOverhead, ErrorCode::kProtocol,
            what + ": its changed elements are truncated: " + std::to_string(size) + " bytes, fewer than the " +
                std::to_string(kChangedElementsOverhead) + " of their counts and checksum");
  const uint64_t changed = get_u64(encoded.data());
  const uint64_t position_bytes = get_u64(encoded.data() + 8);
  const uint64_t body = size - kChangedElementsOverhead;
  // changed <= elements keeps changed * element_bytes within the tensor's size.
  const bool counts_fit = changed <= elements && position_bytes <= body && body - position_bytes == changed * element_bytes;
  WS_EXPECT(counts_fit, ErrorCode::kProtocol,
            what + ": its changed elements are truncated or overlong: " + std::to_string(size) + " bytes hold " +
                std::to_string(changed) + " changed of " + std::to_string(elements) + " elements with " +
                std::to_string(position_bytes) + " bytes of positions, which take " +
                (changed <= elements ? std::to_string(kChangedElementsOverhead + position_bytes + changed * element_bytes)
                                     : std::string("more")) +
                " bytes");
  const uint64_t checksum = get_u64(encoded.data() + size - 8);
  const uint64_t computed = XXH64(encoded.data(), size - 8, 0);
  WS_EXPECT(checksum == computed, ErrorCode::kProtocol,
            what + ": its changed elements are corrupted: their checksum says " + std::to_string(checksum) + ", their " +
                std::to_string(size - 8) + " bytes hash to " + std::to_string(computed));
  ChangedElements result;
  result.indices.reserve(changed);
  const std::byte* at = encoded.data() + 16;
  const std::byte* end = at + position_bytes;
  uint64_t next = 0;
  for (uint64_t i = 0; i < changed; ++i) {
    uint64_t gap = 0;
    unsigned shift = 0;
    for (;;) {
      WS_EXPECT(at < end && shift < 7 * kMaxVarintBytes, ErrorCode::kProtocol,
                what + ": changed element " + std::to_string(i) + "'s position runs past its " +
                    std::to_string(position_bytes) + " bytes of positions");
      const auto byte = static_cast<uint8_t>(*at++);
      gap |= static_cast<uint64_t>(byte & 0x7f) << shift;
      shift += 7;
      if ((byte & 0x80) == 0) break;
    }
    WS_EXPECT(gap < elements && next <= elements - 1 - gap, ErrorCode::kProtocol,
              what + ": changed element " + std::to_string(i) + " lies past the tensor's " + std::to_string(elements) +
                  " elements");
    result.indices.push_back(next + gap);
    next += gap + 1;
  }
  WS_EXPECT(at == end, ErrorCode::kProtocol,
            what + ": " + std::to_string(end - at) + " bytes of positions are left after its " +
                std::to_string(changed) + " changed elements");
  result.values.assign(end, end + changed * element_bytes);
  return result;
}

}  // namespace weightstream::transfer
