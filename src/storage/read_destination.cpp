// Destinations of storage reads (read_destination.hpp).
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <cstdint>

#include "storage/local_io.hpp"
#include "storage/shared/read_destination.hpp"

namespace weightstream::storage {
namespace {

#ifndef MADV_POPULATE_WRITE
constexpr int MADV_POPULATE_WRITE = 23;  // Linux 5.14; older headers lack it
#endif

}  // namespace

void populate_destination(std::span<std::byte> destination) noexcept {
  if (destination.empty()) return;
  // Whole pages around the destination: populating never changes a byte, so the pages at
  // its ends, which it may share with a neighbour another reader is writing, are safe.
  const size_t page = static_cast<size_t>(local_io::page_size());
  const auto first = reinterpret_cast<uintptr_t>(destination.data()) / page * page;
  const auto last = (reinterpret_cast<uintptr_t>(destination.data()) + destination.size() + page - 1) / page * page;
  constexpr size_t kWindowPages = 4096;  // mincore's answer for 16 MiB of 4 KiB pages
  std::array<unsigned char, kWindowPages> resident;
  for (uintptr_t window = first; window < last;) {
    const size_t pages = std::min<size_t>(kWindowPages, (last - window) / page);
    if (::mincore(reinterpret_cast<void*>(window), pages * page, resident.data()) != 0) return;
    // One call from the first missing page to the last: present pages in between cost a
    // page-table walk each, far less than the fault they replace.
    size_t begin = 0;
    while (begin < pages && (resident[begin] & 1)) ++begin;
    size_t end = pages;
    while (end > begin && (resident[end - 1] & 1)) --end;
    // An error (EINVAL: an older kernel, or memory of a driver's mapping) leaves the pages
    // to fault in as the read writes them.
    if (begin < end) ::madvise(reinterpret_cast<void*>(window + begin * page), (end - begin) * page, MADV_POPULATE_WRITE);
    window += pages * page;
  }
}

uint64_t segments_bytes(std::span<const std::span<std::byte>> segments) noexcept {
  uint64_t total = 0;
  for (std::span<std::byte> segment : segments) total += segment.size();
  return total;
}

std::vector<std::span<std::byte>> slice_segments(std::span<const std::span<std::byte>> segments, uint64_t begin,
                                                 uint64_t length) {
  std::vector<std::span<std::byte>> slice;
  uint64_t segment_begin = 0;
  for (std::span<std::byte> segment : segments) {
    if (length == 0) break;
    const uint64_t segment_end = segment_begin + segment.size();
    if (begin < segment_end) {
      const uint64_t from = begin - segment_begin;
      const uint64_t take = std::min<uint64_t>(length, segment.size() - from);
      if (take > 0) slice.push_back(segment.subspan(from, take));
      begin += take;
      length -= take;
    }
    segment_begin = segment_end;
  }
  return slice;
}

}  // namespace weightstream::storage
