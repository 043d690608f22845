// What every Storage backend shares: the scatter read by one read() per segment, runs read
// with their small gaps by one read() each, and
// borrowing by a read into memory of the borrower's own.
#include <cstring>
#include <vector>

#include "storage/run_groups.hpp"
#include "weightstream/storage.hpp"

namespace weightstream {

void Storage::read_scattered(std::string_view name, uint64_t offset, std::span<const std::span<std::byte>> segments) {
  for (std::span<std::byte> segment : segments) {
    read(name, offset, segment);
    offset += segment.size();
  }
}

uint64_t Storage::read_runs(std::string_view name, uint64_t offset, std::span<std::byte> destination,
                           std::span<const ByteRange> runs, RunPlacement placement) {
  uint64_t fetched = 0;
  uint64_t packed = 0;  // kPacked: where the next run lands
  std::vector<std::byte> group_bytes;  // kPacked: a group of several runs, gaps and all
  // Runs whose gaps are small enough share one read; the gaps land in `destination` too
  // (packed: in memory of this call's own, from which the runs are copied out).
  storage::for_each_run_group(runs, run_merge_gap(), [&](size_t first, size_t last) {
    const uint64_t begin = runs[first].offset;
    const uint64_t end = runs[last].offset + runs[last].length;
    fetched += end - begin;
    if (placement == RunPlacement::kAtOffsets) return read(name, begin, destination.subspan(begin - offset, end - begin));
    if (first == last) {
      read(name, begin, destination.subspan(packed, end - begin));
      packed += end - begin;
      return;
    }
    group_bytes.resize(end - begin);
    read(name, begin, group_bytes);
    for (size_t r = first; r <= last; ++r) {
      std::memcpy(destination.data() + packed, group_bytes.data() + (runs[r].offset - begin), runs[r].length);
      packed += runs[r].length;
    }
  });
  return fetched;
}

Bytes Storage::borrow(std::string_view name, uint64_t offset, uint64_t length, const BorrowOptions& /*options*/) {
  // Not zeroed first: read() fills every byte or throws.
  std::shared_ptr<std::byte[]> copy = std::make_shared_for_overwrite<std::byte[]>(length);
  read(name, offset, std::span(copy.get(), length));
  return {std::span<const std::byte>(copy.get(), length), copy, copy.get(), false};
}

}  // namespace weightstream
