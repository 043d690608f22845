// The changed-elements encoding of delta updates (see delta.hpp and docs/DELTA.md).
#include "update/delta.hpp"

#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>

#include "base/parallel.hpp"
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

/// Whether the elements of `element_bytes` bytes (1, 2, 4 or 8) at `base` and `tensor` differ:
/// a size the compiler knows in each case (a memcmp call per sampled element costs more).
bool element_differs(const std::byte* base, const std::byte* tensor, uint64_t element_bytes) {
  auto differs = [&]<typename Element>(Element) {
    Element a, b;
    std::memcpy(&a, base, sizeof(Element));
    std::memcpy(&b, tensor, sizeof(Element));
    return a != b;
  };
  switch (element_bytes) {
    case 1: return *base != *tensor;
    case 2: return differs(uint16_t{});
    case 4: return differs(uint32_t{});
    default: return differs(uint64_t{});
  }
}

/// Whether the sample of `elements` says that the encoding of `held` of them would pass
/// `limit` by far.
bool sample_says_dense(const std::byte* base, const std::byte* tensor, uint64_t elements, uint64_t held,
                       uint64_t element_bytes, uint64_t limit) {
  if (elements < kSampledElements * 8) return false;
  const uint64_t stride = elements / kSampledElements;
  uint64_t changed = 0;
  for (uint64_t i = 0; i < kSampledElements; ++i) {
    const uint64_t at = i * stride * element_bytes;
    changed += element_differs(base + at, tensor + at, element_bytes) ? 1 : 0;
  }
  // At least one byte of position and the value for each changed element.
  const double estimate = static_cast<double>(changed) / kSampledElements * static_cast<double>(held) *
                          static_cast<double>(element_bytes + 1);
  return estimate > kSampleMargin * static_cast<double>(limit);
}

void put_u64(std::byte* at, uint64_t value) { std::memcpy(at, &value, sizeof(value)); }

uint64_t get_u64(const std::byte* at) {
  uint64_t value;
  std::memcpy(&value, at, sizeof(value));
  return value;
}

/// Bytes compared at once where nothing changed: eight words whose XORs are ORed together, a
/// loop the compiler vectorizes; in a block that differs, each word's XOR says which of its
/// elements changed, one bit each, without comparing them one by one.
constexpr uint64_t kBlockBytes = 64;
constexpr uint64_t kBlockWords = kBlockBytes / 8;

/// One bit (the top bit of its first byte) for each element of `kElement` bytes that is not
/// zero in the word `difference` (little-endian: the first element in the lowest bytes).
template <uint64_t kElement>
uint64_t changed_lanes(uint64_t difference) {
  constexpr uint64_t kLow7 = 0x7f7f7f7f7f7f7f7full;
  constexpr uint64_t kHigh = 0x8080808080808080ull;
  // The top bit of each byte that is not zero (no carry crosses a byte: each sum stays below 256).
  uint64_t lanes = (difference | ((difference & kLow7) + kLow7)) & kHigh;
  if constexpr (kElement >= 2) lanes |= lanes >> 8;
  if constexpr (kElement >= 4) lanes |= lanes >> 16;
  if constexpr (kElement >= 8) lanes |= lanes >> 32;
  constexpr uint64_t kFirstBytes = kElement == 1   ? kHigh
                                   : kElement == 2 ? 0x0080008000800080ull
                                   : kElement == 4 ? 0x0000008000000080ull
                                                   : 0x80ull;
  return lanes & kFirstBytes;
}

/// Calls `changed(index)` for each element of type `Element` that differs, in order, until it
/// returns false.
template <typename Element, typename Changed>
void for_each_changed_of(const std::byte* base, const std::byte* tensor, uint64_t bytes, Changed&& changed) {
  uint64_t position = 0;
  for (; position + kBlockBytes <= bytes; position += kBlockBytes) {
    uint64_t differences[kBlockWords];
    uint64_t any = 0;
    for (uint64_t word = 0; word < kBlockWords; ++word) {
      differences[word] = get_u64(base + position + 8 * word) ^ get_u64(tensor + position + 8 * word);
      any |= differences[word];
    }
    if (any == 0) continue;
    for (uint64_t word = 0; word < kBlockWords; ++word) {
      for (uint64_t lanes = changed_lanes<sizeof(Element)>(differences[word]); lanes != 0; lanes &= lanes - 1) {
        const uint64_t byte = position + 8 * word + static_cast<uint64_t>(std::countr_zero(lanes)) / 8;
        if (!changed(byte / sizeof(Element))) return;
      }
    }
  }
  for (; position < bytes; position += sizeof(Element)) {  // the last partial block
    if (std::memcmp(base + position, tensor + position, sizeof(Element)) != 0 && !changed(position / sizeof(Element))) {
      return;
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

/// Bytes a varint of `value` takes.
uint64_t varint_bytes(uint64_t value) {
  uint64_t bytes = 1;
  for (; value >= 0x80; value >>= 7) ++bytes;
  return bytes;
}

std::byte* put_varint_at(std::byte* at, uint64_t value) {
  for (; value >= 0x80; value >>= 7) *at++ = static_cast<std::byte>((value & 0x7f) | 0x80);
  *at++ = static_cast<std::byte>(value);
  return at;
}

/// Each range of a tensor encoded on several threads (kParallelEncodingBytes) is at least this large.
constexpr uint64_t kRangeMinimumBytes = 4ull << 20;
/// Scratch a range keeps for the next tensor, at most.
constexpr uint64_t kKeptBytes = 16ull << 20;

/// The changed elements of one range of a tensor, encoded on their own: the first position's
/// varint counts from the range's first element, and is written again when the ranges are
/// joined. Its buffers are kept between tensors (grown, never shrunk below kKeptBytes) and
/// written in place: `position_bytes` and `value_bytes` of them hold the encoding.
struct RangeEncoding {
  std::vector<std::byte> positions;
  std::vector<std::byte> values;
  uint64_t position_bytes = 0;
  uint64_t value_bytes = 0;
  uint64_t changed = 0;
  uint64_t first = 0;  ///< index of its first changed element, in the tensor
  uint64_t last = 0;   ///< index of its last one
  uint64_t first_varint_bytes = 0;
};

/// What the ranges of one tensor share while they are encoded: their bytes so far, and whether
/// these passed the limit (every range then stops).
struct EncodingBudget {
  uint64_t limit = 0;
  std::atomic<uint64_t> bytes{kChangedElementsOverhead};
  std::atomic<bool> over{false};
};

/// Runs of held elements: [first, second), ascending.
using HeldRuns = std::vector<std::pair<uint64_t, uint64_t>>;

/// Copies one element of `element_bytes` bytes (a size known to the compiler in each case).
inline void copy_element(std::byte* to, const std::byte* from, uint64_t element_bytes) {
  switch (element_bytes) {
    case 1: *to = *from; return;
    case 2: std::memcpy(to, from, 2); return;
    case 4: std::memcpy(to, from, 4); return;
    default: std::memcpy(to, from, 8); return;
  }
}

/// Encodes the changed elements among elements [begin, end) inside `runs` into `range`, until
/// the budget is spent.
void encode_range(const std::byte* base, const std::byte* tensor, uint64_t begin, uint64_t end, const HeldRuns& runs,
                  uint64_t element_bytes, EncodingBudget& budget, RangeEncoding& range) {
  // Room for all the budget allows (the encoding stops once it passes the limit), so each change
  // is written in place, never appended.
  const uint64_t room =
      std::min(budget.limit, (end - begin) * (element_bytes + kMaxVarintBytes)) + kMaxVarintBytes + element_bytes;
  if (range.positions.size() < room) range.positions.resize(room);
  if (range.values.size() < room) range.values.resize(room);
  std::byte* const positions = range.positions.data();
  std::byte* const values = range.values.data();
  uint64_t position_bytes = 0, value_bytes = 0, changed = 0;
  uint64_t next = begin;  // the smallest index the next change may have
  uint64_t counted = 0;   // bytes of this range already added to the budget
  auto spend = [&] {
    const uint64_t bytes = position_bytes + value_bytes;
    const uint64_t total = budget.bytes.fetch_add(bytes - counted, std::memory_order_relaxed) + bytes - counted;
    counted = bytes;
    if (total > budget.limit) budget.over.store(true, std::memory_order_relaxed);
  };
  bool going = true;
  auto run = std::ranges::upper_bound(runs, begin, {}, [](const auto& held) { return held.second; });
  for (; going && run != runs.end() && run->first < end; ++run) {
    const uint64_t from = std::max(begin, run->first), to = std::min(end, run->second);
    for_each_changed(base + from * element_bytes, tensor + from * element_bytes, (to - from) * element_bytes,
                     element_bytes, [&](uint64_t offset) {
                       const uint64_t index = from + offset;
                       const uint64_t before = position_bytes;
                       position_bytes = static_cast<uint64_t>(put_varint_at(positions + position_bytes, index - next) -
                                                              positions);
                       if (changed++ == 0) {
                         range.first = index;
                         range.first_varint_bytes = position_bytes - before;
                       }
                       range.last = index;
                       next = index + 1;
                       copy_element(values + value_bytes, tensor + index * element_bytes, element_bytes);
                       value_bytes += element_bytes;
                       // The shared count is brought up to date every few KiB, and checked at every change.
                       if (position_bytes + value_bytes - counted >= 4096) spend();
                       going = !budget.over.load(std::memory_order_relaxed) &&
                               budget.bytes.load(std::memory_order_relaxed) + position_bytes + value_bytes - counted <=
                                   budget.limit;
                       return going;
                     });
  }
  range.position_bytes = position_bytes;
  range.value_bytes = value_bytes;
  range.changed = changed;
  spend();
}

/// Joins the ranges' encodings into one (delta.hpp's layout).
std::vector<std::byte> join_ranges(std::span<const RangeEncoding> ranges) {
  uint64_t changed = 0, position_bytes = 0, value_bytes = 0, next = 0;
  for (const RangeEncoding& range : ranges) {
    if (range.changed == 0) continue;
    changed += range.changed;
    position_bytes += range.position_bytes - range.first_varint_bytes + varint_bytes(range.first - next);
    value_bytes += range.value_bytes;
    next = range.last + 1;
  }
  std::vector<std::byte> encoded(kChangedElementsOverhead + position_bytes + value_bytes);
  put_u64(encoded.data(), changed);
  put_u64(encoded.data() + 8, position_bytes);
  std::byte* positions = encoded.data() + 16;
  std::byte* values = positions + position_bytes;
  next = 0;
  for (const RangeEncoding& range : ranges) {
    if (range.changed == 0) continue;
    positions = put_varint_at(positions, range.first - next);
    const uint64_t rest = range.position_bytes - range.first_varint_bytes;
    if (rest > 0) std::memcpy(positions, range.positions.data() + range.first_varint_bytes, rest);
    positions += rest;
    std::memcpy(values, range.values.data(), range.value_bytes);
    values += range.value_bytes;
    next = range.last + 1;
  }
  const uint64_t checksum_at = encoded.size() - 8;
  put_u64(encoded.data() + checksum_at, XXH64(encoded.data(), checksum_at, 0));
  return encoded;
}

}  // namespace

std::optional<std::vector<std::byte>> encode_changed_elements(std::span<const std::byte> base,
                                                              std::span<const std::byte> tensor, uint64_t element_bytes,
                                                              uint64_t limit, unsigned threads,
                                                              const TensorWindows* held) {
  WS_EXPECT(base.size() == tensor.size(), ErrorCode::kInvalidArgument,
            "cannot encode changed elements: the base has " + std::to_string(base.size()) + " bytes, the tensor " +
                std::to_string(tensor.size()));
  if (!std::has_single_bit(element_bytes) || element_bytes > 8 || tensor.size() % element_bytes != 0) return std::nullopt;
  if (kChangedElementsOverhead > limit) return std::nullopt;
  const uint64_t elements = tensor.size() / element_bytes;
  HeldRuns runs;
  if (held != nullptr && !held->whole) {
    WS_EXPECT(held->rows * held->columns == elements, ErrorCode::kInvalidArgument,
              "cannot encode changed elements: windows of a " + std::to_string(held->rows) + " x " +
                  std::to_string(held->columns) + " tensor over " + std::to_string(elements) + " elements");
    held->for_each_range([&](uint64_t begin, uint64_t end) { runs.emplace_back(begin, end); });
  } else if (elements > 0) {
    runs.emplace_back(0, elements);
  }
  uint64_t held_elements = 0;
  for (const auto& [begin, end] : runs) held_elements += end - begin;
  if (sample_says_dense(base.data(), tensor.data(), elements, held_elements, element_bytes, limit)) return std::nullopt;
  // Ranges split the span from the first held element to the last.
  const uint64_t first = runs.empty() ? 0 : runs.front().first, last = runs.empty() ? 0 : runs.back().second;
  const uint64_t range_count =
      threads > 1 && held_elements * element_bytes >= kParallelEncodingBytes
          ? std::min<uint64_t>(uint64_t{4} * threads, held_elements * element_bytes / kRangeMinimumBytes)
          : 1;
  // Kept between calls on the calling thread: fresh memory for every tensor costs more in page
  // faults than the encoding itself.
  thread_local std::vector<RangeEncoding> kept;
  if (kept.size() < range_count) kept.resize(range_count);
  std::vector<RangeEncoding>& ranges = kept;  // the calling thread's, also on the workers
  EncodingBudget budget;
  budget.limit = limit;
  auto encode = [&](size_t, size_t item) {
    const uint64_t span = last - first;
    encode_range(base.data(), tensor.data(), first + span * item / range_count, first + span * (item + 1) / range_count,
                 runs, element_bytes, budget, ranges[item]);
  };
  if (range_count == 1) {
    encode(0, 0);
  } else {
    detail::run_parallel(range_count, threads, encode);
  }
  std::optional<std::vector<std::byte>> encoded;
  if (!budget.over.load() && budget.bytes.load() <= limit) encoded = join_ranges(std::span(ranges.data(), range_count));
  // What a large tensor's encoding grew is not kept for the next one.
  for (RangeEncoding& range : ranges) {
    if (range.positions.capacity() + range.values.capacity() <= kKeptBytes) continue;
    std::vector<std::byte>().swap(range.positions);
    std::vector<std::byte>().swap(range.values);
  }
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
